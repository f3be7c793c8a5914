"""turbomoe's Megatron-core MoE layer against stock megatron-core 0.16.1's whole MoELayer on the CPU, fp64:
the helpers of tests/test_megatron_review.py and its expert-parallel run over two gloo ranks:

    deepspeed --num_gpus 2 tests/megatron_review_script.py     (CPU ranks: launching.launcher_env(cpu=True))

Stock's side is its own TopKRouter, allgather dispatcher and SequentialMLP. Stock 0.16.1 builds its router's
buffers on torch.cuda.current_device(), moves its weight there, and calls Transformer Engine's GEMM in
router_gating_linear (a NameError without TE); `stock_on_cpu` points the device at the CPU, binds
te_general_gemm to None (the value stock's code tests for) and lets Megatron's recompute checkpoint skip
the CUDA generator. Stock's softmax runs in fp32 on fp64 logits, so values agree to ~1e-7 of their
scale (TOL).

Each rank holds half of E = 8 experts and its own tokens; every case compares the output, the input,
router and local expert gradients, the logged losses, the expert-bias counts (and Megatron's bias update)
and the global aux loss's buffers; the distributed-checkpoint keys, shapes and offsets of both layers
agree. Prints "REVIEW PASS <rank>" at the end.
"""
import contextlib
import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.dist_checkpointing.dict_utils import nested_values  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories  # noqa: E402
from megatron.core.distributed.finalize_model_grads import (_update_router_expert_bias,  # noqa: E402
                                                            reset_model_temporary_tensors)
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec  # noqa: E402
from megatron.core.tensor_parallel import random as tp_random  # noqa: E402
from megatron.core.transformer.moe import moe_utils  # noqa: E402
from megatron.core.transformer.spec_utils import build_module  # noqa: E402

from megatron_common import copy_stock_moe_to_turbomoe, experts_as_stock, model_parallel, moe_config  # noqa: E402
from turbomoe.integrations import megatron as tm  # noqa: E402

TOL = 1e-6  # max |turbomoe - stock| / max |stock|, per tensor


@contextlib.contextmanager
def stock_on_cpu():
    with mock.patch("torch.cuda.current_device", return_value="cpu"), \
            mock.patch.object(moe_utils, "te_general_gemm", None, create=True), \
            mock.patch.object(tp_random, "_get_cuda_rng_state", return_value=None), \
            mock.patch.object(tp_random, "_set_cuda_rng_state"):
        yield


def config(**overrides):
    """moe_config in fp64 (parameters and router)."""
    return moe_config(**{"params_dtype": torch.float64, "moe_router_dtype": "fp64", **overrides})


def build_pair(cfg, hot_expert=None, expert_bias=False, experts_seed=None, **turbomoe_kwargs):
    """(stock MoELayer, turbomoe's) with the same weights; hot_expert: an expert every token of mean
    about 1 picks (hot_tokens); expert_bias: a nonzero bias, so that it steers the choices; experts_seed:
    the local experts' weights moved by noise of this seed (each rank its own experts: built under one
    seed, expert e of rank 0 would equal expert e of rank 1, and a token sent to the wrong rank would
    go unseen in the output)."""
    with stock_on_cpu():
        torch.manual_seed(0)
        stock = build_module(get_moe_module_spec(use_te=False, num_experts=cfg.num_moe_experts), config=cfg)
        turbo = build_module(tm.get_turbomoe_moe_spec(cfg, **turbomoe_kwargs), config=cfg)
    with torch.no_grad():
        if hot_expert is not None:
            stock.router.weight[hot_expert] += 0.05
        if expert_bias:
            stock.router.expert_bias.copy_(torch.linspace(0.3, -0.3, cfg.num_moe_experts))
        if experts_seed is not None:
            g = torch.Generator().manual_seed(experts_seed)
            for p in stock.experts.parameters():
                p.add_(torch.randn(p.shape, dtype=p.dtype, generator=g), alpha=0.05)
    copy_stock_moe_to_turbomoe(stock, turbo)
    if stock.shared_experts is not None:
        turbo.shared_experts.load_state_dict(stock.shared_experts.state_dict())
    for layer in (stock, turbo):
        layer.set_layer_number(1)
    return stock, turbo


def hot_tokens(x):
    """x + 1: every token's logit of the hot expert gains about 0.05 * hidden_size = 1.6, several times the
    others' spread, yet its probs stay apart in fp32 (stock's softmax rounds to fp32, and its capacity's
    top-k breaks ties in its own order)."""
    return x + 1.0


def step(layer, x, w):
    """Forward (RNG seeded: the input jitter draws alike) and backward of sum(out * w) -> output, input
    gradient, the RNG state after the forward and the logged losses."""
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    tracker.clear()
    xi = x.clone().requires_grad_()
    torch.manual_seed(1)
    with stock_on_cpu():
        out, _ = layer(xi)
        rng = torch.get_rng_state()
        (out * w).sum().backward()
    losses = {name: entry["values"].clone() for name, entry in tracker.items()}
    tracker.clear()
    return out.detach(), xi.grad, rng, losses


def assert_near(got, want, what, tol=TOL):
    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item() if want.numel() else 0.0
    assert got.shape == want.shape and err < tol, f"{what}: {err:.3g} (shape {tuple(got.shape)})"


def check_step(stock, turbo, x, w, what=""):
    """One step of both layers: everything the module doc lists, equal."""
    (o1, gx1, rng1, losses1), (o2, gx2, rng2, losses2) = step(stock, x, w), step(turbo, x, w)
    assert_near(o2, o1, f"{what} output")
    assert_near(gx2, gx1, f"{what} input grad")
    assert_near(turbo.router.weight.grad, stock.router.weight.grad, f"{what} router grad")
    for name, g in experts_as_stock(turbo, grads=True).items():
        assert_near(g, stock.get_parameter(name).grad, f"{what} {name} grad")
    assert torch.equal(rng2, rng1), f"{what} RNG state after the forward"
    assert losses2.keys() == losses1.keys(), (what, losses2.keys(), losses1.keys())
    for name in losses1:
        assert_near(losses2[name], losses1[name], f"{what} logged {name}")
    for buf in ("local_tokens_per_expert", "global_tokens_per_expert", "ga_steps", "expert_bias"):
        if getattr(stock.router, buf, None) is not None:
            assert torch.equal(getattr(turbo.router, buf), getattr(stock.router, buf)), f"{what} router.{buf}"


def finalize_step(cfg, stock, turbo):
    """What finalize_model_grads does to the routers after a step: Megatron's expert-bias update
    (its counts summed over the data-parallel ranks), then the counts and global aux buffers reset."""
    with stock_on_cpu():
        for layer in (stock, turbo):
            _update_router_expert_bias([layer], cfg)
            reset_model_temporary_tensors(cfg, [layer])
    assert torch.equal(turbo.router.expert_bias, stock.router.expert_bias)


def sharded_layout(layer):
    """{(kind, key): (global shape, elements this rank holds)} of a layer's distributed-checkpoint entries
    (GroupedMLP's layout shards its experts' tensors otherwise than SequentialMLP's, over the same global
    tensors)."""
    with stock_on_cpu():
        sd = layer.sharded_state_dict(prefix="mlp.")
    apply_factories(sd)
    out = {}
    for t in nested_values(sd):
        if isinstance(t, (ShardedTensor, ShardedObject)):
            shape, held = out.get((type(t).__name__, t.key), (tuple(t.global_shape), 0))
            assert shape == tuple(t.global_shape), t.key
            out[(type(t).__name__, t.key)] = (shape, held + (t.data.numel() if isinstance(t, ShardedTensor) else 1))
    return out


EP_CASES = {  # name: (config overrides, build_pair keywords)
    "dropless top-2": (dict(), dict()),
    "capacity probs top-3": (dict(moe_router_topk=3, moe_expert_capacity_factor=0.5), dict()),
    "probs before fc2, capacity": (dict(moe_expert_capacity_factor=1.0), dict(probs_before_fc2=True)),
    "gelu, probs in the gather": (dict(gated_linear_unit=False, activation_func=torch.nn.functional.gelu), dict()),
    # every token to expert 0 (rank 0's): rank 1's experts receive none, their gradients are zero
    "one hot expert top-1": (dict(moe_router_topk=1, moe_router_pre_softmax=True), dict(hot_expert=0)),
    "sigmoid, expert bias, seq + global aux": (
        dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
             moe_router_load_balancing_type=["seq_aux_loss", "global_aux_loss"], moe_aux_loss_coeff=[0.01, 0.02]),
        dict(expert_bias=True)),
}


def main():
    rank = int(os.environ["RANK"])
    with model_parallel("gloo", ep=2):
        for name, (overrides, kwargs) in EP_CASES.items():
            cfg = config(num_moe_experts=8, expert_model_parallel_size=2, **overrides)
            stock, turbo = build_pair(cfg, experts_seed=100 + rank, **kwargs)
            g = torch.Generator().manual_seed(10 + rank)  # each rank its own tokens
            x = torch.randn(7, 3, cfg.hidden_size, dtype=torch.float64, generator=g)
            w = torch.randn(x.shape, dtype=torch.float64, generator=g)
            hot = kwargs.get("hot_expert")
            if hot is not None:
                x = hot_tokens(x)
            check_step(stock, turbo, x, w, f"rank {rank}, {name}:")
            if hot is not None and rank == 1:
                assert not any(g.any() for g in experts_as_stock(turbo, grads=True).values()), "rank 1 got tokens"
            if cfg.moe_router_enable_expert_bias:
                finalize_step(cfg, stock, turbo)
                check_step(stock, turbo, x, w, f"rank {rank}, {name}, after the bias update:")
            print(f"rank {rank}: {name} equal to stock", flush=True)
        assert sharded_layout(turbo) == sharded_layout(stock), "distributed-checkpoint layout"
    print(f"REVIEW PASS {rank}", flush=True)


if __name__ == "__main__":
    main()
