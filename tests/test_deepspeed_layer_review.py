"""The DeepSpeed drop-in's layer (TurboMOELayer: dispatch, experts, all-to-all, combine) against
stock's MOELayer in float64 (stock's router runs in fp32 either way): output, l_aux, exp_counts,
every gradient, the state dict and the generator's state after a forward; single process, and
over a 2-rank expert-parallel group on gloo (tests/ds_layer_review_script.py)."""
import json
import os

import pytest
import torch

pytest.importorskip("deepspeed")
from launching import ROOT, deepspeed_launch, launcher_env  # noqa: E402
from test_deepspeed_fidelity import E, M, assert_same, make_pair, run  # noqa: E402

D = torch.float64
TOL = 1e-4  # relative; the fp32 router's rounding reaches ~1e-5 in gradients that cancel (coefficient.bias)


def route_first_choices_to(layers, expert, logit):
    """Zero router but for expert's row: every token of x ~ 0.55 picks it first by a logit gap ~logit."""
    for layer in layers:
        with torch.no_grad():
            layer.deepspeed_moe.gate.wg.weight.zero_()[expert] = logit / (0.55 * M)


@pytest.mark.parametrize("expert", ["mlp", "swiglu", "custom"])
def test_fp64_combine_weights_clamp_at_stocks_fp32_eps(expert):
    """top-2 with drops: one expert is every token's first choice by a logit gap of ~20, so the
    tokens it drops keep only a second route of probability ~2e-9. Stock renormalises its fp32
    gates over a sum clamped at fp32's eps (weight ~0.02); with fp64 experts the drop-in's gather
    renormalised in fp64 (weight 1): the output 100-170% off, norm-wise (SwiGLU experts, weighed
    in their activation by weights formed from the fp32 scores, were right)."""
    stock, turbo = make_pair(expert, dtype=D, k=2, capacity_factor=1.0)
    route_first_choices_to((stock, turbo), 3, 20.0)
    x = 0.5 + 0.1 * torch.rand(40, M, dtype=D)
    want, got = run(stock, x), run(turbo, x)
    probs = torch.softmax(x.float() @ stock.deepspeed_moe.gate.wg.weight.float().t(), 1)
    assert 0 < probs.topk(2).values[:, 1].max() < torch.finfo(torch.float32).eps
    assert want[2][3] == 40 > 10  # C = 10: expert 3 drops 30 first routes
    assert_same(want, got, TOL)


# every token's first choice one expert (route_first_choices_to) by a logit gap of ~4: larger, the
# gate's gradient (~ the other probabilities) is fp32 rounding in stock and in the drop-in alike
ONE_EXPERT = "one_expert"
# (expert kind, MoE kwargs, input shape or ONE_EXPERT, used_token, train)
CASES = [
    ("mlp", dict(k=1, capacity_factor=0.5), (2, 19, M), False, True),  # RTS drops
    ("swiglu", dict(k=1, eval_capacity_factor=float(E), use_rts=False, noisy_gate_policy="RSample"), (37, M), False,
     False),
    ("custom", dict(k=1, capacity_factor=0.7, noisy_gate_policy="RSample", use_residual=True), (37, M), False, True),
    ("swiglu", dict(k=1, drop_tokens=False, noisy_gate_policy="Jitter"), (3, 7, M), False, True),
    ("mlp", dict(k=1, drop_tokens=False, use_rts=False), (5, M), True, True),  # S < E, used_token
    ("mlp", dict(k=1, capacity_factor=2.0, eval_capacity_factor=0.4, min_capacity=3), (37, M), True, False),
    ("swiglu", dict(k=1, capacity_factor=1.0), ONE_EXPERT, False, True),
    ("custom", dict(k=1, drop_tokens=False), ONE_EXPERT, False, True),
    ("mlp", dict(k=2, capacity_factor=0.5), (2, 19, M), False, True),
    ("swiglu", dict(k=2, capacity_factor=0.5, use_residual=True, noisy_gate_policy="Jitter"), (37, M), False, True),
    ("custom", dict(k=2, capacity_factor=0.6, top2_2nd_expert_sampling=False), (37, M), True, True),
    ("mlp", dict(k=2, drop_tokens=False, use_residual=True), (3, 7, M), False, True),
    ("swiglu", dict(k=2, drop_tokens=False, noisy_gate_policy="RSample"), (5, M), False, True),
    ("mlp", dict(k=2, capacity_factor=3.0, eval_capacity_factor=0.5, min_capacity=2), (37, M), False, False),
    ("swiglu", dict(k=2, drop_tokens=False), ONE_EXPERT, False, True),
    ("mlp", dict(k=3, capacity_factor=0.5), (2, 19, M), False, True),
    ("swiglu", dict(k=3, drop_tokens=False, use_residual=True), (37, M), False, False),
    ("custom", dict(k=4, capacity_factor=0.5), (5, M), False, True),
    ("swiglu", dict(k=E, capacity_factor=0.3), (37, M), False, True),
]


@pytest.mark.parametrize("expert,kw,shape,used,train", CASES)
def test_layer_matches_stock_fp64(expert, kw, shape, used, train):
    """Drops (RTS, first come, highest probability), dropless, noisy gates, PR-MoE's residual,
    used_token, eval's capacity factor, [B, T, M] and [S, M], S < E, one expert every token's first
    choice: the same results as stock, the same state dict, and the generator left where stock
    leaves it (a dropout after the layer draws the same)."""
    stock, turbo = make_pair(expert, dtype=D, **kw)
    assert {n: (t.shape, t.dtype) for n, t in stock.state_dict().items()} == \
        {n: (t.shape, t.dtype) for n, t in turbo.state_dict().items()}
    if shape == ONE_EXPERT:
        route_first_choices_to((stock, turbo), 6, 4.0)
        x = 0.5 + 0.1 * torch.rand(40, M, dtype=D)
    else:
        x = torch.randn(shape, dtype=D) + 0.3  # offset: a skewed router, over-full experts
    used_token = (torch.arange(x.numel() // M) % 3 != 0).long() if used else None
    results, next_draws = [], []
    for layer in (stock, turbo):
        layer.train(train)
        results.append(run(layer, x, used_token=used_token))
        next_draws.append(torch.rand(4))
    assert_same(*results, TOL)
    assert results[1][0].shape == x.shape
    assert torch.equal(*next_draws)


def test_expert_parallel_matches_stock_fp64(tmp_path):
    """ep_size = 2 on two gloo ranks: drops, dropless with other token counts on each rank (C is the
    largest count over the group), noisy gates, eval, residual, top-1 to top-3, and the fp64 combine
    weights of test_fp64_combine_weights_clamp_at_stocks_fp32_eps past the all-to-all."""
    script = os.path.join(ROOT, "tests", "ds_layer_review_script.py")
    deepspeed_launch(script, "--workdir", tmp_path, env=launcher_env(cpu=True), timeout=180)
    for rank in range(2):
        with open(os.path.join(tmp_path, f"result_rank{rank}.json")) as f:
            cases = json.load(f)
        for name, rec in cases.items():
            where = (rank, name)
            assert rec["same_grad_names"] and rec["counts_equal"] and rec["rng_equal"], (where, rec)
            bad = {n: e for n, e in rec["err"].items() if not e < TOL}
            assert not bad, (where, bad)
            assert any(".deepspeed_experts.3." in n for n in rec["err"]), where  # four local experts
        # the cases meant to drop do (an expert over its capacity), one_expert's at 40 > C = 10
        assert cases["top2_one_expert_drops"]["max_count"] == 40
        assert cases["top1_rts_drops"]["max_count"] > 5 and cases["top2_drops"]["max_count"] > 10
        assert cases["top2_dropless_uneven"]["tokens"] == (24, 40)[rank]
