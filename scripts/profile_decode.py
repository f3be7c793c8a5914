"""Where a decode step of the generation benchmark's model spends its GPU time: the step's CUDA graph
replayed (median of 50 replays), generate's tokens/s (fastest of 3 calls), and torch.profiler's
kernels summed by name over 20 replays, with the dense parts eager and compiled (Engine's compile).

    python scripts/profile_decode.py [--batches 1,8,64] [--modes eager,compiled] [--top 12] [--out DIR]
        [--model qwen3-30b]   (Qwen3-30B-A3B's size, random weights made on the GPU: bench_inference's generate-30b)
"""
import argparse
import collections
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_inference import GEN_MODEL, fastest_wall, qwen3_30b_engine  # noqa: E402
from timing import cuda_time_ms, require_gpu  # noqa: E402

PROMPT, NEW_TOKENS = 32, 64


def profile_step(engine, B, top, say):
    from torch.profiler import ProfilerActivity, profile
    ids = torch.randint(0, engine.config.vocab_size, (B, PROMPT), device="cuda")
    t0 = time.perf_counter()
    tokens = engine.generate(ids, NEW_TOKENS)
    say(f"  first generate at batch {B} (compiles and capture included): {time.perf_counter() - t0:.1f} s")
    graph, _ = engine.graphs[engine._bucket(B)]
    step_us = cuda_time_ms(graph.replay, warmup=10, iters=50) * 1e3
    _, wall = fastest_wall(lambda: engine.generate(ids, NEW_TOKENS), torch.cuda.synchronize)
    replays = 20
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name][0] += 1
            kernels[e.name][1] += e.device_time_total
    say(f"  batch {B}: step {step_us:.1f} us (graph replay, median), generate "
        f"{B * NEW_TOKENS / wall:.0f} tokens/s, {sum(c for c, _ in kernels.values()) / replays:.0f} kernels and "
        f"{sum(t for _, t in kernels.values()) / replays:.1f} us of kernel time a step")
    for name, (count, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]:
        say(f"     {count / replays:6.1f} x {us / replays:8.1f} us  {name[:110]}")
    return tokens


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=lambda v: [int(b) for b in v.split(",")], default=[1, 8, 64])
    p.add_argument("--modes", type=lambda v: v.split(","), default=["eager", "compiled"],
                   help="the dense parts eager, compiled or both (an A/B of two trees needs one)")
    p.add_argument("--top", type=int, default=12, help="kernels listed a batch, most time first")
    p.add_argument("--out", default=None, help="folder for profile_decode.txt")
    p.add_argument("--model", choices=("gen", "qwen3-30b"), default="gen",
                   help="the generation benchmark's ~1B model (default) or Qwen3-30B-A3B's size")
    args = p.parse_args()
    if not args.modes or set(args.modes) - {"eager", "compiled"}:
        p.error(f"--modes: eager, compiled or both, not {','.join(args.modes)}")
    require_gpu("scripts/profile_decode.py")
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from turbomoe.inference import load
    lines = []

    def say(s):
        lines.append(s)
        print(s, flush=True)

    torch.manual_seed(0)
    if args.model == "gen":
        hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**GEN_MODEL)).to(device="cuda", dtype=torch.bfloat16).eval()
        path = tempfile.mkdtemp()
        hf.save_pretrained(path)
        del hf

    def engine_of(compiled):
        if args.model == "gen":
            return load(path, device="cuda", dtype=torch.bfloat16, max_batch=max(args.batches),
                        max_seq_len=PROMPT + NEW_TOKENS, compile=compiled)
        torch.manual_seed(0)  # each mode the same weights: the tokens compared below come from one model
        return qwen3_30b_engine(max_batch=max(args.batches), max_seq_len=PROMPT + NEW_TOKENS, compile=compiled)

    say(f"{torch.cuda.get_device_name()} torch {torch.__version__} {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    tokens = {}
    for compiled in (mode == "compiled" for mode in args.modes):
        engine = engine_of(compiled)
        say(f"dense parts {'compiled' if compiled else 'eager'}")
        torch.manual_seed(1)  # the same prompts both ways
        tokens[compiled] = [profile_step(engine, B, args.top, say) for B in args.batches]
        del engine
        torch.cuda.empty_cache()
    for B, eager, comp in zip(args.batches, tokens.get(False, ()), tokens.get(True, ())):
        say(f"batch {B}: greedy tokens equal eager / compiled: {float((eager == comp).float().mean()):.3f}")
    if args.out:
        with open(os.path.join(args.out, "profile_decode.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
