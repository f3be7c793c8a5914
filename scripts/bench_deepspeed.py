"""Stock deepspeed.moe.layer.MoE vs turbomoe's drop-in: forward + backward time on one GPU, bf16.

    python scripts/bench_deepspeed.py [--tokens 8192] [--hidden 2048] [--ffn 5632] [--configs 8x1,8x2,32x2,64x2]

SwiGLU experts, capacity factor 1.25, DeepSpeed's other defaults (top-1 RTS, top-2 second-expert
sampling). For each (E, k): the whole layer, the experts alone on the layer's [E, C, M] buffer
(stock: one expert after another; turbomoe: its grouped-GEMM path), and their difference, the
non-expert time (gate, dispatch, combine). Goals: turbomoe's non-expert time <= 1/4 of stock's and
its layer time <= 0.8x stock's. Prints a table and writes it as JSON with --json.
"""
import argparse
import json
import time

import torch

from turbomoe import ops
from turbomoe.integrations import deepspeed as tds
from turbomoe.integrations.deepspeed_experts import run_experts


def time_ms(fn, warmup: int, iters: int) -> float:
    """Median time of fn() (forward + backward): CUDA events on the GPU, the wall clock on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


def layer_step(layer, x_SM, grad_SM):
    def step():
        layer.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        out, l_aux, _ = layer(x_SM)
        torch.autograd.backward([out, l_aux], [grad_SM, torch.ones_like(l_aux)])
    return step


def experts_step(layer, kind, buf_GECM, grad_GECM):
    def step():
        layer.zero_grad(set_to_none=True)
        y = run_experts(layer.deepspeed_moe.experts, kind, buf_GECM)
        y.backward(grad_GECM)
    return step


def bench_config(args, E, k):
    S, M = args.tokens, args.hidden
    C = ops.capacity(S, E, k, args.capacity_factor, 4)
    kw = dict(hidden_size=M, num_experts=E, k=k, capacity_factor=args.capacity_factor)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only for a smoke run of small sizes
    dt = torch.bfloat16
    x = torch.randn(S, M, device=dev, dtype=dt, requires_grad=True)
    grad = torch.randn(S, M, device=dev, dtype=dt)
    buf = torch.randn(1, E, C, M, device=dev, dtype=dt, requires_grad=True)
    buf_grad = torch.randn_like(buf)
    row = {"E": E, "k": k, "C": C}

    torch.manual_seed(0)
    with torch.device(dev):  # initialise on the GPU: E = 64 experts are 2.2 B parameters
        stock = tds.StockMoE(expert=tds.SwiGLUExpert(M, args.ffn), **kw).to(dt)
    row["stock_layer_ms"] = time_ms(layer_step(stock, x, grad), args.warmup, args.iters)
    row["stock_experts_ms"] = time_ms(experts_step(stock, None, buf, buf_grad), args.warmup, args.iters)
    with torch.no_grad():
        torch.manual_seed(0)
        ref = stock(x)[0].float()
    state = stock.state_dict()
    del stock
    torch.cuda.empty_cache()

    with torch.device(dev):
        turbo = tds.MoE(expert=tds.SwiGLUExpert(M, args.ffn), **kw).to(dt)
    turbo.load_state_dict(state)
    del state
    assert turbo.deepspeed_moe.expert_fast_path == "swiglu"
    row["turbo_layer_ms"] = time_ms(layer_step(turbo, x, grad), args.warmup, args.iters)
    row["turbo_experts_ms"] = time_ms(experts_step(turbo, "swiglu", buf, buf_grad), args.warmup, args.iters)
    with torch.no_grad():
        torch.manual_seed(0)
        out = turbo(x)[0].float()
    # Top-1 RTS keeps other random subsets than stock's when experts overflow; top-2 matches.
    row["out_rel_err"] = ((out - ref).norm() / ref.norm()).item()
    del turbo
    torch.cuda.empty_cache()

    for impl in ("stock", "turbo"):
        row[f"{impl}_nonexpert_ms"] = row[f"{impl}_layer_ms"] - row[f"{impl}_experts_ms"]
    row["nonexpert_ratio"] = row["turbo_nonexpert_ms"] / row["stock_nonexpert_ms"]
    row["layer_ratio"] = row["turbo_layer_ms"] / row["stock_layer_ms"]
    return row


def print_table(rows):
    print(f"{'E':>3} {'k':>2} {'C':>5} | {'stock: layer':>12} {'experts':>8} {'non-exp':>8} | "
          f"{'turbo: layer':>12} {'experts':>8} {'non-exp':>8} | {'non-exp x':>9} {'layer x':>8} | {'out err':>8}")
    for r in rows:
        print(f"{r['E']:>3} {r['k']:>2} {r['C']:>5} | {r['stock_layer_ms']:>12.2f} {r['stock_experts_ms']:>8.2f} "
              f"{r['stock_nonexpert_ms']:>8.2f} | {r['turbo_layer_ms']:>12.2f} {r['turbo_experts_ms']:>8.2f} "
              f"{r['turbo_nonexpert_ms']:>8.2f} | {r['nonexpert_ratio']:>9.3f} {r['layer_ratio']:>8.3f} | "
              f"{r['out_rel_err']:>8.1e}")
    ok = all(r["nonexpert_ratio"] <= 0.25 and r["layer_ratio"] <= 0.8 for r in rows)
    print(f"goals (non-expert <= 0.25x, layer <= 0.8x stock) at every config: {'met' if ok else 'NOT met'}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--configs", default="8x1,8x2,32x2,64x2", help="comma-separated ExK")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU: timing on the CPU, meaningful only as a smoke run")
    configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
    rows = []
    for E, k in configs:
        rows.append(bench_config(args, E, k))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print_table(rows)


if __name__ == "__main__":
    main()
