"""turbomoe's Megatron-core MoE layer over two expert-parallel gloo ranks that route different token
counts (run by tests/test_megatron_paths_review.py):

    deepspeed --num_gpus 2 tests/megatron_ep_review_script.py     (CPU ranks: launcher_env(cpu=True))

- capacity, 21 tokens on rank 0 and 6 on rank 1 (capacities 6 and 2): a ValueError naming the counts on
  both ranks (before: the equal-split all-to-all mismatched, gloo aborted a rank), and the group still works;
- dropless, 21 and 6 tokens, rank 1's first token NaN (its router row routes nowhere): output, input
  gradient and every local expert's weight gradients equal a by-hand reference over all experts' weights
  (before: "Split sizes doesn't match total dim 0 size" inside all_to_all_single).
Prints "DS REVIEW PASS <rank>" at the end.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.transformer.spec_utils import build_module  # noqa: E402

from megatron_common import expert_pairs, model_parallel  # noqa: E402
from megatron_review_script import assert_near, config, stock_on_cpu  # noqa: E402
from turbomoe.integrations import megatron as tm  # noqa: E402

E, SHAPES = 8, ((7, 3), (2, 3))  # rank r's tokens [s, b]


def build(cfg):
    torch.manual_seed(0)  # the router weight is replicated
    return build_module(tm.get_turbomoe_moe_spec(cfg), config=cfg)


def all_experts(layer):
    """(w1 [E, 2F, H], w2 [E, H, F]) of every rank's experts, leaves for the reference's gradients."""
    out = []
    for i in range(2):
        local = torch.stack([pair[i] for pair in expert_pairs(layer)]).contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local)
        out.append(torch.cat(parts).requires_grad_())
    return out


def reference(layer, x, w1_EFH, w2_EHF):
    """Each kept route's SwiGLU expert by hand, weighted by its prob."""
    r = layer.router.route(x)
    x_TH = x.reshape(-1, x.shape[-1])
    rows = []
    for t in range(x_TH.shape[0]):
        out_H = torch.zeros_like(x_TH[t])
        for j in range(r.expert_ids.shape[1]):
            if r.slots.slots[t, j] >= 0:
                e = int(r.expert_ids[t, j])
                gate, up = (w1_EFH[e] @ x_TH[t]).chunk(2)
                out_H = out_H + r.probs[t, j] * (w2_EHF[e] @ (F.silu(gate) * up))
        rows.append(out_H)
    return torch.stack(rows).view_as(x)


def tokens(rank, hidden):
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(*SHAPES[rank], hidden, dtype=torch.float64, generator=g)


def capacity_with_unequal_counts(rank):
    cfg = config(num_moe_experts=E, expert_model_parallel_size=2, moe_expert_capacity_factor=1.0)
    layer = build(cfg)
    try:
        with stock_on_cpu():
            layer(tokens(rank, cfg.hidden_size))
    except ValueError as e:
        assert "[21, 6] tokens" in str(e) and "capacities [6, 2]" in str(e), str(e)
    else:
        raise AssertionError("unequal capacities over the expert-parallel ranks were not refused")
    dist.barrier()  # the refusal left no collective half done


def dropless_with_unequal_counts_and_a_nan_token(rank):
    cfg = config(num_moe_experts=E, expert_model_parallel_size=2)
    layer = build(cfg).eval()  # no aux loss: the reference is the routed experts alone
    x = tokens(rank, cfg.hidden_size)
    if rank == 1:
        x[0, 0] = float("nan")
    w = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(20 + rank))
    w1, w2 = all_experts(layer)
    xr = x.clone().requires_grad_()
    want = reference(layer, xr, w1, w2)
    (want * w).sum().backward()
    xt = x.clone().requires_grad_()
    with stock_on_cpu():
        got, _ = layer(xt)
        (got * w).sum().backward()
    assert_near(got.detach(), want.detach(), f"rank {rank} output")
    assert_near(xt.grad, xr.grad, f"rank {rank} input grad")
    for ref in (w1, w2):  # every rank's tokens reach the local experts
        dist.all_reduce(ref.grad)
    El = E // 2
    for e, (g1, g2) in enumerate(expert_pairs(layer, grads=True)):
        assert_near(g1, w1.grad[rank * El + e], f"rank {rank} expert {e} fc1 grad")
        assert_near(g2, w2.grad[rank * El + e], f"rank {rank} expert {e} fc2 grad")


def main():
    rank = int(os.environ["RANK"])
    with model_parallel("gloo", ep=2):
        capacity_with_unequal_counts(rank)
        print(f"rank {rank}: unequal capacities refused", flush=True)
        dropless_with_unequal_counts_and_a_nan_token(rank)
        print(f"rank {rank}: dropless, unequal counts and a NaN token equal the reference", flush=True)
    print(f"DS REVIEW PASS {rank}", flush=True)


if __name__ == "__main__":
    main()
