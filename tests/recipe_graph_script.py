"""The recipe's step with train.cuda_graph against the eager step (tests/test_cuda_graph.py runs it):
two engines built by recipes/pretrain.py from the same seed (bf16, BF16_Optimizer, gradient
accumulation GRAD_ACCUM), the same batches; rank 0 prints its per-step losses, the gradient norms, its
largest parameter difference, and the recipe's gradient norm over flat buffers against DeepSpeed's
per-parameter one, as JSON on the last line.

    python tests/recipe_graph_script.py DIR [GRAD_ACCUM]   one process on one GPU, dropless (GRAD_ACCUM
                                                           default 2: the backward graph adds into the
                                                           fp32 gradients; 1: it writes them)
    deepspeed --num_gpus 2 tests/recipe_graph_script.py DIR GRAD_ACCUM 2
                                                           a rank a GPU, expert parallelism (ep_size 2) at
                                                           capacity factor 1.25: the all-to-all captured"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "recipes"))
for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
    os.environ.setdefault(key, value)

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer  # noqa: E402

import pretrain  # noqa: E402

STEPS = 4


def run(cfg, samples, graph: bool):
    cfg.train.cuda_graph = graph
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    engine, model = pretrain.build_engine(cfg, rank, pretrain.deepspeed_config(cfg, world, True))
    t, device = cfg.train, torch.device("cuda", torch.cuda.current_device())
    losses, norms = [], []
    for step in range(STEPS):
        batches = [pretrain.to_device(samples.train_batch(step, m, t.grad_accum, rank, world, t.micro_batch_size), device)
                   for m in range(t.grad_accum)]
        if step == 0:
            pretrain.capture_step(cfg, engine, model, batches[0])
        stats = pretrain.train_step(engine, batches, cfg.moe.aux_loss_coef)
        losses.append(stats[0].item() / t.grad_accum)
        norms.append(float(engine.get_global_grad_norm()))
    params = [p.detach().float().clone() for p in model.parameters()]
    sync_free = None
    if graph:  # the recipe's step as it runs on a GPU: no host sync from forward to optimizer step
        batches = [pretrain.to_device(samples.train_batch(STEPS, m, t.grad_accum, rank, world, t.micro_batch_size), device)
                   for m in range(t.grad_accum)]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            pretrain.train_step(engine, batches, cfg.moe.aux_loss_coef)
            engine.get_global_grad_norm()
            sync_free = True
        except RuntimeError as e:
            sync_free = str(e)[:300]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # The recipe's norm over the optimizer's flat gradient buffers against DeepSpeed's own, per parameter,
    # on the gradients of one more backward.
    b = pretrain.to_device(samples.train_batch(STEPS, 0, 1, rank, world, t.micro_batch_size), device)
    engine.backward(engine(b[:, :-1], b[:, 1:]).loss)
    opt = engine.optimizer
    flat, own = opt.get_grads_for_norm(), BF16_Optimizer.get_grads_for_norm(opt)
    total = lambda pair: sum(float(g.float().norm()) ** 2 for g in pair[0] + sum(pair[1].values(), [])) ** 0.5  # noqa: E731
    norm_check = [total(flat), total(own), sorted(flat[1]) == sorted(own[1]) and len(own[1]) > 0]
    return losses, norms, params, type(engine.optimizer).__name__, norm_check, sync_free


def main():
    grad_accum = sys.argv[2] if len(sys.argv) > 2 else "2"
    ep = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    moe = ["moe.ep_size=1"] if ep == 1 else [f"moe.ep_size={ep}", "moe.capacity_factor=1.25"]
    sets = moe + ["train.precision=bf16", f"train.grad_accum={grad_accum}", "log.wandb=false", "checkpoint.every=0",
                  f"log.dir={sys.argv[1]}"]
    args = pretrain.parse_args(["--config", os.path.join(ROOT, "recipes", "configs", "tiny-cpu.yaml")]
                               + [a for kv in sets for a in ("--set", kv)])
    cfg, _, samples = pretrain.prepare(args)
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(dist_backend="nccl")
    eager = run(cfg, samples, False)
    graphed = run(cfg, samples, True)
    if int(os.environ["RANK"]) != 0:
        return
    print(json.dumps({"optimizer": [eager[3], graphed[3]], "eager_loss": eager[0], "graph_loss": graphed[0],
                      "eager_norm": eager[1], "graph_norm": graphed[1], "flat_vs_own_norm": [eager[4], graphed[4]],
                      "graph_step_sync_free": graphed[5],
                      "max_param_diff": max((a - b).abs().max().item() for a, b in zip(eager[2], graphed[2]))}))


if __name__ == "__main__":
    main()
