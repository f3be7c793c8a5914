"""Pretrain a Qwen3-MoE-layout language model with turbomoe's MoE layers through DeepSpeed.

    deepspeed --num_gpus 2 recipes/pretrain.py --config recipes/configs/tiny-cpu.yaml
    deepspeed --num_gpus 2 recipes/pretrain.py --config recipes/configs/tiny-cpu.yaml --resume
    deepspeed recipes/pretrain.py --config my.yaml --set train.steps=200 --set moe.ep_size=4

Every rank reads its own micro-batches (data parallel over all ranks); experts are sharded over
groups of moe.ep_size ranks. The batch of a step is a function of (seed, step), and every random
draw of a step is seeded by it, so --resume continues exactly where a checkpoint left off.
"""
import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # turbomoe from this checkout

import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
import torch  # noqa: E402
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer  # noqa: E402
from deepspeed.utils import groups  # noqa: E402

import checkpointing  # noqa: E402
from recipe_config import ConfigError, deepspeed_config, load_config, validate  # noqa: E402
from run_log import RunLog, peak_flops  # noqa: E402
from turbomoe.data import Samples, load_stream, vocab_size_of  # noqa: E402
from turbomoe.models import MoEArgs, Qwen3MoeForCausalLM, moe_class  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="recipe YAML, e.g. recipes/configs/tiny-cpu.yaml")
    p.add_argument("--resume", nargs="?", const="", default=None, metavar="PATH",
                   help="continue from a checkpoint directory (its 'latest') or one global_stepN directory; "
                        "without PATH, the config's checkpoint.dir")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config key (value parsed as YAML); repeatable")
    p.add_argument("--stop-at-step", type=int, default=None, metavar="N",
                   help="stop after step N with a checkpoint; the schedule still runs to train.steps")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    return p.parse_args(argv)


def prepare(args):
    """Every check of the user's input, and the data: before any process group, model or step."""
    cfg = load_config(args.config, args.set)
    validate(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    if args.stop_at_step is not None and not 1 <= args.stop_at_step <= cfg.train.steps:
        raise ConfigError(f"--stop-at-step must be in [1, train.steps = {cfg.train.steps}], got {args.stop_at_step}")
    try:
        moe_class(cfg.model.moe_impl)
    except ImportError as e:
        raise ConfigError(str(e)) from e
    resume = None
    if args.resume is None and os.path.isfile(os.path.join(cfg.checkpoint.dir, "latest")):
        raise ConfigError(f"{cfg.checkpoint.dir} already holds a checkpoint; continue it with --resume, or start "
                          f"afresh elsewhere (--set log.dir=... or checkpoint.dir=...) or after removing it")
    if args.resume is not None:
        try:
            resume = checkpointing.resolve(args.resume or cfg.checkpoint.dir)
        except FileNotFoundError as e:
            raise ConfigError(str(e)) from e
        check_resumable(cfg, checkpointing.read_meta(*resume), os.path.join(*resume))
    vocab = vocab_size_of(cfg.data.source)
    if vocab is not None and vocab > cfg.model.vocab_size:
        raise ConfigError(f"the tokenizer of data.source {cfg.data.source!r} has {vocab} tokens, more than "
                          f"model.vocab_size {cfg.model.vocab_size}")
    try:
        stream = load_stream(cfg.data.source, cfg.data.paths, cfg.data.text_key, cfg.data.max_tokens)
        samples = Samples(stream, cfg.data.seq_len, cfg.data.valid_fraction, cfg.train.seed)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(str(e)) from e
    return cfg, resume, samples


def check_resumable(cfg, meta: dict, path: str):
    """A checkpoint continues only with the model and parallel layout that wrote it."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # moe_impl may change: both layers have the same parameters.
    diff = {k: (v, getattr(cfg.model, k)) for k, v in meta["config"]["model"].items()
            if k != "moe_impl" and getattr(cfg.model, k) != v}
    if diff:
        raise ConfigError(f"--resume {path}: the checkpoint's model differs (key: (checkpoint, config)): {diff}")
    if (meta["world_size"], meta["config"]["moe"]["ep_size"]) != (world, cfg.moe.ep_size):
        raise ConfigError(f"--resume {path}: written by {meta['world_size']} ranks with ep_size "
                          f"{meta['config']['moe']['ep_size']}; this run has {world} ranks and ep_size {cfg.moe.ep_size}")


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warmup to 1 over warmup_steps, then a cosine down to min_ratio at total_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_engine(cfg, rank: int, ds_config: dict, resuming: bool = False):
    torch.manual_seed(cfg.train.seed)
    moe = cfg.moe
    model = Qwen3MoeForCausalLM(cfg.model, MoEArgs(moe.ep_size, moe.capacity_factor, moe.eval_capacity_factor,
                                                   moe.min_capacity))
    # DeepSpeed's expert-parallel groups are runs of ep_size consecutive ranks.
    ep_rank = rank % moe.ep_size
    model.init_weights(cfg.train.seed, ep_rank)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]  # norms
    param_groups = split_params_into_different_moe_groups_for_optimizer([
        {"params": decay, "weight_decay": cfg.train.weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}])
    optimizer = torch.optim.AdamW(param_groups, lr=cfg.train.lr, betas=tuple(cfg.train.betas), eps=cfg.train.eps)
    t = cfg.train
    schedule = lambda opt: torch.optim.lr_scheduler.LambdaLR(  # noqa: E731 (built on DeepSpeed's wrapped optimizer)
        opt, lambda step: lr_factor(step, t.warmup_steps, t.steps, t.min_lr_ratio))
    # model.init_from: this rank's weights and experts, in place, before DeepSpeed copies them (its fp32
    # masters); a resumed run's weights come from its checkpoint instead.
    if cfg.init_from is not None and not resuming:
        model.load_hf_weights(cfg.init_from, ep_rank)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule, config=ds_config)
    actual = groups._get_expert_parallel_rank(f"ep_size_{moe.ep_size}")
    if actual != ep_rank:
        raise RuntimeError(f"rank {rank}: DeepSpeed placed this rank at expert-parallel rank {actual}, "
                           f"but its experts were initialised for {ep_rank}")
    return engine, model


def check_token_ids(batch, vocab_size: int):
    """Pre-tokenized data may come from a tokenizer larger than the model's vocabulary."""
    if int(batch.max()) >= vocab_size:
        raise ValueError(f"token id {int(batch.max())} in the data is >= model.vocab_size {vocab_size}; "
                         f"set model.vocab_size to the tokenizer's")


def evaluate(engine, batches, device) -> float:
    """Mean next-token loss over this rank's validation batches, averaged over ranks."""
    engine.eval()
    total = torch.zeros((), device=device)
    with torch.no_grad():
        for b in batches:
            total += engine(b[:, :-1], b[:, 1:]).loss.float()
    engine.train()
    total /= len(batches)
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def train(cfg, args, resume, samples):
    on_gpu = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if on_gpu:
        torch.cuda.set_device(local_rank)
    elif "OMP_NUM_THREADS" not in os.environ:
        # The launcher starts one process per rank; share the cores instead of oversubscribing them.
        local_ranks = int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 1)  # deepspeed, torchrun
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    t = cfg.train
    bf16 = t.precision == "bf16" or (t.precision == "auto" and on_gpu)
    ds_config = deepspeed_config(cfg, world, bf16)
    if rank == 0:  # the DeepSpeed config this run used, beside its log
        os.makedirs(cfg.log.dir, exist_ok=True)
        with open(os.path.join(cfg.log.dir, "ds_config.json"), "w") as f:
            json.dump(ds_config, f, indent=2)
    engine, model = build_engine(cfg, rank, ds_config, resuming=resume is not None)

    start_step = 0
    if resume is not None:
        load_path, client_state = engine.load_checkpoint(resume[0], tag=resume[1])
        if load_path is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint {resume}")
        start_step = client_state["step"]
    last_step = args.stop_at_step or t.steps
    log = RunLog(cfg, start_step, rank == 0, None if resume is None else os.path.join(*resume))
    log.message(f"{cfg.name}: {cfg.model.num_parameters() / 1e6:.1f}M parameters "
                f"({cfg.model.num_parameters(active=True) / 1e6:.1f}M active), moe_impl={model.moe_impl}, "
                f"{world} ranks, ep_size={cfg.moe.ep_size}, zero={t.zero_stage}, {'bf16' if bf16 else 'fp32'}")

    valid = [torch.from_numpy(b).to(device) for b in
             samples.valid_batches(rank, world, t.micro_batch_size, cfg.eval.batches)]
    tokens_per_step = t.micro_batch_size * t.grad_accum * world * cfg.data.seq_len
    flops_per_token = cfg.model.flops_per_token(cfg.data.seq_len)
    peak = peak_flops(t.peak_tflops)
    check_vocab = vocab_size_of(cfg.data.source) is None
    if check_vocab:
        for b in valid:
            check_token_ids(b, cfg.model.vocab_size)
    t_start = time.perf_counter()
    valid_losses, step_times, train_loss = [], [], None
    if start_step == 0:
        valid_losses.append(evaluate(engine, valid, device))
        log.write({"type": "valid", "step": 0, "valid_loss": valid_losses[-1]})

    for step in range(start_step, last_step):
        torch.manual_seed(t.seed * 1_000_003 + step)  # any random draw of this step (e.g. RTS) is a function of it
        t0 = time.perf_counter()
        lr = engine.get_lr()[0]
        sums = torch.zeros(2, device=device)  # loss, aux loss
        counts = torch.zeros(len(cfg.model.moe_layers()), cfg.model.num_experts, device=device)
        for micro_step in range(t.grad_accum):
            batch = torch.from_numpy(samples.train_batch(step, micro_step, t.grad_accum, rank, world,
                                                         t.micro_batch_size)).to(device)
            if check_vocab:
                check_token_ids(batch, cfg.model.vocab_size)
            out = engine(batch[:, :-1], batch[:, 1:])
            engine.backward(out.loss + cfg.moe.aux_loss_coef * out.aux_loss)
            engine.step()
            sums += torch.stack([out.loss.detach().float(), out.aux_loss.detach().float()])
            counts += out.expert_counts.float()
        stats = torch.cat([sums / t.grad_accum, counts.flatten()])
        dist.all_reduce(stats)
        loss, aux = (stats[:2] / world).tolist()
        counts = stats[2:].view_as(counts)  # routes per expert over all ranks
        load_per_layer = (counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-9)).tolist()
        dt = time.perf_counter() - t0
        done = step + 1
        record = {"type": "train", "step": done, "loss": loss, "aux_loss": aux, "lr": lr,
                  "grad_norm": float(engine.get_global_grad_norm() or 0.0), "expert_load": max(load_per_layer),
                  "expert_load_per_layer": load_per_layer, "tokens": done * tokens_per_step,
                  "step_time_s": dt, "tokens_per_s": tokens_per_step / dt,
                  "mfu": tokens_per_step / dt * flops_per_token / (world * peak) if peak else None}
        log.train_step(record)
        step_times.append(dt)
        train_loss = loss
        if done % cfg.eval.every == 0 or done == t.steps:
            valid_losses.append(evaluate(engine, valid, device))
            log.write({"type": "valid", "step": done, "valid_loss": valid_losses[-1]})
            log.message(f"step {done}: valid loss {valid_losses[-1]:.4f}")
        if (cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or done == last_step:
            checkpointing.save(engine, cfg.checkpoint.dir, done, cfg.checkpoint.keep,
                               {"world_size": world, "config": cfg.to_dict()})
            log.write({"type": "checkpoint", "step": done,
                       "path": os.path.join(cfg.checkpoint.dir, checkpointing.tag_of(done))})
    # Throughput over the steps after the first few (start-up: allocator, kernel autotuning).
    steady = step_times[min(len(step_times) - 1, max(1, len(step_times) // 10)):]
    tokens_per_s = tokens_per_step * len(steady) / sum(steady) if steady else None
    summary = {"type": "summary", "step": last_step, "steps_run": len(step_times), "wall_s": time.perf_counter() - t_start,
               "train_loss": train_loss, "valid_loss_first": valid_losses[0] if valid_losses else None,
               "valid_loss_last": valid_losses[-1] if valid_losses else None, "tokens_per_s": tokens_per_s,
               "mfu": tokens_per_s * flops_per_token / (world * peak) if peak and tokens_per_s else None,
               "device": torch.cuda.get_device_name() if on_gpu else "cpu", "world_size": world}
    log.write(summary)
    log.message("summary: " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in summary.items() if k != "type"))
    log.close()


def main(argv=None):
    args = parse_args(argv)
    try:
        cfg, resume, samples = prepare(args)
    except ConfigError as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"pretrain.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    train(cfg, args, resume, samples)


if __name__ == "__main__":
    main()
