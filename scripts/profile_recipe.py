"""Where the time of a recipe's training step goes: the step of recipes/pretrain.py (same config,
engine and step function), timed three ways on one GPU (or one rank a GPU, below).

    python scripts/profile_recipe.py --config recipes/configs/small-1gpu.yaml [--set train.zero_stage=0 ...]

  queued     steps issued back to back, the device statistics read every log.every steps, as the
             recipe runs: CUDA-event ms per step (the throughput number)
  phases     each phase (forward, backward, engine.step, the log's device read) waited for: host
             perf_counter medians, so a phase's GPU and host time both show, without overlap
  profiler   torch.profiler over a few steps: the top ops by self CUDA time and by self CPU time,
             and the total per phase (record_function ranges)
  host       with --host-profile: cProfile of the host's Python over queued steps, by function

Runs as one process (no launcher needed: it sets the single-rank environment itself), or under the
deepspeed launcher as the recipe does, one rank a GPU (`deepspeed --num_gpus 2 scripts/profile_recipe.py
--config recipes/configs/1b-4gpu.yaml --set moe.ep_size=2`): every rank steps, rank 0 prints and traces
(MFU over all ranks' GPUs).
"""
import argparse
import collections
import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "recipes"))
sys.path.insert(0, ROOT)
for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                   ("MASTER_PORT", "29533")):
    os.environ.setdefault(key, value)

import deepspeed  # noqa: E402
import torch  # noqa: E402

import pretrain  # noqa: E402
from turbomoe.models.compile import compile_dense_blocks  # noqa: E402


def all_ranks_peak(per_gpu_flops, world: int):
    """The peak FLOP/s of all ranks' GPUs, or None where the GPU's peak is not known (no
    train.peak_tflops and a name PEAK_BF16_TFLOPS lacks): the timings print without an MFU then,
    as the recipe's log does, instead of failing on None * world."""
    return world * per_gpu_flops if per_gpu_flops else None


def _enclosing(spans, times):
    """For each of times, the names of the spans (ts, end, name; nested) that contain it, innermost first."""
    # A parent and its child may start at the same microsecond: the longer (the parent) goes on the stack first.
    spans, out, stack, i = sorted(spans, key=lambda s: (s[0], -s[1])), {}, [], 0
    for t in sorted(set(times)):
        while i < len(spans) and spans[i][0] <= t:
            while stack and stack[-1][1] < spans[i][0]:
                stack.pop()
            stack.append(spans[i])
            i += 1
        while stack and stack[-1][1] < t:
            stack.pop()
        out[t] = [name for s, e, name in reversed(stack) if e >= t]
    return out


def gpu_time_by_line(events, lines=3, site=re.compile(r"turbomoe/|recipes/|deepspeed/")):
    """A Chrome trace's GPU time (kernels, copies, sets) by where it was launched: the innermost aten op
    around its launch, the autograd node that ran it (backward), and the innermost `lines` Python frames
    of this tree or DeepSpeed (the profiler's with_stack). [((op, frames), (us, launches))], most first."""
    events = [e for e in events if e.get("ph") == "X"]
    launch = {e["args"]["correlation"]: e for e in events
              if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    spans = {"cpu_op": collections.defaultdict(list), "python_function": collections.defaultdict(list)}
    for e in events:
        if e.get("cat") in spans:
            spans[e["cat"]][e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    at = collections.defaultdict(list)  # thread -> launch times
    for e in gpu:
        r = launch.get(e.get("args", {}).get("correlation"))
        if r is not None:
            at[r["tid"]].append(r["ts"])
    ops = {tid: _enclosing(spans["cpu_op"][tid], ts) for tid, ts in at.items()}
    frames = {tid: _enclosing(spans["python_function"][tid], ts) for tid, ts in at.items()}
    total = collections.defaultdict(lambda: [0.0, 0])
    for e in gpu:
        r = launch.get(e.get("args", {}).get("correlation"))
        op, where = "(launch not traced)", ""
        if r is not None:
            around = ops[r["tid"]][r["ts"]]
            node = next((o.split(": ", 1)[1] for o in around
                         if o.startswith("autograd::engine::evaluate_function: ")), None)
            op = (around[0] if around else "(no aten op)") + (f" @ {node}" if node else "")
            where = " < ".join([f for f in frames[r["tid"]][r["ts"]] if site.search(f)][:lines])
        total[(op, where)][0] += e["dur"]
        total[(op, where)][1] += 1
    return sorted(((k, tuple(v)) for k, v in total.items()), key=lambda kv: -kv[1][0])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20, help="steps of the queued and phases timings")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--trace", default=None, help="write the profiler's Chrome trace here")
    p.add_argument("--label", default="", help="a name for this run in the printed tables")
    p.add_argument("--host-profile", action="store_true", help="also cProfile the host over --steps queued steps")
    p.add_argument("--by-line", action="store_true",
                   help="also the GPU time by the aten op, autograd node and Python lines that launched it (the "
                        "profiler records Python frames: a slower host); eager steps only (train.cuda_graph=false): "
                        "a CUDA graph's kernels come from no Python frame")
    p.add_argument("--then-compile", action="store_true",
                   help="then compile the dense blocks in place (train.compile) and measure again")
    a = p.parse_args()
    args = pretrain.parse_args(["--config", a.config, *sum((["--set", s] for s in a.set), []),
                                "--set", "log.wandb=false", "--set", "checkpoint.every=0",
                                # it writes no log: an empty directory, so that prepare's check of a
                                # log.dir holding another run's log never refuses it
                                "--set", f"log.dir={tempfile.mkdtemp(prefix='profile_recipe_')}"])
    cfg, _, samples = pretrain.prepare(args)
    if not torch.cuda.is_available():
        sys.exit("profile_recipe.py needs a GPU")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    say = print if rank == 0 else (lambda *args, **kwargs: None)
    t = cfg.train
    engine, model = pretrain.build_engine(cfg, rank, pretrain.deepspeed_config(cfg, world, t.precision != "fp32"))
    device = torch.device("cuda", local_rank)
    if a.then_compile and t.cuda_graph:
        sys.exit("--then-compile would compile blocks the captured graphs do not run: drop train.cuda_graph")
    t0 = time.perf_counter()
    pretrain.capture_step(cfg, engine, model, pretrain.to_device(
        samples.train_batch(0, 0, t.grad_accum, rank, world, t.micro_batch_size), device))
    if t.cuda_graph:
        say(f"train.cuda_graph: captured in {time.perf_counter() - t0:.1f} s")
    tokens = t.micro_batch_size * t.grad_accum * cfg.data.seq_len * world  # a step, all ranks
    flops = tokens * cfg.model.flops_per_token(cfg.data.seq_len)
    peak = all_ranks_peak(pretrain.peak_flops(t.peak_tflops, on_gpu=True), world)
    pending = pretrain.PendingStats(len(cfg.model.moe_layers()), cfg.model.num_experts)
    step_no = [0]

    def batches():
        s = step_no[0]
        step_no[0] += 1
        return [pretrain.to_device(samples.train_batch(s, m, t.grad_accum, rank, world, t.micro_batch_size), device)
                for m in range(t.grad_accum)]

    def step(phase=lambda name: contextlib.nullcontext()):
        lr = engine.get_lr()[0]
        stats = pretrain.train_step(engine, batches(), cfg.moe.aux_loss_coef, phase)
        pending.add(step_no[0], lr, stats, engine.get_global_grad_norm())
        if len(pending.steps) == cfg.log.every:
            with phase("log read"):
                pending.read(t.grad_accum, world)

    valid = pretrain.to_device(samples.valid_batches(rank, world, t.micro_batch_size, 1)[0], device)

    def fixed_loss():
        """The loss of one validation batch at the current weights (eager vs compiled)."""
        with torch.no_grad():
            return engine(valid[:, :-1], valid[:, 1:]).loss.float().item()

    def measure(label):
        for _ in range(a.warmup):
            step()
        pending.read(t.grad_accum, world)
        torch.cuda.synchronize()

        # queued: as the recipe runs
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for _ in range(a.steps):
            step()
        end.record()
        host_ms = 1e3 * (time.perf_counter() - t0) / a.steps  # before the wait: the host's issue of the steps
        end.synchronize()
        queued_ms = start.elapsed_time(end) / a.steps
        pending.read(t.grad_accum, world)

        # phases: each waited for
        times = {}

        @contextlib.contextmanager
        def timed(name):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            yield
            torch.cuda.synchronize()
            times.setdefault(name, []).append(1e3 * (time.perf_counter() - t0))

        for _ in range(a.steps):
            step(timed)
        pending.read(t.grad_accum, world)

        # profiler
        from torch.profiler import ProfilerActivity, profile, record_function
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=a.by_line) as prof:
            for _ in range(a.profile_steps):
                with record_function("train step"):
                    step(record_function)
            torch.cuda.synchronize()
        trace = a.trace and a.trace.replace(".json", f"-{label.replace(' ', '_')}.json")
        if rank == 0 and (trace or a.by_line):
            trace = trace or os.path.join(tempfile.mkdtemp(prefix="profile_recipe_"), "trace.json")
            prof.export_chrome_trace(trace)

        host_profile = None
        if a.host_profile:  # the host's Python by function while the GPU runs the same steps
            import cProfile
            import io
            import pstats
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(a.steps):
                step()
            torch.cuda.synchronize()
            pr.disable()
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(a.top)
            host_profile = buf.getvalue()
            pending.read(t.grad_accum, world)

        avg = prof.key_averages()
        say(f"\n## {cfg.name} [{label}]: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
        say(f"optimizer {type(engine.optimizer).__name__} over {type(engine.basic_optimizer).__name__}, "
            f"moe_impl {model.moe_impl}, zero {t.zero_stage}, fused_adamw {t.fused_adamw}, "
            f"compile {t.compile}, cuda_graph {t.cuda_graph}, "
            f"backends {os.environ.get('TURBOMOE_BACKEND', 'default')}/{os.environ.get('TURBOMOE_GMM_BACKEND', 'default')}")
        mfu = f", MFU {100 * flops / (queued_ms / 1e3) / peak:.1f}%" if peak else ""
        say(f"queued: {queued_ms:.1f} ms/step (host issue {host_ms:.1f} ms/step: issuing them, waits inside a step included), "
            f"{tokens / queued_ms * 1e3:,.0f} tokens/s{mfu}")
        say("phases (each waited for, median ms over %d steps): " % a.steps
            + ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in times.items())
            + f"; sum {sum(statistics.median(v) for v in times.values()):.1f}")
        say("profiler, per phase (ms per step: CPU total, CUDA total):")
        for e in avg:
            if e.key in ("train step", "forward", "backward", "step", "log read"):
                n = a.profile_steps
                say(f"  {e.key:12s} cpu {e.cpu_time_total / 1e3 / n:8.1f}  cuda {e.device_time_total / 1e3 / n:8.1f}")
        say(f"top {a.top} ops by self CUDA time (over {a.profile_steps} steps):")
        say(avg.table(sort_by="self_cuda_time_total", row_limit=a.top, max_name_column_width=60))
        say(f"top {a.top} ops by self CPU time:")
        say(avg.table(sort_by="self_cpu_time_total", row_limit=a.top, max_name_column_width=60))
        if a.by_line and rank == 0:
            with open(trace) as f:
                rows = gpu_time_by_line(json.load(f)["traceEvents"])
            say(f"top {a.top} launch sites by GPU time (us a step, launches a step, aten op @ autograd node, this "
                f"tree's and DeepSpeed's innermost Python lines):")
            for (op, lines), (us, n) in rows[:a.top]:
                say(f"{us / a.profile_steps:9.1f} {n / a.profile_steps:6.0f}  {op:60s} {lines}")
        if host_profile:
            say(f"host Python over {a.steps} queued steps (cProfile, by own time):\n{host_profile}")

    label = a.label or " ".join(a.set) or "as configured"
    measure(label)
    if a.then_compile and not t.compile:
        eager_loss = fixed_loss()
        compile_dense_blocks(model)
        t0 = time.perf_counter()
        compiled_loss = fixed_loss()  # same weights: compiles the no-grad graphs
        step()  # compiles the training graphs, forward and backward
        torch.cuda.synchronize()
        say(f"\ncompile_dense_blocks: first no-grad forward + first step {time.perf_counter() - t0:.1f} s; "
            f"loss of a validation batch at the same weights: eager {eager_loss:.6f}, compiled {compiled_loss:.6f}")
        measure(label + " + compile")


if __name__ == "__main__":
    main()
