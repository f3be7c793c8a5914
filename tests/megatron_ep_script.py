"""Expert parallelism over 2 GPUs (run by tests/test_megatron_gpu.py):

    torchrun --nproc_per_node 2 tests/megatron_ep_script.py

Each rank holds half the experts (ep = 2) and its own tokens. Stock megatron-core's MoELayer (alltoall
dispatcher, SequentialMLP) and turbomoe's, with the same weights, fp32: equal outputs and gradients,
dropless and with a capacity ("probs" and "position"); no host sync in turbomoe's layer with a
capacity; a distributed checkpoint of each loads into the other. Prints "EP PASS <rank>" at the end.
"""
import os
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec  # noqa: E402
from megatron.core.transformer.moe import moe_utils  # noqa: E402
from megatron.core.transformer.spec_utils import build_module  # noqa: E402

from megatron_common import (copy_stock_moe_to_turbomoe, expert_pairs, experts_as_stock, model_parallel,  # noqa: E402
                             moe_config)
from turbomoe.integrations import megatron as tm  # noqa: E402

if not hasattr(moe_utils, "te_general_gemm"):
    moe_utils.te_general_gemm = None  # stock 0.16.1 without Transformer Engine (see test_megatron_gpu.py)

E = 8
CASES = {  # name: (config overrides, turbomoe spec keywords)
    "dropless": (dict(), dict()),
    "dropless, probs before fc2": (dict(), dict(probs_before_fc2=True)),
    "capacity-probs": (dict(moe_expert_capacity_factor=1.0, moe_token_drop_policy="probs"), dict()),
    "capacity-position, probs before fc2": (dict(moe_expert_capacity_factor=0.75, moe_token_drop_policy="position"),
                                            dict(probs_before_fc2=True)),
}


def build(cfg, **turbomoe_kwargs):
    torch.manual_seed(0)  # the router weight is replicated: the same on both ranks
    stock = build_module(get_moe_module_spec(use_te=False, num_experts=E), config=cfg).cuda()
    turbo = build_module(tm.get_turbomoe_moe_spec(cfg, **turbomoe_kwargs), config=cfg).cuda()
    copy_stock_moe_to_turbomoe(stock, turbo)
    return stock, turbo


def step(layer, x, g):
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out, _ = layer(x)
    out.backward(g)
    return out.detach(), x.grad


def check_case(name, overrides, turbomoe_kwargs, rank):
    cfg = moe_config(num_moe_experts=E, hidden_size=64, moe_ffn_hidden_size=48, expert_model_parallel_size=2,
                     moe_token_dispatcher_type="alltoall", moe_router_dtype="fp32", **overrides)
    stock, turbo = build(cfg, **turbomoe_kwargs)
    torch.manual_seed(100 + rank)  # each rank its own tokens
    x = torch.randn(32, 4, cfg.hidden_size, device="cuda")
    g = torch.randn_like(x)
    (o1, gx1), (o2, gx2) = step(stock, x, g), step(turbo, x, g)
    torch.testing.assert_close(o2, o1, rtol=1e-4, atol=1e-5, msg=f"{name}: output")
    torch.testing.assert_close(gx2, gx1, rtol=1e-4, atol=1e-5, msg=f"{name}: input grad")
    torch.testing.assert_close(turbo.router.weight.grad, stock.router.weight.grad, rtol=1e-4, atol=1e-5)
    for key, grad in experts_as_stock(turbo, grads=True).items():
        torch.testing.assert_close(grad, stock.get_parameter(key).grad, rtol=1e-4, atol=1e-5, msg=f"{name}: {key}")
    if cfg.moe_expert_capacity_factor is not None:  # equal splits: no host sync in the layer
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step(turbo, x, g)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return stock, turbo


def check_checkpoints(stock, turbo):
    path = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    for i, (src, dst) in enumerate(((stock, turbo), (turbo, stock))):
        with torch.no_grad():
            for p in dst.parameters():
                p.add_(1.0)
        d = os.path.join(path[0], str(i))
        if dist.get_rank() == 0:
            os.makedirs(d)
        dist.barrier()
        dist_checkpointing.save(src.sharded_state_dict(prefix="mlp."), d)
        loaded = dist_checkpointing.load(dst.sharded_state_dict(prefix="mlp."), d)
        dst.load_state_dict({k[len("mlp."):]: v for k, v in loaded.items()})
        for j, ((s1, s2), (t1, t2)) in enumerate(zip(expert_pairs(stock), expert_pairs(turbo), strict=True)):
            assert torch.equal(s1, t1) and torch.equal(s2, t2), f"checkpoint {i}: expert {j}"
        assert torch.equal(turbo.router.weight, stock.router.weight)


def main():
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    with model_parallel("nccl", ep=2):
        for name, (overrides, turbomoe_kwargs) in CASES.items():
            stock, turbo = check_case(name, overrides, turbomoe_kwargs, rank)
            print(f"rank {rank}: {name} equal to stock", flush=True)
        check_checkpoints(stock, turbo)
        print(f"rank {rank}: checkpoints load both ways", flush=True)
        dist.barrier()
    print(f"EP PASS {rank}", flush=True)


if __name__ == "__main__":
    main()
