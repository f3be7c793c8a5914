"""Stock deepspeed.moe.layer.MoE vs turbomoe's drop-in: forward + backward time on one GPU, bf16.

    python scripts/bench_deepspeed.py [--tokens 8192] [--hidden 2048] [--ffn 5632] [--configs 8x1,8x2,32x2,64x2]

SwiGLU experts, capacity factor 1.25, DeepSpeed's other defaults (top-1 RTS, top-2 second-expert
sampling). For each (E, k): the whole layer, the experts alone on the layer's [E, C, M] buffer
(stock: one expert after another; turbomoe: its grouped-GEMM path), and their difference, the
non-expert time (gate, dispatch, combine), timed in pairs: layer and experts alternate step by
step and the median is taken over each pair's difference, so host drift cancels (stock's experts
alone are E host-bound small steps). Also the non-expert part alone ("direct"): the layer with
its experts replaced by the identity, where nothing hides its host time. Goals: turbomoe's non-expert time <= 1/4 of
stock's and its layer time <= 0.8x stock's. Every time is taken queued (the table: steps back to back, as in
training) and synced (each step from an idle GPU, where the CPU time of a step's small ops shows);
scripts/timing.py says how. Prints both tables and writes the rows as JSON with --json.
"""
import argparse
import contextlib
import json

import torch
from timing import paired_times_ms, reset_grads, step_times_ms
from torch import nn

from turbomoe import ops
from turbomoe.integrations import deepspeed as tds
from turbomoe.integrations.deepspeed_experts import run_experts


def layer_step(layer, x_SM, grad_SM):
    params = list(layer.parameters())

    def step():
        reset_grads(params)
        out, l_aux, _ = layer(x_SM)
        torch.autograd.backward([out, l_aux], [grad_SM, torch.ones_like(l_aux)])
    return step


def experts_step(layer, kind, buf_GECM, grad_GECM):
    params = list(layer.parameters())

    def step():
        reset_grads(params)
        y = run_experts(layer.deepspeed_moe.experts, kind, buf_GECM)
        y.backward(grad_GECM)
    return step


@contextlib.contextmanager
def identity_experts(layer):
    """The layer with its experts replaced by the identity: what is left is the non-expert part
    (gate, dispatch, combine) alone, timed directly rather than as a difference of two times."""
    inner = layer.deepspeed_moe
    experts, fast_path = inner.experts, getattr(inner, "expert_fast_path", None)
    inner.experts = nn.Identity()
    if fast_path is not None:
        inner.expert_fast_path = None
    try:
        yield layer
    finally:
        inner.experts = experts
        if fast_path is not None:
            inner.expert_fast_path = fast_path


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
    timed_pair(row, "stock", layer_step(stock, x, grad), experts_step(stock, None, buf, buf_grad), args)
    with identity_experts(stock):
        timed(row, "stock_direct_nonexpert", layer_step(stock, x, grad), args)
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
    timed_pair(row, "turbo", layer_step(turbo, x, grad), experts_step(turbo, "swiglu", buf, buf_grad), args)
    with identity_experts(turbo):
        timed(row, "turbo_direct_nonexpert", layer_step(turbo, x, grad), args)
    with torch.no_grad():
        torch.manual_seed(0)
        out = turbo(x)[0].float()
    # Top-1 RTS keeps other random subsets than stock's when experts overflow; top-2 matches.
    row["out_rel_err"] = ((out - ref).norm() / ref.norm()).item()
    del turbo
    torch.cuda.empty_cache()

    for t in ("", "synced_"):
        row[f"nonexpert_{t}ratio"] = row[f"turbo_nonexpert_{t}ms"] / row[f"stock_nonexpert_{t}ms"]
        row[f"direct_nonexpert_{t}ratio"] = row[f"turbo_direct_nonexpert_{t}ms"] / row[f"stock_direct_nonexpert_{t}ms"]
        row[f"layer_{t}ratio"] = row[f"turbo_layer_{t}ms"] / row[f"stock_layer_{t}ms"]
    return row


def timed(row, name, step, args):
    """row[name_ms] (queued) and row[name_synced_ms]."""
    row[f"{name}_ms"], row[f"{name}_synced_ms"] = step_times_ms(step, args.warmup, args.iters)


def timed_pair(row, impl, layer, experts, args):
    """row[impl_{layer,experts,nonexpert}_ms] and their _synced_ms: layer and experts steps alternated,
    nonexpert the median of layer - experts within each pair."""
    t = paired_times_ms(layer, experts, args.warmup, args.iters)
    for part, key in (("layer", "a"), ("experts", "b"), ("nonexpert", "a_minus_b")):
        row[f"{impl}_{part}_ms"], row[f"{impl}_{part}_synced_ms"] = t[key]


def print_table(rows, t=""):
    """t: "" for the queued times, "synced_" for the synced ones."""
    print(f"{'E':>3} {'k':>2} {'C':>5} | {'stock: layer':>12} {'experts':>8} {'non-exp':>8} {'direct':>7} | "
          f"{'turbo: layer':>12} {'experts':>8} {'non-exp':>8} {'direct':>7} | {'non-exp x':>9} {'direct x':>8} "
          f"{'layer x':>8} | {'out err':>8}")
    for r in rows:
        cells = [f"{r[f'{impl}_{part}_{t}ms']:>{w}.2f}" for impl in ("stock", "turbo")
                 for part, w in (("layer", 12), ("experts", 8), ("nonexpert", 8), ("direct_nonexpert", 7))]
        print(f"{r['E']:>3} {r['k']:>2} {r['C']:>5} | {' '.join(cells[:4])} | {' '.join(cells[4:])} | "
              f"{r[f'nonexpert_{t}ratio']:>9.3f} {r[f'direct_nonexpert_{t}ratio']:>8.3f} {r[f'layer_{t}ratio']:>8.3f}"
              f" | {r['out_rel_err']:>8.1e}")
    verdict = {kind: all(0 < r[f"{kind}nonexpert_{t}ratio"] <= 0.25 and r[f"layer_{t}ratio"] <= 0.8 for r in rows)
               for kind in ("", "direct_")}
    print("goals (non-expert <= 0.25x, layer <= 0.8x stock) at every config: "
          f"{'met' if verdict['direct_'] else 'NOT met'} with the direct non-expert time, "
          f"{'met' if verdict[''] else 'NOT met'} with layer - experts")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--configs", default="8x1,8x2,32x2,64x2", help="comma-separated ExK")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=30)
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
    print("\nsynced (each step from an idle GPU), ms")
    print_table(rows, "synced_")
    print("\nqueued (steps back to back, as in training), ms")
    print_table(rows)


if __name__ == "__main__":
    main()
