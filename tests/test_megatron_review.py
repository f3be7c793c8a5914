"""turbomoe's Megatron-core MoE layer against stock megatron-core 0.16.1's whole MoELayer on the CPU, fp64,
stock's own TopKRouter included (test_megatron.py routes stock's layer with turbomoe's router): outputs,
every gradient, the logged losses, the expert-bias counts and update, the global aux loss's buffers, the
RNG state after a forward and the distributed-checkpoint layout; the experts' fused-SwiGLU options as
stock's experts run them; the router's hooks (Megatron DDP's param all-gather wait) in the layer;
expert parallelism over two gloo ranks. The helpers (and what lets stock run on
the CPU) are tests/megatron_review_script.py's."""
import os
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402

from launching import ROOT, deepspeed_launch, launcher_env  # noqa: E402
from megatron_common import model_parallel  # noqa: E402
from megatron_review_script import (build_pair, check_step, config, finalize_step, hot_tokens,  # noqa: E402
                                    sharded_layout, step, stock_on_cpu)


@pytest.fixture(scope="module", autouse=True)
def parallel_state():
    with model_parallel("gloo"):
        yield


def tokens(shape, hidden, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, hidden, dtype=torch.float64, generator=g)
    return x, torch.randn(x.shape, dtype=torch.float64, generator=g)


LAYER_CASES = {  # name: (config overrides, tokens [s, b], hot expert, nonzero expert bias)
    "top-1 pre-softmax, E 7, jitter": (dict(num_moe_experts=7, moe_router_topk=1, moe_router_pre_softmax=True,
                                            moe_input_jitter_eps=0.05), (5, 3), None, False),
    "top-2 scaled, per-token loss": (dict(moe_router_topk_scaling_factor=2.5, calculate_per_token_loss=True),
                                     (9, 4), None, False),
    "top-3 sigmoid, bias, capacity, seq aux": (
        dict(num_moe_experts=7, moe_router_topk=3, moe_router_score_function="sigmoid",
             moe_router_enable_expert_bias=True, moe_expert_capacity_factor=0.5,
             moe_router_load_balancing_type="seq_aux_loss"), (11, 5), None, True),
    "top-4, fewer tokens than experts": (dict(num_moe_experts=9, moe_router_topk=4), (1, 3), None, False),
    "top-5 sigmoid, k = E": (dict(num_moe_experts=5, moe_router_topk=5, moe_router_score_function="sigmoid"),
                             (3, 1), None, False),
    "top-8, all aux losses, fp32 router": (
        dict(num_moe_experts=11, moe_router_topk=8, moe_router_dtype="fp32",
             moe_router_load_balancing_type=["aux_loss", "seq_aux_loss", "global_aux_loss"],
             moe_aux_loss_coeff=[0.01, 0.02, 0.03]), (7, 3), None, False),
    "top-2 hot expert, capacity": (dict(moe_expert_capacity_factor=1.0), (9, 5), 2, False),
    "top-6 pre-softmax, capacity, input-dtype router": (
        dict(num_moe_experts=13, moe_router_topk=6, moe_router_pre_softmax=True, moe_expert_capacity_factor=0.75,
             moe_router_dtype=None), (5, 3), None, False),
    "shared expert with gate, layer recompute, jitter": (
        dict(moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True, moe_input_jitter_eps=0.05,
             recompute_granularity="selective", recompute_modules=["moe", "shared_experts"]), (9, 4), None, False),
    "num groups without group top-k (plain top-k)": (dict(num_moe_experts=8, moe_router_num_groups=4), (7, 3),
                                                     None, False),
    "group top-k 0 (plain top-k)": (dict(num_moe_experts=8, moe_router_num_groups=4, moe_router_group_topk=0),
                                    (7, 3), None, False),
    "gelu, no load balancing": (dict(gated_linear_unit=False, activation_func=F.gelu,
                                     moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0),
                                (7, 3), None, False),
}


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_layer_matches_stock(case):
    overrides, shape, hot, bias = LAYER_CASES[case]
    cfg = config(**overrides)
    stock, turbo = build_pair(cfg, hot_expert=hot, expert_bias=bias)
    assert turbo.moe_layer_recompute == stock.moe_layer_recompute
    x, w = tokens(shape, cfg.hidden_size)
    check_step(stock, turbo, x if hot is None else hot_tokens(x), w, case)


def test_expert_bias_and_global_aux_over_steps_match_stock():
    """Two steps of two micro-batches, finalize_model_grads' bias update and resets in between: the
    same biases, counts and global aux buffers, then eval and no-grad forwards (no losses, and counts
    only where grad is enabled, as stock)."""
    cfg = config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                 moe_router_bias_update_rate=0.05, moe_router_load_balancing_type="global_aux_loss")
    stock, turbo = build_pair(cfg, expert_bias=True)
    for s in range(2):
        for mb in range(2):
            check_step(stock, turbo, *tokens((7, 3), cfg.hidden_size, seed=10 * s + mb), f"step {s} mb {mb}")
        finalize_step(cfg, stock, turbo)
    x, _ = tokens((7, 3), cfg.hidden_size, seed=99)
    for train, grad in ((False, True), (True, False)):
        outs = []
        for layer in (stock, turbo):
            layer.train(train)
            with torch.set_grad_enabled(grad):
                outs.append(step(layer, x, torch.zeros_like(x)) if grad else None)
        for buf in ("local_tokens_per_expert", "ga_steps"):
            assert torch.equal(getattr(turbo.router, buf), getattr(stock.router, buf)), (train, grad, buf)
        if grad:
            assert outs[0][3] == {} and outs[1][3] == {}, "losses logged outside training"


@pytest.mark.parametrize("probs_before_fc2", [False, True])
@pytest.mark.parametrize("option", ["clamp", "fp8 input store"])
def test_fused_swiglu_options_match_stock(option, probs_before_fc2):
    """With bias_activation_fusion stock's experts run Megatron's fused weighted SwiGLU, which ignores
    activation_func_clamp_value and, with activation_func_fp8_input_store, forms the gradients from its
    input stored in fp8. turbomoe's default path clamped (outputs 90% off) and kept the exact input
    (gradients 2-4% off); with probs_before_fc2 it ran Megatron's function and agreed."""
    extra = (dict(activation_func_clamp_value=0.05) if option == "clamp"
             else dict(activation_func_fp8_input_store=True))
    cfg = config(bias_activation_fusion=True, **extra)
    stock, turbo = build_pair(cfg, probs_before_fc2=probs_before_fc2)
    check_step(stock, turbo, *tokens((9, 4), cfg.hidden_size), option)


def test_router_hooks_run_in_the_layer():
    """Megatron's DDP with the distributed optimizer's overlapped param all-gather waits for each module's
    own parameters in a forward pre-hook on that module. Stock's MoELayer calls its router as a module;
    turbomoe's called router.route, so the router weight's all-gather was never waited on (the router
    read a stale or half-gathered weight wherever it starts a bucket; one-parameter buckets here)."""
    cfg = config()
    for layer in build_pair(cfg):
        with stock_on_cpu():
            ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
                use_distributed_optimizer=True, overlap_param_gather=True, overlap_grad_reduce=True, bucket_size=1),
                layer)
        group = ddp.param_to_bucket_group[layer.router.weight]
        assert all(ddp.param_to_bucket_group[p] is not group for p in layer.parameters() if p is not layer.router.weight)
        with mock.patch.object(group, "finish_param_sync", wraps=group.finish_param_sync) as wait, stock_on_cpu():
            ddp(tokens((5, 2), cfg.hidden_size)[0])
        assert wait.called, f"{type(layer).__name__}: the router weight's all-gather was not waited on"


def test_sharded_state_dict_layout_matches_stock():
    """The whole layer's distributed-checkpoint entries (router weight and expert bias, experts, shared
    experts and their extra states): the same keys, global shapes and elements held as stock's."""
    cfg = config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                 moe_shared_expert_intermediate_size=16)
    stock, turbo = build_pair(cfg)
    layout = sharded_layout(stock)
    assert ("ShardedTensor", "mlp.router.expert_bias") in layout
    assert sharded_layout(turbo) == layout


def test_expert_parallel_two_gloo_ranks_match_stock():
    proc = deepspeed_launch(os.path.join(ROOT, "tests", "megatron_review_script.py"), env=launcher_env(cpu=True),
                            timeout=240)
    for rank in range(2):
        assert f"REVIEW PASS {rank}" in proc.stdout, proc.stdout[-4000:]
