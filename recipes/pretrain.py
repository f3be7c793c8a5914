"""Pretrain a Qwen3-MoE-layout language model with turbomoe's MoE layers through DeepSpeed.

    deepspeed --num_gpus 2 recipes/pretrain.py --config recipes/configs/tiny-cpu.yaml
    deepspeed --num_gpus 2 recipes/pretrain.py --config recipes/configs/tiny-cpu.yaml --resume
    deepspeed recipes/pretrain.py --config my.yaml --set train.steps=200 --set moe.ep_size=4

Every rank reads its own micro-batches (data parallel over all ranks); experts are sharded over
groups of moe.ep_size ranks. The batch of a step is a function of (seed, step), and every random
draw of a step is seeded by it, so --resume continues exactly where a checkpoint left off; on another
number of ranks or ep_size too (recipes/reshard.py), when a step keeps its samples:
    deepspeed --num_gpus 2 recipes/pretrain.py --config recipes/configs/1b-4gpu.yaml --resume RUN/checkpoints \
        --set moe.ep_size=2 --set train.grad_accum=8
"""
import argparse
import contextlib
import json
import math
import os
import socket
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # turbomoe from this checkout

import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402
import torch  # noqa: E402
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer  # noqa: E402
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer  # noqa: E402
from deepspeed.runtime.utils import all_gather_dp_groups  # noqa: E402
from deepspeed.utils import groups  # noqa: E402

import checkpointing  # noqa: E402
from reshard import load_resharded, set_schedule  # noqa: E402
from recipe_config import STEP_SEED_STRIDE, ConfigError, deepspeed_config, load_config, validate  # noqa: E402
from run_log import LOG_FILE, RunLog, peak_flops  # noqa: E402
from turbomoe.export import ExportError, RunCheckpoint  # noqa: E402
from turbomoe.data import Samples, corpus_tokenizer, load_stream, vocab_size_of  # noqa: E402
from turbomoe.data.cache import default_dir  # noqa: E402
from turbomoe.data.tokenizer import tokenizer_digest  # noqa: E402
from turbomoe.kernels.adamw import adamw_step  # noqa: E402
from turbomoe.models import MoEArgs, Qwen3MoeForCausalLM  # noqa: E402
from turbomoe.models.compile import compile_dense_blocks, compile_moe_blocks  # noqa: E402
from turbomoe.models.cuda_graph import coalesce_adds, graph_training_forward  # noqa: E402


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
    resume = meta = None
    if args.resume is None:
        # Tags without `latest` count too: a first save killed between its marker and `latest` leaves them,
        # and this run's saves would replace and prune them.
        ckpt, go_on = cfg.checkpoint.dir, "continue that run with --resume, or "
        if os.path.isfile(os.path.join(ckpt, "latest")) or (os.path.isdir(ckpt) and checkpointing.complete_tags(ckpt)):
            held = ckpt, f"a checkpoint; {go_on}"
        elif checkpointing.holds_tags(ckpt):
            held = ckpt, "only unfinished checkpoint tags (saves that did not finish); "
        elif os.path.isfile(os.path.join(cfg.log.dir, LOG_FILE)):
            held = cfg.log.dir, f"another run's log; {go_on}"
        else:
            held = None
        if held:
            raise ConfigError(f"{held[0]} already holds {held[1]}start afresh elsewhere (--set log.dir=... or "
                              f"checkpoint.dir=...) or after removing it")
    if args.resume is not None:
        try:
            resume = checkpointing.resolve(args.resume or cfg.checkpoint.dir)
        except FileNotFoundError as e:
            raise ConfigError(str(e)) from e
        # The run saves into checkpoint.dir (and prunes there): never over another run's checkpoints.
        if checkpointing.holds_tags(cfg.checkpoint.dir) and not os.path.samefile(resume[0], cfg.checkpoint.dir):
            raise ConfigError(f"--resume {os.path.join(*resume)} would continue into checkpoint.dir "
                              f"{cfg.checkpoint.dir}, which holds another run's checkpoints; set checkpoint.dir to "
                              f"the resumed one or to an empty directory")
        try:
            meta = checkpointing.read_meta(*resume)
        except ValueError as e:
            raise ConfigError(f"--resume: {e}") from None
        last = args.stop_at_step or cfg.train.steps
        if last <= meta["step"]:
            raise ConfigError(f"--resume {os.path.join(*resume)} is at step {meta['step']}: nothing to run up to "
                              f"step {last} (--stop-at-step or train.steps)")
        check_log_continues(cfg.log.dir, os.path.join(*resume), meta)
    tokenizer = None
    if cfg.data.source != "megatron":  # resolved before the resume's checks: a run records the one it read with
        spec = cfg.data.tokenizer
        if spec is None and meta is not None and "tokenizer" not in meta["config"]["data"]:
            spec = "bytes"  # a run from before data.tokenizer read bytes, whatever model.init_from holds
        try:
            cfg.data.tokenizer, tokenizer = corpus_tokenizer(spec, cfg.init_from)
        except (OSError, ValueError, ImportError) as e:
            raise ConfigError(f"data.tokenizer: {e}") from e
    if meta is not None:
        check_resumable(cfg, meta, os.path.join(*resume))
    vocab = vocab_size_of(cfg.data.source, tokenizer)
    if vocab is not None and vocab > cfg.model.vocab_size:
        raise ConfigError(f"the tokenizer of data.source {cfg.data.source!r} (data.tokenizer {cfg.data.tokenizer}) "
                          f"has {vocab} tokens, more than model.vocab_size {cfg.model.vocab_size}")
    try:
        cache_dir = (cfg.data.cache_dir or default_dir()) if cfg.data.cache else None
        stream = load_stream(cfg.data.source, cfg.data.paths, cfg.data.text_key, cfg.data.max_tokens, tokenizer,
                             cache_dir)
        samples = Samples(stream, cfg.data.seq_len, cfg.data.valid_fraction, cfg.train.seed)
        # Every rank needs a validation batch (checked here, not after the process group is up).
        samples.valid_batches(0, int(os.environ.get("WORLD_SIZE", "1")), cfg.train.micro_batch_size, 1)
    except (FileNotFoundError, ValueError, ImportError) as e:  # ImportError: a source's reader missing
        raise ConfigError(str(e)) from e
    if resume is not None:
        check_same_corpus(cfg, meta, stream, os.path.join(*resume))
    return cfg, resume, samples


def check_same_corpus(cfg, meta: dict, stream, path: str):
    """The data config does not pin the tokens: a file there may have changed since the checkpoint, and
    the split and order (drawn over the token count) with it. A marker from before the recipe wrote the
    digest is not checked."""
    saved = meta.get("corpus")
    if saved is None:
        return
    now = stream.digest
    if now != saved:
        d = cfg.data
        raise ConfigError(f"--resume {path}: the corpus (data.source {d.source!r}, data.paths {d.paths}) changed "
                          f"since the checkpoint ({saved['tokens']} tokens then, {now['tokens']} now, or other "
                          f"tokens): its split and order would too. Restore those files, or start a new run from "
                          f"the checkpoint's weights (python -m turbomoe.export, then model.init_from)")


# What a resume needs unchanged beside the model: the data stream (its split and order are drawn from
# train.seed; a step reads samples [step * n, (step + 1) * n) for n = micro_batch_size x grad_accum x
# ranks, checked below), what DeepSpeed's optimizer files are (the precision trained in; ZeRO stage 0
# against 1 or 2: both checked below), and what they restore on the same layout but reshard.py does not:
# the optimizer's settings (its parameter groups), the base learning rate and the clipping (its clip_grad:
# a changed grad_clip was ignored on the same layout, honoured on another). train.steps may grow (a run
# continued further).
RESUME_FIXED = {"data": None, "train": ("seed", "lr", "betas", "eps", "weight_decay", "grad_clip", "fused_adamw")}
# Of those, where the tokens are kept does not change them; the tokenizer is compared as resolved (below).
RESUME_FREE = {("data", "tokenizer"), ("data", "cache"), ("data", "cache_dir")}


def precision_of(precision: str, on_gpu: bool) -> str:
    """The dtype a run trains in: train.precision with auto resolved (bf16 on a GPU, fp32 on the CPU)."""
    return ("bf16" if on_gpu else "fp32") if precision == "auto" else precision


def same_layout(meta: dict, world: int, ep_size: int) -> bool:
    """Whether the checkpoint was written by as many ranks with the same ep_size (DeepSpeed's own load
    then reads it); otherwise reshard.load_resharded does."""
    return (meta["world_size"], meta["config"]["moe"]["ep_size"]) == (world, ep_size)


def check_resumable(cfg, meta: dict, path: str):
    """A checkpoint continues only with the model, data stream and optimizer files that wrote it; on
    another number of ranks or ep_size only from ZeRO 1/2 partitions (reshard.py)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # moe_impl may change: both layers have the same parameters.
    diff = {k: (v, getattr(cfg.model, k)) for k, v in meta["config"]["model"].items()
            if k != "moe_impl" and getattr(cfg.model, k) != v}
    if diff:
        raise ConfigError(f"--resume {path}: the checkpoint's model differs (key: (checkpoint, config)): {diff}")
    for section, keys in RESUME_FIXED.items():
        saved = meta["config"][section]
        diff.update({f"{section}.{k}": (v, getattr(getattr(cfg, section), k)) for k, v in saved.items()
                     if (keys is None or k in keys) and getattr(getattr(cfg, section), k) != v
                     and (section, k) not in RESUME_FREE})
    # The tokenizer as resolved (prepare's corpus_tokenizer); a run from before data.tokenizer read bytes.
    if cfg.data.source != "megatron":
        saved = meta["config"]["data"].get("tokenizer", "bytes")
        if saved is not None and saved != cfg.data.tokenizer:
            diff["data.tokenizer"] = (saved, cfg.data.tokenizer)
    # The precision trained in, not as spelled: auto is fp32 on CPU ranks and bf16 on GPUs. A marker from
    # before the recipe wrote it holds only the config's spelling.
    saved = meta.get("precision", meta["config"]["train"]["precision"])
    precision = cfg.train.precision if saved == "auto" else precision_of(cfg.train.precision, uses_gpu())
    if precision != saved:
        diff["train.precision"] = (saved, precision)
    stages = meta["config"]["train"]["zero_stage"], cfg.train.zero_stage
    if 0 in stages and stages[0] != stages[1]:
        diff["train.zero_stage"] = stages
    was = meta["config"]["train"]
    saved_n = was["micro_batch_size"] * was["grad_accum"] * meta["world_size"]
    n = cfg.train.micro_batch_size * cfg.train.grad_accum * world
    if saved_n != n:
        diff["samples a step (micro_batch_size x grad_accum x ranks)"] = (saved_n, n)
    if diff:
        raise ConfigError(f"--resume {path}: a resume needs the checkpoint's data stream and optimizer "
                          f"files; these differ (key: (checkpoint, config)): {diff}. Start a new run from its "
                          f"weights instead (python -m turbomoe.export, then model.init_from)")
    if not same_layout(meta, world, cfg.moe.ep_size) and 0 in stages:
        raise ConfigError(f"--resume {path}: written by {meta['world_size']} ranks with ep_size "
                          f"{meta['config']['moe']['ep_size']}, this run has {world} ranks and ep_size "
                          f"{cfg.moe.ep_size}: resuming on another layout needs ZeRO 1 or 2 (train.zero_stage), "
                          f"this is stage {stages[0]}")
    # Every file there and whole, before any work: a missing or cut-short one is this error on every rank
    # (DeepSpeed's load would fail inside torch's loader on one rank and in a collective on the others).
    try:
        RunCheckpoint(path).check_files()
    except ExportError as e:
        raise ConfigError(f"--resume {path}: {e}") from e


def check_log_continues(log_dir: str, path: str, meta: dict):
    """A resumed run appends to the log in log.dir: only where that log's run is the one resumed, its last
    checkpoint (or, before any, the one that run resumed from) being path, or a later one that the log's
    last launch wrote (meta: its marker) and did not log, stopped between the save and the log's line."""
    log_path = os.path.join(log_dir, LOG_FILE)
    if not os.path.isfile(log_path):
        return
    last = launch = None
    last_step = -1
    with open(log_path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a crash
                continue
            if record.get("type") == "start":
                last, launch, last_step = record["resumed_from"], record.get("launch"), record.get("step", -1)
            elif record.get("type") == "checkpoint":
                last, last_step = record["path"], record.get("step", -1)
    if launch is not None and meta.get("launch") == launch and meta["step"] > last_step:
        return
    if last is None or os.path.realpath(last) != os.path.realpath(path):
        raise ConfigError(f"--resume {path} would append to the log in log.dir {log_dir}, which belongs to the run "
                          f"whose last checkpoint is {last or 'none (it saved none)'}; resume that checkpoint, or set "
                          f"log.dir to a new directory")


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warmup to 1 over warmup_steps, then a cosine down to min_ratio at total_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def use_deterministic_algorithms():
    """train.deterministic: every kernel of the step repeats its bits given the same inputs. turbomoe's own
    kernels always do (no float atomics); this makes torch pick the same for the rest (attention's
    backward, whose default sums with atomics, and cuBLAS, given a fixed workspace), or fail loudly on an
    op it has no such kernel for."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's condition; read when its first handle is made
    torch.use_deterministic_algorithms(True)
    # Not NaN-filled: every kernel here writes what is read (rows past the counts are never read:
    # tests/test_expert_stack.py), and a fill would add a pass per tensor made.
    torch.utils.deterministic.fill_uninitialized_memory = False


def build_engine(cfg, rank: int, ds_config: dict, resuming: bool = False):
    if cfg.train.deterministic:
        use_deterministic_algorithms()
    torch.manual_seed(cfg.train.seed)
    moe = cfg.moe
    model = Qwen3MoeForCausalLM(cfg.model, MoEArgs(moe.ep_size, moe.capacity_factor, moe.eval_capacity_factor,
                                                   moe.min_capacity, moe.recompute))
    # DeepSpeed's expert-parallel groups are runs of ep_size consecutive ranks.
    ep_rank = rank % moe.ep_size
    model.init_weights(cfg.train.seed, ep_rank)
    if cfg.train.compile:
        compile_dense_blocks(model)
    if cfg.train.compile_moe:
        compile_moe_blocks(model)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]  # norms
    param_groups = split_params_into_different_moe_groups_for_optimizer([
        {"params": decay, "weight_decay": cfg.train.weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}])
    # fused: one kernel per group and step instead of a dozen element-wise passes over the fp32 state.
    optimizer = torch.optim.AdamW(param_groups, lr=cfg.train.lr, betas=tuple(cfg.train.betas), eps=cfg.train.eps,
                                  fused=cfg.train.fused_adamw or None)
    t = cfg.train
    schedule = lambda opt: torch.optim.lr_scheduler.LambdaLR(  # noqa: E731 (built on DeepSpeed's wrapped optimizer)
        opt, lambda step: lr_factor(step, t.warmup_steps, t.steps, t.min_lr_ratio))
    # model.init_from: this rank's weights and experts, in place, before DeepSpeed copies them (its fp32
    # masters); a resumed run's weights come from its checkpoint instead.
    if cfg.init_from is not None and not resuming:
        model.load_hf_weights(cfg.init_from, ep_rank)
    # No autograd graph over the parameters: DeepSpeed's optimizers flatten them with torch.cat and keep the
    # result, which would hold every parameter's AccumulateGrad node on the default stream; CUDA graph
    # capture (train.cuda_graph) cannot run those nodes on its own stream.
    with torch.no_grad():
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule, config=ds_config)
    norms_over_flat_gradients(engine)
    reduce_flat_gradients(engine)
    step_without_host_sync(engine)
    accumulate_with_coalesced_adds(engine)
    actual = groups._get_expert_parallel_rank(f"ep_size_{moe.ep_size}")
    if actual != ep_rank:
        raise RuntimeError(f"rank {rank}: DeepSpeed placed this rank at expert-parallel rank {actual}, "
                           f"but its experts were initialised for {ep_rank}")
    return engine, model


def norms_over_flat_gradients(engine):
    """BF16_Optimizer's gradient norm and clipping over its flat fp32 gradient buffers, one per
    parameter group, instead of one tensor per parameter (687 in small-1gpu: ~1,400 kernels and their
    host time a step). The same norm, the buffers' padding being zero, where each rank holds whole
    parameters: without tensor or pipeline parallelism (no mpu), as the recipe runs."""
    opt = engine.optimizer
    if not isinstance(opt, BF16_Optimizer) or opt.mpu is not None:
        return

    def grads_for_norm(for_clipping=False):
        if for_clipping:
            return list(opt.fp32_groups_gradients_flat)
        # The optimizer's own split of those buffers (the one its reduction uses), less expert groups
        # that hold no parameters here.
        non_expert, expert = opt.get_grads_for_reduction()
        return list(non_expert), {name: list(flats) for name, flats in expert.items() if flats}

    opt.get_grads_for_norm = grads_for_norm


def reduce_flat_gradients(engine):
    """The data-parallel gradient all-reduce of BF16_Optimizer in place on its flat fp32 gradient
    buffers, one per parameter group. DeepSpeed's (buffered_allreduce_fallback) copies each buffer
    into a new flat tensor, casts it to the communication dtype, reduces it and copies it back: on
    small-1gpu, 2.8 ms a step on one rank, where there is nothing to reduce. Same groups and scaling
    as DeepSpeed's allreduce_bucket (expert groups averaged over the data-parallel size); the
    all_reduce itself is left out where its group has one rank. Without mpu, pipeline or sequence
    parallelism (the recipe's runs); anything else keeps DeepSpeed's."""
    opt = engine.optimizer
    if (not isinstance(opt, BF16_Optimizer) or opt.mpu is not None or engine.pipeline_parallelism
            or engine.sequence_parallel_size != 1):
        return
    deepspeed_reduce = engine.buffered_allreduce_fallback

    def reduce(flat, group, dp_world_size: int):
        t = flat if engine.communication_data_type == flat.dtype else flat.to(engine.communication_data_type)
        alone = dist.get_world_size(group=group) == 1
        if not engine.gradient_average:
            pre, post = 1.0, 1.0
        elif engine.postscale_gradients():
            f = engine.gradient_predivide_factor()
            pre, post = 1.0 / f, (f / dp_world_size if f != dp_world_size else 1.0)
        else:
            pre, post = 1.0 / dp_world_size, 1.0
        if pre != 1.0:
            t.mul_(pre)
        if not alone:
            dist.all_reduce(t, group=group)
        if post != 1.0:
            t.mul_(post)
        if t is not flat:
            flat.copy_(t)

    @torch.no_grad()
    def buffered_allreduce_fallback(grads=None, elements_per_buffer=500000000):
        if grads is not None:
            return deepspeed_reduce(grads, elements_per_buffer)
        non_expert, expert = opt.get_grads_for_reduction()
        dp_world_size = dist.get_world_size(group=groups._get_data_parallel_group())
        for flat in non_expert:
            reduce(flat, groups._get_sequence_data_parallel_group(), dp_world_size)
        for name, flats in expert.items():
            for flat in flats:
                reduce(flat, groups._get_expert_data_parallel_group(name), dp_world_size)

    engine.buffered_allreduce_fallback = buffered_allreduce_fallback


def accumulate_with_coalesced_adds(engine):
    """BF16_Optimizer's accumulation of each micro-batch's bf16 gradients into its fp32 gradients in
    one add per run of gradients that lie at one stride (the experts' are views of one stacked
    gradient per layer and weight, their fp32 buffers follow the parameter order; the cast rides in
    the add), and the bf16 gradients set to None before each backward, so that autograd hands its
    gradient over instead of adding it into a zeroed one. DeepSpeed's zeroes every bf16 gradient,
    lets autograd add into it and then casts and adds each parameter's apart: four kernels and a
    Python call a parameter and micro-batch, which held the host of an eager step (1b-4gpu at
    ep_size 2: 915 parameters, notes/recipe_profile.md). The same fp32 sums, bit for bit. Not with
    DeepSpeed's immediate_grad_update (its hooks add each gradient as it comes) or AutoEP folding."""
    opt = engine.optimizer
    if (not isinstance(opt, BF16_Optimizer) or opt.immediate_grad_update
            or getattr(opt, "autoep_folding_tp_group", None) is not None):
        return
    params = [(lp, hp, i, j) for i, (lps, hps) in enumerate(zip(opt.bf16_groups, opt.fp32_groups_gradients))
              for j, (lp, hp) in enumerate(zip(lps, hps))]

    @torch.no_grad()
    def update_hp_grads(clear_lp_grads=False):
        pairs = []
        for lp, hp, i, j in params:
            if lp.grad is not None:
                pairs.append((hp.view(-1), lp.grad.reshape(-1)))
                lp._hp_grad = hp
                opt.fp32_groups_has_gradients[i][j] = True
        for dst, src in coalesce_adds(pairs):
            dst.add_(src)
        if clear_lp_grads:
            opt.clear_lp_grads()

    opt.update_hp_grads = update_hp_grads
    opt.backward_prologue = lambda: opt.clear_lp_grads(set_to_none=True)


def step_without_host_sync(engine):
    """BF16_Optimizer's step without a host sync, where its optimizer is torch's fused AdamW and no
    mpu is set: DeepSpeed's reads the gradient norm on the host (is the norm finite? clip?) several
    times a step, so the host cannot queue the next step while the GPU runs this one. Here the norm
    stays on the device (over the flat fp32 buffers, expert groups' squares summed over their
    expert-parallel group, as DeepSpeed's), clipping rides inside the fused AdamW kernel as its
    grad_scale (grads / max(1, (norm + 1e-6) / clip), DeepSpeed's coefficient; no pass of its own
    over the gradients), and a non-finite norm skips the update on the device through found_inf
    (DeepSpeed skips it on the host; here the step counts and the learning-rate schedule moves on,
    and the log shows the norm). On a GPU the update, the bf16 weights and the cleared fp32
    gradients are one pass over the buffers (adamw_with_copies); elsewhere torch's fused AdamW and
    then DeepSpeed's copies and clearing."""
    opt = engine.optimizer
    inner = opt.optimizer if isinstance(opt, BF16_Optimizer) else None
    if (inner is None or opt.mpu is not None or opt.grad_acc_dtype is not torch.float32
            or not isinstance(inner, torch.optim.AdamW) or not inner.defaults.get("fused")):
        return

    def squared_norm(tensors):
        return torch.stack(torch._foreach_norm(tensors)).square().sum()

    @torch.no_grad()
    def step(closure=None):
        if closure is not None:
            raise NotImplementedError("BF16_Optimizer takes no closure")
        non_expert, expert = opt.get_grads_for_norm()
        squares = [squared_norm(non_expert)] if non_expert else []
        for name, tensors in expert.items():
            sq = squared_norm(tensors)
            group = groups._get_expert_parallel_group(name)
            if dist.get_world_size(group=group) > 1:
                dist.all_reduce(sq, group=group)
            squares.append(sq)
        norm = torch.stack(squares).sum().sqrt()
        opt.overflow = False
        opt._global_grad_norm = norm
        inner.found_inf = (~torch.isfinite(norm)).float()
        inner.grad_scale = ((norm + 1e-6) / opt.clip_grad).clamp(min=1.0) if opt.clip_grad > 0 else None
        clear = not getattr(opt, "graph_writes_grads", False)  # capture_step's: the next backward overwrites them
        cleared[0] = True
        if one_pass:
            adamw_with_copies(opt, inner, clear)
            return
        for param, grad in zip(opt.fp32_groups_flat_partition, opt.fp32_groups_gradient_flat_partition):
            param.grad = grad
        inner.step()
        opt._lazy_init_hp_params_optimizer_state()
        opt.update_lp_params()
        if clear:
            opt.clear_hp_grads()

    deepspeed_zero_grad = opt.zero_grad
    cleared = [False]

    def zero_grad(set_to_none=True):
        """DeepSpeed's engine calls this right after the step, which has cleared the fp32 gradients
        (or left them for the next backward graph to overwrite): only the bf16 .grad and the flags."""
        if not cleared[0]:
            return deepspeed_zero_grad(set_to_none)
        cleared[0] = False
        opt.clear_lp_grads(set_to_none)
        mark_gradients(opt, False)

    one_pass = fused_adamw_applies(opt, inner)
    opt.step, opt.zero_grad = step, zero_grad


def mark_gradients(opt, present: bool):
    """BF16_Optimizer's has-gradient flags, all set to present: what its accumulation records (read by
    its norm and step) and its clear_hp_grads resets."""
    for i, flags in enumerate(opt.fp32_groups_has_gradients):
        opt.fp32_groups_has_gradients[i] = [present] * len(flags)


def fused_adamw_applies(opt, inner) -> bool:
    """Whether adamw_with_copies can take the step: fp32 master buffers on a GPU, one per parameter
    group, plain AdamW (no amsgrad, maximize or tensor learning rate)."""
    return (len(inner.param_groups) == len(opt.fp32_groups_flat_partition)
            and all(len(g["params"]) == 1 and g["params"][0] is p and p.is_cuda and p.dtype == torch.float32 and not g["amsgrad"]
                    and not g["maximize"] and not torch.is_tensor(g["lr"])
                    for g, p in zip(inner.param_groups, opt.fp32_groups_flat_partition)))


def adamw_with_copies(opt, inner, clear: bool = True):
    """BF16_Optimizer's update, bf16 weights and cleared fp32 gradients (unless not clear) in one
    pass per parameter group (turbomoe.kernels.adamw; torch's fused AdamW, update_lp_params and
    clear_hp_grads took three), on inner's own state (exp_avg, exp_avg_sq and step as torch keeps
    them, so checkpoints and torch's step read them). Reads inner.grad_scale and inner.found_inf as
    set by the step; the has-gradient flags are the engine's zero_grad's to reset."""
    steps = []
    for group, param in zip(inner.param_groups, opt.fp32_groups_flat_partition):
        state = inner.state[param]
        if not state:  # torch's lazy initialisation for a fused AdamW
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        steps.append(state["step"])
    torch._foreach_add_(steps, [1 - inner.found_inf] * len(steps))  # a skipped step does not count, as torch's
    for i, (group, param, grad) in enumerate(zip(inner.param_groups, opt.fp32_groups_flat_partition,
                                                 opt.fp32_groups_gradient_flat_partition)):
        state, whole = inner.state[param], opt.fp32_groups_gradients_flat[i]
        clears_all = clear and grad.data_ptr() == whole.data_ptr() and grad.numel() == whole.numel()
        beta1, beta2 = group["betas"]
        adamw_step(param, grad, state["exp_avg"], state["exp_avg_sq"], state["step"], lr=group["lr"], beta1=beta1,
                   beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"], grad_scale=inner.grad_scale,
                   found_inf=inner.found_inf,
                   param_lp=opt.bf16_partitioned_groups[i][dist.get_rank(group=opt.real_dp_process_group[i])],
                   zero_grad=clears_all)
        if clear and not clears_all:  # other ranks' partitions of the gradient, with data parallelism
            whole.zero_()
    opt._lazy_init_hp_params_optimizer_state()
    all_gather_dp_groups(groups_flat=opt.bf16_groups_flat, partitioned_param_groups=opt.bf16_partitioned_groups,
                         dp_process_group=opt.real_dp_process_group,
                         start_alignment_factor=opt.nccl_start_alignment_factor,
                         allgather_bucket_size=opt.allgather_bucket_size)


def capture_step(cfg, engine, model, batch):
    """train.cuda_graph: the model's training forward and backward captured at the micro-batch's
    shape (batch [B, T + 1] on the GPU, as train_step slices it), after the engine and any
    checkpoint put the parameters in place; later micro-batches of that shape replay them."""
    if not cfg.train.cuda_graph:
        return
    opt = engine.optimizer
    if not isinstance(opt, BF16_Optimizer):  # the one optimizer verified under capture
        raise ConfigError(f"train.cuda_graph runs with DeepSpeed's BF16_Optimizer (bf16, ZeRO 1, fp32 gradient "
                          f"accumulation), got {type(opt).__name__}")
    engine.train()
    # The backward graph adds each gradient into the optimizer's fp32 gradient itself: no bf16 .grad and
    # no per-parameter hook, which cost more host time than the replay (687 parameters in small-1gpu).
    # At one micro-batch a step it writes them instead, and the step leaves them uncleared.
    buffers = {lp: hp for lps, hps in zip(opt.bf16_groups, opt.fp32_groups_gradients) for lp, hp in zip(lps, hps)}

    accumulate = cfg.train.grad_accum > 1
    graph_training_forward(model, batch[:, :-1], batch[:, 1:], grad_buffers=buffers,
                           before_replay=lambda: mark_gradients(opt, True), accumulate=accumulate)
    opt.graph_writes_grads = not accumulate


def check_token_ids(batch_np, vocab_size: int):
    """Pre-tokenized data may come from a tokenizer larger than the model's vocabulary. Checked on
    the host batch, before its copy: on the device it would cost a sync every step."""
    if batch_np.size and int(batch_np.max()) >= vocab_size:
        raise ValueError(f"token id {int(batch_np.max())} in the data is >= model.vocab_size {vocab_size}; "
                         f"set model.vocab_size to the tokenizer's")


def to_device(batch_np, device):
    """A host batch on the device without a host sync: a pageable copy would wait for the GPU's queue."""
    batch = torch.from_numpy(batch_np)
    if device.type != "cuda":
        return batch
    return batch.pin_memory().to(device, non_blocking=True)


def train_step(engine, batches, aux_loss_coef: float, phase=lambda name: contextlib.nullcontext()):
    """One optimizer step over the micro-batches (DeepSpeed steps at the last). Returns the step's
    statistics on the device, summed over micro-batches: [loss, aux loss, routes per expert of each
    MoE layer]. phase(name) wraps each part (forward, backward, step) for the profiler."""
    stats = None
    for batch in batches:
        with phase("forward"):
            out = engine(batch[:, :-1], batch[:, 1:])
        with phase("backward"):
            engine.backward(out.loss + aux_loss_coef * out.aux_loss)
        with phase("step"):
            engine.step()
        micro = torch.cat([torch.stack([out.loss.detach().float(), out.aux_loss.detach().float()]),
                           out.expert_counts.detach().flatten().float()])
        stats = micro if stats is None else stats + micro
    return stats


class PendingStats:
    """The statistics of the steps not yet logged, kept on the device: the log reads them in one
    all_reduce and one copy every log.every steps instead of syncing with the GPU every step."""

    def __init__(self, num_moe_layers: int, num_experts: int):
        self.shape = (num_moe_layers, num_experts)
        self.steps, self.lrs, self.rows, self.grad_norms = [], [], [], []

    def add(self, step: int, lr: float, stats, grad_norm):
        self.steps.append(step)
        self.lrs.append(lr)
        self.rows.append(stats)
        # DeepSpeed keeps the norm as a device tensor (ZeRO) or a float; None before the first step.
        self.grad_norms.append(grad_norm if torch.is_tensor(grad_norm) else torch.tensor(float(grad_norm or 0.0)))

    def read(self, grad_accum: int, world: int):
        """The pending steps' train records (loss and aux averaged over micro-batches and ranks,
        expert load over all ranks), oldest first; empties the buffer."""
        if not self.rows:
            return []
        stats = torch.stack(self.rows)
        stats[:, :2] /= grad_accum
        dist.all_reduce(stats)
        norms = torch.stack([g.to(stats.device, torch.float32).reshape(()) for g in self.grad_norms])
        rows = torch.cat([stats, norms[:, None]], dim=1).tolist()  # the one host sync of the interval
        records = []
        layers, experts = self.shape
        for step, lr, row in zip(self.steps, self.lrs, rows):
            # Routes per expert over all ranks, in Python: torch's CPU ops on these few values took up to
            # 6 ms a call on the H100 machine's host with its 16 intra-op threads (0.02 with one), 60 ms a read.
            counts = [row[2 + i * experts:2 + (i + 1) * experts] for i in range(layers)]
            load_per_layer = [max(c) / max(sum(c) / experts, 1e-9) for c in counts]
            records.append({"type": "train", "step": step, "loss": row[0] / world, "aux_loss": row[1] / world,
                            "lr": lr, "grad_norm": row[-1], "expert_load": max(load_per_layer),
                            "expert_load_per_layer": load_per_layer})
        self.steps, self.lrs, self.rows, self.grad_norms = [], [], [], []
        return records


def read_interval(pending: PendingStats, grad_accum: int, world: int, start: float):
    """The pending steps' records and the wall seconds since start at which the device had run them.
    The read waits for the device, so the clock stops after it: the host queues steps ahead of the
    GPU (nothing in the step syncs), and a clock read before would time their issue, not their run."""
    records = pending.read(grad_accum, world)
    return records, time.perf_counter() - start


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


def uses_gpu() -> bool:
    """Whether this rank trains on a GPU. DeepSpeed's accelerator decides, not torch alone: with
    DS_ACCELERATOR=cpu the ranks stay on the CPU on a GPU machine too (the launcher still sets
    CUDA_VISIBLE_DEVICES, a GPU per rank, more than the machine may have)."""
    return get_accelerator().device_name() == "cuda" and torch.cuda.is_available()


def train(cfg, args, resume, samples):
    on_gpu = uses_gpu()
    if cfg.train.cuda_graph and not on_gpu:
        raise ConfigError("train.cuda_graph needs a GPU (CUDA graphs); this machine has none")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if on_gpu and local_rank >= torch.cuda.device_count():
        raise ConfigError(f"local rank {local_rank} needs GPU {local_rank}, but {torch.cuda.device_count()} are visible: "
                          "launch at most as many ranks as GPUs (--num_gpus), or set DS_ACCELERATOR=cpu for CPU ranks",
                          every_rank=True)  # only the ranks past the GPU count hit it
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
    precision = precision_of(t.precision, on_gpu)
    bf16 = precision == "bf16"
    ds_config = deepspeed_config(cfg, world, bf16)
    if rank == 0:  # the DeepSpeed config this run used, beside its log
        os.makedirs(cfg.log.dir, exist_ok=True)
        with open(os.path.join(cfg.log.dir, "ds_config.json"), "w") as f:
            json.dump(ds_config, f, indent=2)
    engine, model = build_engine(cfg, rank, ds_config, resuming=resume is not None)

    start_step = 0
    if resume is not None and not same_layout(checkpointing.read_meta(*resume), world, cfg.moe.ep_size):
        start_step = load_resharded(engine, model, os.path.join(*resume), rank % cfg.moe.ep_size, cfg.moe.ep_size)
    elif resume is not None:
        with torch.no_grad():  # as deepspeed.initialize above: no autograd graph over the parameters kept
            load_path, client_state = engine.load_checkpoint(resume[0], tag=resume[1])
        if load_path is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint {resume}")
        start_step = client_state["step"]
        # DeepSpeed's load leaves the next step the rate of the checkpoint's schedule; this run's may differ
        # (train.steps grown), as every later step and a resharded resume follow.
        if engine.lr_scheduler is not None:
            set_schedule(engine.lr_scheduler, engine.lr_scheduler.last_epoch)
    last_step = args.stop_at_step or t.steps
    launch = uuid.uuid4().hex  # rank 0's marks the tags this launch writes (checkpointing.prune) and its log
    log = RunLog(cfg, start_step, rank == 0, None if resume is None else os.path.join(*resume), launch)
    log.message(f"{cfg.name}: {cfg.model.num_parameters() / 1e6:.1f}M parameters "
                f"({cfg.model.num_parameters(active=True) / 1e6:.1f}M active), moe_impl={model.moe_impl}, "
                f"{world} ranks, ep_size={cfg.moe.ep_size}, zero={t.zero_stage}, {'bf16' if bf16 else 'fp32'}")

    valid_np = samples.valid_batches(rank, world, t.micro_batch_size, cfg.eval.batches)
    tokens_per_step = t.micro_batch_size * t.grad_accum * world * cfg.data.seq_len
    flops_per_token = cfg.model.flops_per_token(cfg.data.seq_len)
    peak = peak_flops(t.peak_tflops, on_gpu)
    check_vocab = vocab_size_of(cfg.data.source) is None
    # export checks that the tokenizer it writes beside the model is still the one the corpus was read with
    tokenizer_sha = None if cfg.data.tokenizer in (None, "bytes") else tokenizer_digest(cfg.data.tokenizer)
    if check_vocab:
        for b in valid_np:
            check_token_ids(b, cfg.model.vocab_size)
    valid = [to_device(b, device) for b in valid_np]
    t_start = time.perf_counter()
    valid_losses, intervals, train_loss = [], [], None  # intervals: (steps, seconds) of each log read
    if start_step == 0:
        valid_losses.append(evaluate(engine, valid, device))
        log.write({"type": "valid", "step": 0, "valid_loss": valid_losses[-1]})

    pending = PendingStats(len(cfg.model.moe_layers()), cfg.model.num_experts)
    interval_start = time.perf_counter()

    def flush():
        """One read of the device for every step since the last: their records, losses and times."""
        nonlocal interval_start, train_loss
        if not pending.steps:
            return
        steps = len(pending.steps)
        records, seconds = read_interval(pending, t.grad_accum, world, interval_start)
        intervals.append((steps, seconds))
        dt = seconds / steps
        for record in records:
            record.update(tokens=record["step"] * tokens_per_step, step_time_s=dt, tokens_per_s=tokens_per_step / dt,
                          mfu=tokens_per_step / dt * flops_per_token / (world * peak) if peak else None)
            log.train_step(record)
            train_loss = record["loss"]
        interval_start = time.perf_counter()

    for step in range(start_step, last_step):
        torch.manual_seed(t.seed * STEP_SEED_STRIDE + step)  # any random draw of this step (e.g. RTS) follows from it
        lr = engine.get_lr()[0]
        batches_np = [samples.train_batch(step, micro_step, t.grad_accum, rank, world, t.micro_batch_size)
                      for micro_step in range(t.grad_accum)]
        if check_vocab:
            for b in batches_np:
                check_token_ids(b, cfg.model.vocab_size)
        batches = [to_device(b, device) for b in batches_np]
        if step == start_step:
            capture_step(cfg, engine, model, batches[0])
        stats = train_step(engine, batches, cfg.moe.aux_loss_coef)
        done = step + 1
        pending.add(done, lr, stats, engine.get_global_grad_norm())
        evaluate_now = done % cfg.eval.every == 0 or done == t.steps
        checkpoint_now = (cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or done == last_step
        if done % cfg.log.every == 0 or evaluate_now or checkpoint_now:
            flush()
        if evaluate_now:
            valid_losses.append(evaluate(engine, valid, device))
            log.write({"type": "valid", "step": done, "valid_loss": valid_losses[-1]})
            log.message(f"step {done}: valid loss {valid_losses[-1]:.4f}")
        if checkpoint_now:
            checkpointing.save(engine, cfg.checkpoint.dir, done, cfg.checkpoint.keep,
                               {"world_size": world, "precision": precision, "corpus": samples.stream.digest,
                                "tokenizer_sha256": tokenizer_sha, "start_step": start_step, "launch": launch,
                                "config": cfg.to_dict()})
            log.write({"type": "checkpoint", "step": done,
                       "path": os.path.join(cfg.checkpoint.dir, checkpointing.tag_of(done))})
        if evaluate_now or checkpoint_now:  # their time is not a training step's
            interval_start = time.perf_counter()
    # Throughput over whole log intervals after the first (it holds the start-up: allocator, kernel
    # autotuning, compilation) and after the first tenth of the steps; all of them if there is one.
    steps_run = sum(n for n, _ in intervals)
    skip = skipped = 0
    while skip < len(intervals) - 1 and (skip == 0 or skipped < steps_run // 10):
        skipped += intervals[skip][0]
        skip += 1
    steady = intervals[skip:]
    tokens_per_s = tokens_per_step * sum(n for n, _ in steady) / sum(s for _, s in steady) if steady else None
    peak_memory_gib = None
    if on_gpu:  # the most any rank's allocator held
        held = torch.tensor([float(torch.cuda.max_memory_allocated())], device=device)
        dist.all_reduce(held, op=dist.ReduceOp.MAX)
        peak_memory_gib = held.item() / 2**30
    summary = {"type": "summary", "step": last_step, "steps_run": steps_run, "wall_s": time.perf_counter() - t_start,
               "train_loss": train_loss, "valid_loss_first": valid_losses[0] if valid_losses else None,
               "valid_loss_last": valid_losses[-1] if valid_losses else None, "tokens_per_s": tokens_per_s,
               "mfu": tokens_per_s * flops_per_token / (world * peak) if peak and tokens_per_s else None,
               "peak_memory_gib": peak_memory_gib, "device": torch.cuda.get_device_name() if on_gpu else "cpu",
               "world_size": world}
    log.write(summary)
    log.message("summary: " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in summary.items() if k != "type"))
    log.close()
    # Every rank past its last collective before any leaves. The process group is left to the interpreter's
    # exit: destroy_process_group() here hung a 4-GPU run (ep_size 4, CUDA graphs) after its summary, and
    # without it the same run exits (notes/robustness.md, 2026-11-27 21:13).
    dist.barrier()


CONFIG_ERROR_GRACE_S = 5.0  # how long ranks other than 0 wait before failing on a config error


def main(argv=None):
    args = parse_args(argv)
    if "RANK" not in os.environ:
        # Started without a launcher: one rank on this machine (DeepSpeed would otherwise look for MPI).
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    try:
        cfg, resume, samples = prepare(args)
        train(cfg, args, resume, samples)
    except ConfigError as e:
        rank = int(os.environ.get("RANK", "0"))
        defer = rank != 0 and not e.every_rank
        if defer:
            # Every rank finds the same error, and a launcher kills all ranks as soon as one fails: had
            # this one left first, rank 0 could be killed before it printed (seen with 2 GPUs, the user
            # got no message). So wait for rank 0 to print and fail (the launcher then kills this rank),
            # and print too if still here.
            time.sleep(CONFIG_ERROR_GRACE_S)
        print(f"pretrain.py: error{f' (rank {rank})' if defer else ''}: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
