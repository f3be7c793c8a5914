"""The recipe's optimizer step without a host sync (pretrain.step_without_host_sync; on a GPU its
one-pass AdamW, pretrain.adamw_with_copies), its in-place gradient all-reduce
(pretrain.reduce_flat_gradients) and its coalesced gradient accumulation
(pretrain.accumulate_with_coalesced_adds) against DeepSpeed's own BF16_Optimizer step, reduction and
accumulation, in one process (tests/test_recipes.py runs it): two engines built by recipes/pretrain.py
from the same seed (bf16, fused AdamW, a small clip so that clipping acts, two micro-batches a step),
the same batches; then a step whose gradient holds a NaN. Writes JSON to DIR/step_rank{RANK}.json.

    python tests/recipe_step_script.py DIR [EP_SIZE [COMM_DTYPE]]   (one process; or each rank of a launcher run)

COMM_DTYPE: the gradients' communication dtype (default the recipe's, fp32).
"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "recipes"))
for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
    os.environ.setdefault(key, value)

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer  # noqa: E402

import pretrain  # noqa: E402
from turbomoe.models.cuda_graph import coalesce_adds  # noqa: E402

STEPS = 4
MICRO = 2  # micro-batches a step: the fp32 gradients accumulate over them
ADDS = []  # (gradients, adds) of each coalesced accumulation


def counted_coalesce_adds(pairs):
    runs = coalesce_adds(pairs)
    ADDS.append((len(pairs), len(runs)))
    return runs


pretrain.coalesce_adds = counted_coalesce_adds  # what accumulate_with_coalesced_adds calls


def run(cfg, samples, device, own_step: bool, rank: int, world: int):
    engine, model = pretrain.build_engine(cfg, rank, pretrain.deepspeed_config(cfg, world, True))
    opt = engine.optimizer
    patched = all(k in vars(opt) for k in ("step", "update_hp_grads", "backward_prologue")) \
        and "buffered_allreduce_fallback" in vars(engine)
    if not own_step:
        del opt.step  # DeepSpeed's BF16_Optimizer.step (its norm still over the flat buffers)
        del engine.buffered_allreduce_fallback  # and its gradient all-reduce
        del opt.update_hp_grads, opt.backward_prologue  # and its accumulation, a parameter at a time
    t = cfg.train
    losses, norms = [], []
    for step in range(STEPS + 1):
        for micro in range(MICRO):
            batch = pretrain.to_device(samples.train_batch(step, micro, MICRO, rank, world, t.micro_batch_size), device)
            out = engine(batch[:, :-1], batch[:, 1:])
            engine.backward(out.loss + cfg.moe.aux_loss_coef * out.aux_loss)
            if micro < MICRO - 1:
                engine.step()  # DeepSpeed's engine steps the optimizer at the last micro-batch only
        if step == 0:  # the fp32 gradients summed over the micro-batches (and reduced over ranks), before the step
            accumulated = [g.clone() for g in opt.fp32_groups_gradients_flat]
        if step == STEPS:  # a NaN gradient: the update is skipped, weights and Adam's moments kept
            before = [p.clone() for p in opt.fp32_groups_flat_partition]
            moments = [s.clone() for st in opt.optimizer.state.values() for s in (st["exp_avg"], st["exp_avg_sq"])]
            opt.fp32_groups_gradients_flat[0][0] = float("nan")
        engine.step()
        if step == 0:
            first = [p.detach().clone() for p in opt.fp32_groups_flat_partition]
        losses.append(float(out.loss))
        norms.append(float(engine.get_global_grad_norm()))
    kept = (all(torch.equal(a, p) for a, p in zip(before, opt.fp32_groups_flat_partition))
            and all(torch.equal(a, s) for a, s in zip(moments, (s for st in opt.optimizer.state.values()
                                                               for s in (st["exp_avg"], st["exp_avg_sq"])))))
    cleared = all(not g.any() for g in opt.fp32_groups_gradients_flat)
    return {"optimizer": type(opt).__name__, "patched": patched,
            "one_pass": own_step and pretrain.fused_adamw_applies(opt, opt.optimizer), "losses": losses, "norms": norms,
            "params": [p.detach().float().clone() for p in before], "first": first, "nan_step_kept_weights": kept,
            "accumulated": accumulated,
            "grads_cleared": cleared}


def main():
    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher adds --local_rank
    out_dir, ep_size = argv[0], argv[1] if len(argv) > 1 else "1"
    comm = ["--set", f"deepspeed.communication_data_type={argv[2]}"] if len(argv) > 2 else []
    args = pretrain.parse_args(["--config", os.path.join(ROOT, "recipes", "configs", "tiny-cpu.yaml"),
                                "--set", f"moe.ep_size={ep_size}", "--set", "train.precision=bf16", "--set", "train.fused_adamw=true",
                                "--set", "train.grad_clip=0.05",
                                "--set", f"train.grad_accum={MICRO}", "--set", "log.wandb=false", "--set", "checkpoint.every=0",
                                "--set", f"log.dir={out_dir}", *comm])
    cfg, _, samples = pretrain.prepare(args)
    cuda = get_accelerator().device_name() == "cuda"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cuda:
        torch.cuda.set_device(rank)
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    ds, own = run(cfg, samples, device, False, rank, world), run(cfg, samples, device, True, rank, world)
    with open(os.path.join(out_dir, f"step_rank{rank}.json"), "w") as f:
        json.dump({"optimizer": [ds["optimizer"], own["optimizer"]], "patched": own["patched"], "one_pass": own["one_pass"],
                   "losses": [ds["losses"], own["losses"]], "norms": [ds["norms"], own["norms"]],
                   "max_param_diff": max((a - b).abs().max().item() for a, b in zip(ds["params"], own["params"])),
                   "max_param": max(a.abs().max().item() for a in ds["params"]),
                   "accumulated_equal": all(torch.equal(a, b) for a, b in zip(ds["accumulated"], own["accumulated"])),
                   "adds": ADDS[-1] if ADDS else None,
                   "accumulated_nonzero": all(bool(a.any()) for a in ds["accumulated"]),
                   "first_step_param_diff": max((a - b).abs().max().item() for a, b in zip(ds["first"], own["first"])),
                   "nan_step_kept_weights": [ds["nan_step_kept_weights"], own["nan_step_kept_weights"]],
                   "grads_cleared": [ds["grads_cleared"], own["grads_cleared"]]}, f)


if __name__ == "__main__":
    main()
