"""turbomoe's DeepSpeed drop-in against stock deepspeed.moe.layer.MoE on the same weights and seeds.

Single process (ep_size = 1); expert parallelism is checked by tests/test_deepspeed_launcher.py.
"""
import gc
import warnings
import weakref

import pytest
import torch
from torch import nn

pytest.importorskip("deepspeed")
import deepspeed.moe.layer as ds_layer  # noqa: E402

from conftest import assert_uniform, rel_err  # noqa: E402
from turbomoe import ops  # noqa: E402
from turbomoe.autograd import grouped_gemm as gg  # noqa: E402
from turbomoe.integrations import deepspeed as tds  # noqa: E402
from turbomoe.integrations import deepspeed_experts as tde  # noqa: E402
from turbomoe.integrations.deepspeed_experts import stack_expert_tensors  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu,
                                              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]
M, F, E = 16, 24, 8


class TupleExpert(nn.Module):
    """A user expert the fast path does not know; returns (out, bias) like Megatron's ParallelMLP."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(M, M)

    def forward(self, x):
        return torch.tanh(self.fc(x)) * 2, self.fc.bias


EXPERTS = {
    "mlp": lambda: nn.Sequential(nn.Linear(M, F), nn.GELU(), nn.Linear(F, M)),
    "swiglu": lambda: tds.SwiGLUExpert(M, F),
    "custom": TupleExpert,
}


def make_pair(expert="mlp", device="cpu", dtype=torch.float32, **kw):
    """A stock layer and a turbomoe layer with identical weights, each expert its own (stock copies
    one expert E times: with equal experts the router's gradient through a renormalised combine is
    exactly zero, so it would go unchecked)."""
    kw = dict(dict(hidden_size=M, num_experts=E, min_capacity=0), **kw)
    torch.manual_seed(1)
    stock = ds_layer.MoE(expert=EXPERTS[expert](), **kw)
    with torch.no_grad():
        for p in stock.deepspeed_moe.experts.parameters():
            p.add_(torch.randn_like(p), alpha=0.3)
    turbo = tds.MoE(expert=EXPERTS[expert](), **kw)
    turbo.load_state_dict(stock.state_dict())
    return stock.to(device, dtype), turbo.to(device, dtype)


def run(layer, x, seed=5, used_token=None):
    """Forward + backward of sum(out^2) + l_aux under a fixed seed: (out, l_aux, counts, dx, grads)."""
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(seed)
    out, l_aux, counts = layer(x, used_token)
    (out.float().square().sum() + l_aux).backward()
    grads = {n: p.grad.float() for n, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    return out.float(), l_aux.float(), counts, x.grad.float(), grads


def assert_same(a, b, tol):
    """fp32: elementwise (atol, rtol), atol in units of the tensor's largest magnitude where above 1
    (a sum's rounding error scales with its terms: on the H100 a gate-weight gradient entry that
    cancels to 0.04 among entries of larger size differed by 3e-5, summed in another order).
    bf16: relative norm error per tensor, since bf16 sums of many terms can cancel to near zero,
    where elementwise relative errors mean nothing."""
    out_a, aux_a, counts_a, dx_a, grads_a = a
    out_b, aux_b, counts_b, dx_b, grads_b = b
    assert counts_b.dtype == counts_a.dtype and torch.equal(counts_b.cpu(), counts_a.cpu())
    assert grads_a.keys() == grads_b.keys()
    pairs = [("out", out_b, out_a), ("l_aux", aux_b, aux_a), ("dx", dx_b, dx_a)]
    pairs += [(name, grads_b[name], grads_a[name]) for name in grads_a]
    for name, got, want in pairs:
        if isinstance(tol, tuple):
            scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
            torch.testing.assert_close(got, want, atol=tol[0] * scale, rtol=tol[1],
                                       msg=lambda m: f"{name} (largest magnitude {scale:.3g}): {m}")
        else:
            assert rel_err(got, want) < tol, (name, rel_err(got, want))


TOL = {torch.float32: (2e-5, 1e-4), torch.bfloat16: 2e-2}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("expert", ["mlp", "swiglu", "custom"])
def test_matches_stock_without_drops(device, dtype, k, expert):
    # capacity factor E: every expert can take every token, nothing drops.
    stock, turbo = make_pair(expert, device, dtype, k=k, capacity_factor=float(E))
    assert turbo.deepspeed_moe.expert_fast_path == (None if expert == "custom" else expert)
    x = torch.randn(4, 32, M, device=device, dtype=dtype)
    assert_same(run(stock, x), run(turbo, x), TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("expert", ["mlp", "swiglu", "custom"])
@pytest.mark.parametrize("kw", [dict(k=2), dict(k=1, capacity_factor=float(E)), dict(k=2, drop_tokens=False)])
def test_trains_under_autocast(device, expert, kw):
    """fp32 parameters under torch.autocast (bf16), forward and backward inside its region and the
    backward after it: stock's output dtype (bf16), fp32 gradients, and the fp32 run's routes, and its
    values to bf16's rounding (the router's logits stay fp32, so the routes are the same)."""
    stock, turbo = make_pair(expert, device, **kw)
    x = torch.randn(4, 32, M, device=device)
    want = run(turbo, x)
    with torch.autocast(device, dtype=torch.bfloat16):
        assert stock(x)[0].dtype == turbo(x)[0].dtype == torch.bfloat16
        inside = run(turbo, x)
    xg = x.clone().requires_grad_()
    torch.manual_seed(5)
    with torch.autocast(device, dtype=torch.bfloat16):
        out, l_aux, counts = turbo(xg)
    (out.float().square().sum() + l_aux).backward()
    after = (out.float(), l_aux.float(), counts, xg.grad.float(), {n: p.grad for n, p in turbo.named_parameters()})
    assert all(g.dtype == torch.float32 for g in after[4].values()) and xg.grad.dtype == torch.float32
    assert_same(want, inside, 3e-2)
    assert_same(want, after, 3e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("expert", ["mlp", "swiglu", "custom"])  # grouped: dropless rows; custom: C = max count
@pytest.mark.parametrize("k,sampling", [(1, False), (2, False), (2, True), (4, False)])
def test_dropless_matches_stock(device, expert, k, sampling):
    stock, turbo = make_pair(expert, device, k=k, drop_tokens=False, top2_2nd_expert_sampling=sampling)
    x = torch.randn(64, M, device=device)
    assert_same(run(stock, x), run(turbo, x), TOL[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k,sampling", [(2, False), (2, True), (4, False)])
def test_drops_match_stock(device, k, sampling):
    """top-2 keeps first choices before second ones, top-k the highest probabilities: as stock."""
    stock, turbo = make_pair("mlp", device, k=k, capacity_factor=0.5, top2_2nd_expert_sampling=sampling)
    x = torch.randn(64, M, device=device)
    a, b = run(stock, x), run(turbo, x)
    # Something is dropped: some expert got more routes than its capacity (a token of top-2/top-k
    # rarely loses all its routes, so a zero output row is no test of it).
    C = ops.capacity(64, E, k, 0.5)
    assert (b[2] > C).any(), (b[2], C)
    assert_same(a, b, TOL[torch.float32])


@pytest.mark.parametrize("k,S,cf", [(1, 100, 1.2), (1, 200, 0.6), (2, 100, 0.6), (2, 90, 1.2)])
def test_drops_at_stocks_fp32_capacity(k, S, cf):
    """Capacities where stock's fp32 rounding and the fp64 formula differ by one (S / E x cf x k = 15
    or 27 exactly: stock 16 and 28): the drop-in keeps as many tokens as stock (top-1, every token
    preferring expert 0; which ones is stock's topk over ties, not a rule) and, at top-2, drops
    what stock drops. Before, it computed the capacity in fp64 and kept one token fewer an expert."""
    C = ops.capacity(S, E, k, cf, fp32=True)
    assert C == ops.capacity(S, E, k, cf) + 1
    stock, turbo = make_pair("mlp", k=k, capacity_factor=cf, **({"use_rts": False} if k == 1 else {}))
    if k == 2:
        x = torch.randn(S, M)
        assert_same(run(stock, x), run(turbo, x), TOL[torch.float32])
        return
    with torch.no_grad():
        for layer in (stock, turbo):
            layer.deepspeed_moe.gate.wg.weight.zero_()
            layer.deepspeed_moe.gate.wg.weight[0] = 1.0
    x = torch.rand(S, M) + 0.5
    kept = [int((run(layer, x)[0].abs().sum(1) > 0).sum()) for layer in (stock, turbo)]
    assert kept == [C, C], (kept, C)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("drop_tokens", [True, False])
def test_in_place_activation_matches_stock(recompute, drop_tokens):
    """Experts with nn.SiLU(inplace=True) run one by one, as stock's: the grouped path's in-place
    activation overwrote its GEMM's output (an autograd error with drop_tokens, with recompute a wrong
    gradient of the second Linear: 2.3%)."""
    expert = nn.Sequential(nn.Linear(M, F), nn.SiLU(inplace=True), nn.Linear(F, M))
    torch.manual_seed(1)
    stock = ds_layer.MoE(hidden_size=M, expert=expert, num_experts=E, k=2, min_capacity=0, drop_tokens=drop_tokens)
    with torch.no_grad():
        for p in stock.deepspeed_moe.experts.parameters():
            p.add_(torch.randn_like(p), alpha=0.3)
    turbo = tds.MoE(hidden_size=M, expert=expert, num_experts=E, k=2, min_capacity=0, drop_tokens=drop_tokens,
                    **({"recompute": True} if recompute else {}))
    turbo.load_state_dict(stock.state_dict())
    assert turbo.deepspeed_moe.expert_fast_path is None
    x = torch.randn(4, 32, M)
    assert_same(run(stock, x), run(turbo, x), TOL[torch.float32])


def test_k_above_the_kernels_runs_stocks_layer():
    """Stock takes any k up to E (and numpy ints): above turbomoe's 8 routes a token the drop-in keeps
    stock's MOELayer (a warning says so), so its results are stock's; turbomoe's own options need k <= 8."""
    import numpy as np
    stock, _ = make_pair(k=10, num_experts=16)
    with pytest.warns(UserWarning, match="DeepSpeed's own MOELayer"):
        _, turbo = make_pair(k=10, num_experts=16)
    assert type(turbo.deepspeed_moe) is type(stock.deepspeed_moe)
    x = torch.randn(2, 16, M)
    assert_same(run(stock, x), run(turbo, x), TOL[torch.float32])
    with pytest.raises(ValueError, match="need k <= 8"):
        tds.MoE(hidden_size=M, expert=EXPERTS["mlp"](), num_experts=16, k=10, norm_topk_prob=True)
    assert make_pair(k=np.int64(2))[1].deepspeed_moe.gate.k == 2


@pytest.mark.parametrize("expert", ["mlp", "swiglu"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_empty_batch(expert, k):
    """S = 0 with min_capacity = 0 and drop_tokens: an empty output and l_aux 0 (stock returns an
    empty output and a NaN l_aux; failed before: RuntimeError, cannot reshape the [E, 0, M] buffer)."""
    _, turbo = make_pair(expert, k=k, min_capacity=0, drop_tokens=True)
    out, l_aux, counts, dx, grads = run(turbo, torch.randn(0, M))
    assert out.shape == (0, M) and l_aux.item() == 0.0 and int(counts.sum()) == 0 and dx.shape == (0, M)
    assert all(torch.isfinite(g).all() for g in grads.values())


@pytest.mark.parametrize("reentrant", [True, False])
def test_rts_under_activation_checkpointing(reentrant):
    """The drop-in draws RTS's uniforms from torch's generator of the tokens' device, as stock, whose
    state torch.utils.checkpoint (as DeepSpeed's and Megatron's recomputation) saves and restores: the
    recompute drops the same routes, so the gradients equal those without checkpointing."""
    from torch.utils.checkpoint import checkpoint
    _, turbo = make_pair("mlp", k=1, capacity_factor=0.5, use_rts=True)
    x = torch.randn(64, M) + 3.0  # skewed router: over-full experts, so RTS drops
    plain = run(turbo, x)
    assert (plain[2] > ops.capacity(64, E, 1, 0.5)).any()

    class Checkpointed(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, used_token=None):
            return checkpoint(self.inner, x, use_reentrant=reentrant)

    recomputed = run(Checkpointed(turbo), x)
    for a, b in zip(plain[:4], recomputed[:4]):
        assert torch.equal(a, b)
    for name, g in plain[4].items():
        assert torch.equal(g, recomputed[4]["inner." + name]), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", ["Jitter", "RSample"])
@pytest.mark.parametrize("k", [1, 2])
def test_noisy_gate_policies_match_stock(device, policy, k):
    stock, turbo = make_pair("mlp", device, k=k, capacity_factor=float(E), noisy_gate_policy=policy)
    x = torch.randn(64, M, device=device)
    assert_same(run(stock, x), run(turbo, x), TOL[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("drop_tokens", [True, False])
def test_used_token_matches_stock(device, drop_tokens):
    stock, turbo = make_pair("mlp", device, k=1, capacity_factor=float(E), drop_tokens=drop_tokens)
    x = torch.randn(64, M, device=device)
    used = (torch.arange(64, device=device) % 3 != 0).long()
    a, b = run(stock, x, used_token=used), run(turbo, x, used_token=used)
    assert_same(a, b, TOL[torch.float32])
    assert int(b[2].sum()) == int(used.sum())


@pytest.mark.parametrize("device", DEVICES)
def test_residual_moe_matches_stock(device):
    stock, turbo = make_pair("mlp", device, k=2, capacity_factor=float(E), use_residual=True)
    x = torch.randn(64, M, device=device)
    assert_same(run(stock, x), run(turbo, x), TOL[torch.float32])


@pytest.mark.parametrize("expert", ["mlp", "swiglu"])
def test_fast_path_weights_are_views_of_packed_params(expert):
    stock, turbo = make_pair(expert, k=2, capacity_factor=float(E))
    local = turbo.deepspeed_moe.experts.deepspeed_experts
    first = local[0].w1.weight if expert == "swiglu" else local[0][0].weight
    blocks = [[e.w1.weight, e.w3.weight] if expert == "swiglu" else [e[0].weight] for e in local]
    stacked = stack_expert_tensors(blocks)
    assert stacked.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()  # no copy
    assert torch.equal(stacked, torch.stack([torch.cat(b) for b in blocks]))
    # The gradients come back as per-expert slices of one batched dW, not as copies.
    x = torch.randn(64, M)
    turbo(x)[0].sum().backward()
    grad_storages = {b[0].grad.untyped_storage().data_ptr() for b in blocks}
    assert len(grad_storages) == 1 and all(b[0].grad.is_contiguous() for b in blocks)
    turbo.zero_grad(set_to_none=True)
    # A parameter moved out of the packed buffer: the stacked weight is a copy, results unchanged.
    first.data = first.data.clone()
    assert stack_expert_tensors(blocks).untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    assert_same(run(stock, x), run(turbo, x), TOL[torch.float32])


def capture_expert_input(layer):
    """Records the [ep, E_local, C, M] buffer handed to the experts (a hook also turns off the fast path)."""
    seen = []
    layer.deepspeed_moe.experts.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach()))
    return seen


@pytest.mark.parametrize("k,policy_kw", [(1, dict(use_rts=True)), (1, dict(use_rts=False)), (2, {}), (4, {})])
def test_no_expert_exceeds_capacity(k, policy_kw):
    _, turbo = make_pair("mlp", k=k, capacity_factor=0.5, **policy_kw)
    seen = capture_expert_input(turbo)
    S = 256
    x = torch.randn(S, M) + 3.0  # a common offset skews the router so some experts overflow
    _, _, counts = turbo(x)[:3]
    C = ops.capacity(S, E, k, 0.5, 0)
    buf = seen[0]
    assert buf.shape == (1, E, C, M)
    kept = (buf[0].abs().sum(-1) != 0).sum(-1)  # rows an expert received
    assert (counts > C).any(), "the test needs an over-full expert"
    assert torch.equal(kept, counts.clamp_max(C))


def test_rts_keeps_uniform_random_subsets():
    """One expert takes all 64 tokens and keeps C = 16: every token is kept 1/4 of the time."""
    _, turbo = make_pair("mlp", k=1, capacity_factor=2.0, use_rts=True)
    with torch.no_grad():
        turbo.deepspeed_moe.gate.wg.weight.zero_()
        turbo.deepspeed_moe.gate.wg.weight[3] = 1.0
    S, trials = 64, 200
    x = torch.rand(S, M) + 0.5  # positive: expert 3 wins every token, no expert output is exactly 0
    torch.manual_seed(0)
    kept_times = torch.zeros(S, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(trials):
            out = turbo(x)[0]
            kept = out.abs().sum(1) != 0
            assert int(kept.sum()) == ops.capacity(S, E, 1, 2.0, 0) == 16
            kept_times += kept
    assert_uniform(kept_times / trials, 16 / S, trials)
    # Deterministic under torch.manual_seed.
    torch.manual_seed(7)
    a = turbo(x)[0]
    torch.manual_seed(7)
    assert torch.equal(a, turbo(x)[0])


def test_activation_checkpointing_recomputes_the_same_routes():
    """RTS's uniforms come from torch's generator, which checkpointing restores before recomputing."""
    _, turbo = make_pair("mlp", k=1, capacity_factor=0.5, use_rts=True)
    x = torch.randn(64, M)
    plain = run(turbo, x, seed=3)
    x_ckpt = x.clone().requires_grad_()
    torch.manual_seed(3)
    out, l_aux, counts = torch.utils.checkpoint.checkpoint(turbo, x_ckpt, use_reentrant=False)
    (out.square().sum() + l_aux).backward()
    grads = {n: p.grad for n, p in turbo.named_parameters()}
    assert_same(plain, (out, l_aux, counts, x_ckpt.grad, grads), TOL[torch.float32])


def test_eval_uses_eval_capacity_factor():
    _, turbo = make_pair("mlp", k=2, capacity_factor=1.0, eval_capacity_factor=3.0)
    seen = capture_expert_input(turbo)
    x = torch.randn(64, M)
    turbo.train()
    turbo(x)
    turbo.eval()
    turbo(x)
    assert seen[0].shape[2] == ops.capacity(64, E, 2, 1.0, 0) == 16
    assert seen[1].shape[2] == ops.capacity(64, E, 2, 3.0, 0) == 48


@pytest.mark.parametrize("k", [2, 4])
def test_eval_with_drops_matches_stock(k):
    stock, turbo = make_pair("mlp", k=k, capacity_factor=float(E), eval_capacity_factor=0.5)
    stock.eval()
    turbo.eval()
    x = torch.randn(64, M)
    assert_same(run(stock, x), run(turbo, x), TOL[torch.float32])


def test_checkpoints_load_both_ways():
    stock, turbo = make_pair("swiglu", k=2)
    assert list(stock.state_dict()) == list(turbo.state_dict())
    assert [n for n, _ in stock.named_parameters()] == [n for n, _ in turbo.named_parameters()]
    assert any(n.startswith("deepspeed_moe.experts.deepspeed_experts.7.") for n in turbo.state_dict())
    with torch.no_grad():
        for p in turbo.parameters():
            p.add_(torch.randn_like(p))
    stock.load_state_dict(turbo.state_dict())
    x = torch.randn(64, M)
    torch.testing.assert_close(run(turbo, x)[0], run(stock, x)[0], atol=2e-5, rtol=1e-4)


def test_expert_params_keep_deepspeed_moe_marks():
    """The engine finds expert parameters by `allreduce = False` and `group_name`."""
    _, turbo = make_pair("mlp", k=1, ep_size=2)
    from deepspeed.moe.utils import is_moe_param
    expert_params = [n for n, p in turbo.named_parameters() if is_moe_param(p)]
    assert expert_params and all(".deepspeed_experts." in n for n in expert_params)
    assert {p.group_name for p in turbo.parameters() if is_moe_param(p)} == {"ep_size_2"}
    assert turbo.num_local_experts == E // 2


def test_patch_swaps_stock_layer_for_unmodified_code():
    from deepspeed.moe.layer import MoE  # as Megatron-DeepSpeed imports it, before any patch
    try:
        tds.patch()
        assert tds.is_patched()
        layer = MoE(hidden_size=M, expert=EXPERTS["mlp"](), num_experts=E, k=2, capacity_factor=float(E))
        assert type(layer) is tds.MoE and isinstance(layer.deepspeed_moe, tds.TurboMOELayer)
        assert isinstance(layer, MoE)  # the engine's isinstance(module, MoE) still holds
    finally:
        tds.unpatch()
    assert not tds.is_patched()
    layer = MoE(hidden_size=M, expert=EXPERTS["mlp"](), num_experts=E, k=2)
    assert type(layer) is MoE and not isinstance(layer.deepspeed_moe, tds.TurboMOELayer)


def test_wall_clock_breakdown_is_recorded():
    """The engine's wall_clock_breakdown sets these flags and reads the times, as for stock."""
    _, turbo = make_pair("mlp", k=2)
    turbo.deepspeed_moe.wall_clock_breakdown = turbo.deepspeed_moe.gate.wall_clock_breakdown = True
    turbo(torch.randn(64, M))
    assert turbo.deepspeed_moe.time_moe > 0 and turbo.deepspeed_moe.gate.gate_time > 0
    assert turbo.deepspeed_moe.time_moe >= turbo.deepspeed_moe.gate.gate_time


@pytest.mark.parametrize("k", [1, 2, 4])
def test_norm_topk_prob_switch(k):
    """norm_topk_prob=None is stock's choice; True / False pick renormalised or raw probabilities."""
    x = torch.randn(2, 16, M)
    kw = dict(hidden_size=M, num_experts=E, k=k, drop_tokens=False, top2_2nd_expert_sampling=False)
    torch.manual_seed(1)
    layers = {v: tds.MoE(expert=EXPERTS["mlp"](), norm_topk_prob=v, **kw) for v in (None, True, False)}
    for v in (True, False):
        layers[v].load_state_dict(layers[None].state_dict())
    outs = {v: layer(x)[0] for v, layer in layers.items()}
    assert torch.equal(outs[None], outs[k >= 2])
    if k >= 2:
        assert not torch.allclose(outs[True], outs[False])
    # Against a per-token loop: out = sum over the top k of (renormalised or raw) p_e * expert_e(x).
    moe = layers[False].deepspeed_moe
    x_SM = x.reshape(-1, M)
    top = torch.topk(torch.softmax(x_SM @ moe.gate.wg.weight.t(), 1), k, dim=1)
    for v in (True, False):
        w = top.values / top.values.sum(1, keepdim=True) if v else top.values
        want = torch.stack([sum(w[s, j] * moe.experts.deepspeed_experts[int(top.indices[s, j])](x_SM[s])
                                for j in range(k)) for s in range(x_SM.shape[0])])
        torch.testing.assert_close(outs[v].reshape(-1, M), want, rtol=1e-5, atol=1e-5)


def test_bad_arguments_raise():
    for k in (17, 0, True, 2.0):  # k above 8 runs stock's layer (test_k_above_the_kernels_runs_stocks_layer)
        with pytest.raises(ValueError, match="k must be"):
            tds.MoE(hidden_size=M, expert=EXPERTS["mlp"](), num_experts=16, k=k)
    with pytest.raises(TypeError, match="norm_topk_prob must be a bool"):
        tds.MoE(hidden_size=M, expert=EXPERTS["mlp"](), num_experts=E, norm_topk_prob="yes")
    with pytest.raises(TypeError, match="fused_grad_accumulation must be a bool"):
        tds.MoE(hidden_size=M, expert=EXPERTS["mlp"](), num_experts=E, fused_grad_accumulation=1)
    with pytest.raises(ValueError, match="noisy_gate_policy"):
        tds.MoE(hidden_size=M, expert=EXPERTS["mlp"](), num_experts=E, noisy_gate_policy="Gaussian")
    _, turbo = make_pair("mlp", k=1)
    with pytest.raises(ValueError, match="used_token"):
        turbo(torch.randn(64, M), torch.ones(63))
    _, turbo = make_pair("mlp", k=1, min_capacity=8)
    with pytest.raises(ValueError, match="min_capacity"):
        turbo(torch.randn(4, M))


@pytest.mark.parametrize("expert", ["mlp", "swiglu"])
@pytest.mark.parametrize("kw", [dict(k=2), dict(k=2, drop_tokens=False)])
@pytest.mark.parametrize("route", ["argument", "environment"])
def test_fused_grad_accumulation_matches_unfused(grads_in_place_taken, monkeypatch, expert, kw, route):
    """fused_grad_accumulation (the argument, or TURBOMOE_FUSED_GRAD_ACCUMULATION=1 for code that builds
    the layer unchanged): three micro-batches accumulating into .grad (float64), every gradient as the
    unfused layer's sums; from the second, each expert weight stack's gradient added into the experts'
    .grad in place."""
    if route == "environment":
        monkeypatch.setenv("TURBOMOE_FUSED_GRAD_ACCUMULATION", "1")
    kw = dict(hidden_size=M, num_experts=E, min_capacity=0, **kw)
    plain = tds.MoE(expert=EXPERTS[expert](), **kw, fused_grad_accumulation=False).double()
    chosen = {"fused_grad_accumulation": True} if route == "argument" else {}  # else the environment's
    fused = tds.MoE(expert=EXPERTS[expert](), **kw, **chosen)
    fused.load_state_dict(plain.state_dict())
    fused.double()
    assert fused.deepspeed_moe.fused_grad_accumulation and not plain.deepspeed_moe.fused_grad_accumulation
    for i in range(3):
        x = torch.randn(64, M, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
        for layer in (plain, fused):
            torch.manual_seed(5)
            out, l_aux, _ = layer(x)
            (out.square().sum() + l_aux).backward()
    # after the first micro-batch, each stack's gradient added in place: unfused by one add (2 or 4
    # stacks); fused, the weights' (2 stacks) inside their GEMMs, an mlp's biases by one add
    stacks = 2 if expert == "swiglu" else 4
    assert len(grads_in_place_taken) == 2 * 2 * stacks and len(grads_in_place_taken.gemm) == 2 * 2
    for (name, p), q in zip(fused.named_parameters(), plain.parameters()):
        assert rel_err(p.grad, q.grad) < 1e-12, name


def count_host_syncs(layer, x) -> int:
    """Synchronizing CUDA calls in one forward + backward (torch's sync debug mode warns on each)."""
    torch.manual_seed(0)
    layer(x)  # warm up: Triton compiles, caches fill
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out, l_aux, _ = layer(x)
            (out.float().square().sum() + l_aux).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("expert,drop_tokens,max_syncs", [
    ("swiglu", True, 0),  # capacity buffers
    ("swiglu", False, 0),  # dropless rows and grouped GEMMs on one rank
    ("custom", False, 1),  # dropless with C = the largest count: one int read
])
def test_host_syncs(k, expert, drop_tokens, max_syncs):
    stock, turbo = make_pair(expert, "cuda", torch.bfloat16, k=k, capacity_factor=1.25, drop_tokens=drop_tokens)
    x = torch.randn(256, M, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    turbo_syncs, stock_syncs = count_host_syncs(turbo, x), count_host_syncs(stock, x)
    assert turbo_syncs <= max_syncs, (turbo_syncs, stock_syncs)
    if not drop_tokens:
        assert turbo_syncs < stock_syncs or (turbo_syncs == stock_syncs == 1 and k == 2), (turbo_syncs, stock_syncs)


@pytest.mark.parametrize("expert", ["mlp", "swiglu"])
@pytest.mark.parametrize("k", [1, 2])
def test_recompute_same_bits_rows_freed(expert, k):
    """recompute=True (turbomoe's argument beyond stock's) on the dropless grouped path: the same
    bits as without, the expert rows' memory freed before the second GEMM and the rows no longer
    alive between forward and backward."""
    _, plain = make_pair(expert, k=k, drop_tokens=False)
    again = tds.MoE(hidden_size=M, expert=EXPERTS[expert](), num_experts=E, min_capacity=0, k=k, drop_tokens=False,
                    recompute=True)
    again.load_state_dict(plain.state_dict())
    x = torch.randn(50, M)
    results, alive, freed = [], [], []
    scatter, mm_forward = ops.scatter_tokens, gg.mm_forward
    for layer in (plain, again):
        rows, calls = [], []

        def scatter_noted(*args, **kw):
            buf = scatter(*args, **kw)
            rows.append(weakref.ref(buf))
            return buf

        def mm_noted(*args, **kw):
            calls.append(None)
            if len(calls) == 2:  # the forward's second GEMM: are the rows' bytes still held?
                freed.append(rows[0]().untyped_storage().nbytes() == 0)
            return mm_forward(*args, **kw)

        ops.scatter_tokens, gg.mm_forward = scatter_noted, mm_noted
        try:
            xi = x.clone().requires_grad_()
            torch.manual_seed(5)
            out, l_aux, _ = layer(xi)
            gc.collect()
            alive.append(rows[0]() is not None)
            (out.square().sum() + l_aux).backward()
        finally:
            ops.scatter_tokens, gg.mm_forward = scatter, mm_forward
        results.append([out, xi.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert alive == [True, False]
    assert freed == [False, True]
    with pytest.raises(TypeError, match="recompute"):
        tds.MoE(hidden_size=M, expert=EXPERTS[expert](), num_experts=E, recompute="yes")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("drop_tokens", [False, True])
def test_swiglu_experts_keep_no_output(k, drop_tokens):
    """On one rank, dropless (expert-contiguous rows) and with a capacity ([E, C, M] buffers), the
    grouped path with bias-free SwiGLU experts applies the combine weights in the experts'
    activation: the experts' output is not kept for backward (the kernel gather would keep it for
    the weights' gradient, as it does for the GELU experts with biases), and the layer still matches
    stock (fp32)."""
    for expert, kept in (("swiglu", False), ("mlp", True)):
        # capacity factor E: the [E, C, M] buffers with nothing dropped
        stock, turbo = make_pair(expert, "cuda", k=k, drop_tokens=drop_tokens, capacity_factor=float(E))
        outputs = []
        grouped = tds.grouped_mlp

        def noted(*args, **kw):
            y = grouped(*args, **kw)
            # its base: the capacity path returns a view of the bias's output, which a view kept
            # for backward keeps alive
            outputs.append(weakref.ref(y if y._base is None else y._base))
            return y

        tds.grouped_mlp = tde.grouped_mlp = noted  # the layer's call, and run_experts' (the capacity path's)
        try:
            x = torch.randn(50, M, device="cuda", requires_grad=True)
            out, l_aux, _ = turbo(x)
            gc.collect()
            assert len(outputs) == 1 and (outputs[0]() is not None) == kept, expert
        finally:
            tds.grouped_mlp = tde.grouped_mlp = grouped
        del out, l_aux
        assert_same(run(stock, x), run(turbo, x), TOL[torch.float32])
