"""A small expert-parallel MoE training run for the deepspeed launcher (tests/test_deepspeed_launcher.py).

    deepspeed --num_gpus 2 --module turbomoe.integrations.run_with_turbomoe tests/ds_train_script.py \
        --phase train --workdir DIR
    deepspeed --num_gpus 2 --module turbomoe.integrations.run_with_turbomoe tests/ds_train_script.py \
        --phase resume --workdir DIR

The model constructs `deepspeed.moe.layer.MoE` like unmodified user code; the launch command is
what makes it turbomoe's. Two MoE layers, ep_size = 2 (two local experts per rank): top-1 with RTS
and token drops, and top-2 dropless with SwiGLU experts. ZeRO stage 2, CPU (gloo) or GPU (NCCL).

train:  checks turbomoe against stock layers on this expert-parallel group, trains 6 steps,
        checkpoints after step 3 (tag "turbomoe"), trains 2 steps from scratch under ZeRO-1, and
        saves a stock model's checkpoint (tag "stock").
resume: loads "turbomoe" into a fresh engine, checks every parameter, trains steps 4..6; loads
        "turbomoe" into a stock model and "stock" into a turbomoe model and checks their parameters.
Each rank writes its results to DIR/result_{phase}_rank{r}.json.
"""
import argparse
import contextlib
import json
import os

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from torch import nn

from turbomoe.integrations import deepspeed as tds
from turbomoe.integrations.deepspeed_experts import fast_path_applies, stack_expert_tensors

M, F, E, EP, TOKENS, STEPS, SAVE_AFTER = 16, 32, 4, 2, 64, 6, 3


class TinyMoEModel(nn.Module):
    """x [T, M] -> y [T, M] through two residual MoE layers; returns (y, l_aux)."""

    def __init__(self):
        super().__init__()
        self.proj_in = nn.Linear(M, M)
        self.moe_top1 = MoE(M, nn.Sequential(nn.Linear(M, F), nn.GELU(), nn.Linear(F, M)), num_experts=E,
                            ep_size=EP, k=1, capacity_factor=1.0, min_capacity=0, use_rts=True)
        self.moe_top2 = MoE(M, tds.SwiGLUExpert(M, F), num_experts=E, ep_size=EP, k=2, drop_tokens=False)
        self.proj_out = nn.Linear(M, M)

    def forward(self, x):
        h = self.proj_in(x)
        y1, aux1, _ = self.moe_top1(h)
        h = h + y1
        y2, aux2, _ = self.moe_top2(h)
        return self.proj_out(h + y2), aux1 + aux2


def expert_weights_are_views(layer) -> bool:
    """Whether the grouped-GEMM path sees the SwiGLU experts' [w1; w3] as one view (no copy) of the
    engine's parameter storage (ZeRO's flat buffers)."""
    local = layer.deepspeed_moe.experts.deepspeed_experts
    stacked = stack_expert_tensors([[e.w1.weight, e.w3.weight] for e in local])
    return stacked.untyped_storage().data_ptr() == local[0].w1.weight.untyped_storage().data_ptr()


def build_engine(model_seed: int = 0, zero_stage: int = 2):
    torch.manual_seed(model_seed)
    model = TinyMoEModel()
    params_group = {"params": list(model.parameters()), "name": "params"}
    groups = split_params_into_different_moe_groups_for_optimizer(params_group)
    optimizer = torch.optim.AdamW(groups, lr=1e-2)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def batch(step: int, rank: int, device):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(TOKENS, M, generator=g)
    return x.to(device), torch.sin(3 * x).to(device)


def train_steps(engine, steps, rank):
    losses = []
    for step in steps:
        x, target = batch(step, rank, engine.device)
        torch.manual_seed(step)  # the gate's random draws (RTS seed) depend on the step only
        y, l_aux = engine(x)
        loss = torch.nn.functional.mse_loss(y, target) + 0.01 * l_aux
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def params(engine):
    return {n: p.detach().float().cpu().clone() for n, p in engine.module.named_parameters()}


def max_param_diff(engine, expected):
    got = params(engine)
    assert got.keys() == expected.keys(), sorted(set(got) ^ set(expected))
    return max((got[n] - expected[n]).abs().max().item() for n in got)


@contextlib.contextmanager
def stock_layers():
    """Lift the patch (if any) so that MoE(...) builds stock DeepSpeed's layer."""
    patched = tds.is_patched()
    tds.unpatch()
    try:
        yield
    finally:
        if patched:
            tds.patch()


def ep_fidelity(device):
    """Max differences of turbomoe vs stock layers (same weights, same seeds) over the ep group."""
    errors = {}
    for name, kw in {"top2_capacity": dict(k=2, capacity_factor=float(E)),
                     "top2_dropless": dict(k=2, drop_tokens=False),
                     "top1_dropless": dict(k=1, drop_tokens=False)}.items():
        torch.manual_seed(3)
        with stock_layers():
            stock = MoE(M, nn.Sequential(nn.Linear(M, F), nn.GELU(), nn.Linear(F, M)), num_experts=E, ep_size=EP,
                        min_capacity=0, **kw)
        turbo = tds.MoE(M, nn.Sequential(nn.Linear(M, F), nn.GELU(), nn.Linear(F, M)), num_experts=E, ep_size=EP,
                        min_capacity=0, **kw)
        turbo.load_state_dict(stock.state_dict())
        results = []
        for layer in (stock.to(device), turbo.to(device)):
            layer.set_deepspeed_parallelism()
            x = torch.randn(TOKENS, M, generator=torch.Generator().manual_seed(7 + deepspeed.comm.get_rank()))
            x = x.to(device).requires_grad_()
            torch.manual_seed(11)
            out, l_aux, counts = layer(x)
            (out.square().sum() + l_aux).backward()
            results.append([out, l_aux, counts.float(), x.grad] + [p.grad for p in layer.parameters()])
        errors[name] = max((a - b).abs().max().item() for a, b in zip(*results))
    return errors


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=["train", "resume"], required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo" if get_accelerator().device_name() == "cpu" else None)
    rank = deepspeed.comm.get_rank()
    ckpt = os.path.join(args.workdir, "ckpt")
    result = {"patched": tds.is_patched()}

    engine = build_engine()
    result["layer_types"] = sorted({type(m).__module__ for m in engine.module.modules() if isinstance(m, MoE)})
    if args.phase == "train":
        result["ep_fidelity"] = ep_fidelity(engine.device)
        result["losses"] = train_steps(engine, range(SAVE_AFTER), rank)
        engine.save_checkpoint(ckpt, tag="turbomoe")
        torch.save(params(engine), os.path.join(args.workdir, f"params_turbomoe_rank{rank}.pt"))
        result["losses"] += train_steps(engine, range(SAVE_AFTER, STEPS), rank)
        result["zero1_losses"] = train_steps(build_engine(zero_stage=1), range(2), rank)
        with stock_layers():
            stock = build_engine()
        stock.save_checkpoint(ckpt, tag="stock")
        torch.save(params(stock), os.path.join(args.workdir, f"params_stock_rank{rank}.pt"))
    else:
        saved = {tag: torch.load(os.path.join(args.workdir, f"params_{tag}_rank{rank}.pt"))
                 for tag in ("turbomoe", "stock")}
        engine.load_checkpoint(ckpt, tag="turbomoe")
        result["resumed_param_diff"] = max_param_diff(engine, saved["turbomoe"])
        result["losses"] = train_steps(engine, range(SAVE_AFTER, STEPS), rank)
        with stock_layers():
            stock = build_engine()
        stock.load_checkpoint(ckpt, tag="turbomoe")
        result["turbomoe_into_stock_diff"] = max_param_diff(stock, saved["turbomoe"])
        other = build_engine(model_seed=1)  # different initial weights, so the load must overwrite them
        other.load_checkpoint(ckpt, tag="stock")
        result["stock_into_turbomoe_diff"] = max_param_diff(other, saved["stock"])
    # After training: ZeRO has packed the parameters into its buffers, the engine has run forwards.
    result["expert_weights_are_views"] = expert_weights_are_views(engine.module.moe_top2)
    inner = engine.module.moe_top2.deepspeed_moe
    weight = next(inner.experts.parameters())
    result["grouped_experts"] = fast_path_applies(inner.experts, inner.expert_fast_path,
                                                  torch.empty(0, device=weight.device, dtype=weight.dtype))
    with open(os.path.join(args.workdir, f"result_{args.phase}_rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
