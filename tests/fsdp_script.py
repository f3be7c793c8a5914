"""MoELayer under PyTorch's own data parallelism, on 2 CPU ranks (gloo; run by tests/test_fsdp.py):

    BACKEND=reference|triton deepspeed --num_gpus 2 tests/fsdp_script.py CHECKPOINT_DIR   (CPU ranks)

Each rank its own tokens; the gradients of every parameter (the router's through the aux loss too)
against one unsharded copy of the model stepped on both ranks' tokens, the gradients averaged: FSDP2
(`fully_shard`, the layer a unit of its own) with activation recomputation, FSDP2 with bf16
(fp16 on the Triton backend) parameters (`MixedPrecisionPolicy`), and DDP. Then an optimizer step on the shards and a second
forward: the same loss on the unsharded copy stepped alike. The FSDP2 model's sharded state saved with
torch.distributed.checkpoint and loaded into one of another init: the same loss. A model made on the
meta device, sharded, materialized (to_empty) and reset_parameters'ed: weights drawn as at construction.
Prints "FSDP PASS <rank>" at the end.
"""
import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from turbomoe.nn import MoELayer  # noqa: E402

M, F, E, K = 8, 16, 5, 2
BACKEND = os.environ["BACKEND"]
CHECKPOINT = [a for a in sys.argv[1:] if not a.startswith("--local_rank")][0]  # (the launcher adds --local_rank)
LOW = torch.float16 if BACKEND == "triton" else torch.bfloat16  # (the interpreted Triton GEMM takes no bf16)


class Block(torch.nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.proj = torch.nn.Linear(M, M)
        self.moe = MoELayer(M, F, E, K, backend=BACKEND, gmm_backend=BACKEND, **kw)

    def forward(self, x):
        y, aux = self.moe(self.proj(x))
        return y.float().square().mean() + aux.float()


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = Block(capacity_factor=1.25, recompute=True)
    with torch.no_grad():
        for p in base.parameters():  # biases and experts apart from their init
            p.add_(torch.randn_like(p), alpha=0.3)
    torch.manual_seed(1 + rank)
    x = torch.randn(3, 7, M)  # [B, T, M]: the layer flattens the tokens
    xs = [torch.empty_like(x) for _ in range(2)]
    dist.all_gather(xs, x)

    def unsharded_step(dtype):
        """The reference: both ranks' losses on one copy, the gradients averaged; then SGD's step."""
        ref = copy.deepcopy(base).to(dtype)
        losses = [ref(xi.to(dtype)) for xi in xs]
        (sum(losses) / 2).backward()
        grads = {n: p.grad.float() for n, p in ref.named_parameters()}
        with torch.no_grad():
            for p in ref.parameters():
                p.sub_(p.grad, alpha=0.1)
        return grads, ref(x.to(dtype)).item()

    for name in ("fsdp2", "fsdp2-low", "ddp"):
        model = copy.deepcopy(base)
        if name == "ddp":
            model = DistributedDataParallel(model)
        else:
            mp = (MixedPrecisionPolicy(param_dtype=LOW, reduce_dtype=torch.float32)
                  if name == "fsdp2-low" else MixedPrecisionPolicy())
            fully_shard(model.moe, mp_policy=mp)
            fully_shard(model, mp_policy=mp)
        want, want_next = unsharded_step(LOW if name == "fsdp2-low" else torch.float32)
        model(x).backward()
        tol = 1e-2 if name == "fsdp2-low" else 1e-6
        named = dict(model.named_parameters())
        for n, g in want.items():
            got = full(named[("module." if name == "ddp" else "") + n].grad).float()
            assert g.abs().sum() > 0, (name, n)
            err = ((got - g).norm() / g.norm()).item()
            assert err <= tol, (name, n, err)
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(p.grad, alpha=0.1)
        got_next = model(x).item()
        assert abs(got_next - want_next) <= 10 * tol * abs(want_next), (name, got_next, want_next)
        if name == "fsdp2":
            dcp.save(model.state_dict(), checkpoint_id=CHECKPOINT)
            torch.manual_seed(2)
            loaded = Block(capacity_factor=1.25, recompute=True)
            fully_shard(loaded.moe)
            fully_shard(loaded)
            assert loaded(x).item() != got_next
            state = loaded.state_dict()
            dcp.load(state, checkpoint_id=CHECKPOINT)
            loaded.load_state_dict(state)
            assert loaded(x).item() == got_next, name
        print(f"{name} rank {rank}: gradients and the next loss agree", flush=True)
    # The large-model way: made on the meta device, sharded, materialized, then initialized shard by shard.
    with torch.device("meta"):
        meta = Block(capacity_factor=1.25)
    fully_shard(meta.moe)
    fully_shard(meta)
    meta.to_empty(device="cpu")
    meta.proj.reset_parameters()
    meta.moe.reset_parameters()
    moe = meta.moe
    for w, bound in ((moe.experts.w1, M ** -0.5), (moe.experts.w2, F ** -0.5)):  # uniform in +-1/sqrt(fan_in)
        w = w.full_tensor()
        assert w.abs().max() <= bound and w.std() > bound / 4, (w.abs().max(), w.std())
    router_std = moe.router.weight.full_tensor().std()
    assert M ** -0.5 / 2 < router_std < 2 * M ** -0.5, router_std  # normal, std 1/sqrt(M)
    meta(x).backward()
    assert all(p.grad.full_tensor().isfinite().all() for p in meta.parameters())
    print(f"meta init rank {rank}: initialized and trained", flush=True)
    print(f"FSDP PASS {rank}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
