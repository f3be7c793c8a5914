"""Times the MoE gating path on the GPU: turbomoe's fused ops against DeepSpeed's TopKGate gating
functions and MOELayer dispatch/combine, in the same run.

Gating path = router softmax/top-k, capacity, scatter into the expert buffer, score-weighted gather,
forward + backward, from fp32 logits [S, E] and bf16 tokens [S, M]; the experts are the identity
and the router GEMM is left out, for both. DeepSpeed's path is its own code, called the way
MOELayer.forward calls it (sparse routes, ep_size = 1). Also prints achieved GB/s of scatter and
gather (forward and backward) beside a device-to-device copy bandwidth measured here.

    python scripts/bench_gating.py [--quick] [--json out.json]
"""
import argparse
import json

import torch
from timing import copy_bandwidth_gbs, cuda_time_ms

import turbomoe
from turbomoe import ops
from turbomoe.kernels.rows import pull_rows, push_rows

CONFIGS = [(S, E, k, M) for S in (4096, 16384) for E in (8, 64) for k in (1, 2) for M in (2048, 4096)]
CAPACITY_FACTOR, MIN_CAPACITY = 1.0, 4


def deepspeed_path(logits, x, k):
    """DeepSpeed 0.19's gate + MOELayer dispatch/combine, identity experts."""
    from deepspeed.moe import sharded_moe as ds
    S, E = logits.shape
    M = x.shape[1]
    if k == 1:
        l_aux, C, _, idx, loc, gates, _ = ds.top1gating(logits, CAPACITY_FACTOR, MIN_CAPACITY, use_rts=True,
                                                       sparse_routes=True)
    elif k == 2:
        # top2gating adds Gumbel noise to its logits in place, as it does to the gate's output.
        l_aux, C, _, idx, loc, gates, _ = ds.top2gating(logits.clone(), CAPACITY_FACTOR, MIN_CAPACITY,
                                                       sparse_routes=True)
    else:
        l_aux, C, _, idx, loc, gates, _ = ds.topkgating(logits, k, CAPACITY_FACTOR, MIN_CAPACITY,
                                                       sparse_routes=True)
    C = int(C)
    slots = ds._route_slots(idx, loc, E, C)
    dispatched = ds._sparse_encode(x, slots, E, C)
    out = ds._sparse_decode(dispatched.view(E * C, M), slots, gates, S)
    return out, l_aux


def turbomoe_path(logits, x, k, seed=0):
    S, E = logits.shape
    g = ops.topk_gating(logits, k, renormalize=k > 1)
    C = turbomoe.capacity(S, E, k, CAPACITY_FACTOR, MIN_CAPACITY)
    s = ops.assign_slots(g.expert_ids, g.scores, E, C, "rts" if k == 1 else "position", seed)
    buf = ops.scatter_tokens(x, s)
    return ops.gather_tokens(buf, s, g.scores), g.aux_loss


def fwd_bwd(path, logits, x, k, grad_out):
    def step():
        logits.grad = x.grad = None
        out, aux = path(logits, x, k)
        torch.autograd.backward([out, aux], [grad_out, torch.ones_like(aux)])
    return step


TILES = [None, (1, 4096, 8), (1, 2048, 4), (2, 2048, 8), (1, 1024, 4), (4, 1024, 8)]


def row_bandwidths(S, E, k, M, copy_gbs):
    """Achieved GB/s of the row kernels (scatter and gather, forward and backward) at one config,
    launched directly so autograd's own overhead stays out. Bytes = each input read once, each
    output written once, kept rows only where a kernel touches only those. Each tile candidate
    (BLOCK_T, BLOCK_M, warps; None = the shipped heuristic) is timed."""
    dt = torch.bfloat16
    g = ops.topk_gating(torch.randn(S, E, device="cuda"), k, renormalize=k > 1)
    s = ops.assign_slots(g.expert_ids, g.scores, E, turbomoe.capacity(S, E, k, CAPACITY_FACTOR, MIN_CAPACITY))
    kept = int((s.slots >= 0).sum())
    R = s.num_rows
    x = torch.randn(S, M, device="cuda", dtype=dt)
    y = torch.randn(R, M, device="cuda", dtype=dt)
    buf, out = torch.empty(R, M, device="cuda", dtype=dt), torch.empty(S, M, device="cuda", dtype=dt)
    dscores = torch.empty_like(g.scores)
    e = 2  # bytes per bf16 element
    cases = {
        "scatter fwd": (lambda t: push_rows(x, s.slots, buf, s.kept_counts, s.capacity, tile=t), (S + R) * M * e),
        "scatter bwd": (lambda t: pull_rows(y, s.slots, out, tile=t), (kept + S) * M * e),
        "gather fwd": (lambda t: pull_rows(y, s.slots, out, g.scores, tile=t), (kept + S) * M * e),
        "gather bwd": (lambda t: push_rows(x, s.slots, buf, s.kept_counts, s.capacity, g.scores, y, dscores, tile=t),
                       (S + kept + R) * M * e),
    }
    rows = {}
    for name, (fn, nbytes) in cases.items():
        for tile in TILES:
            ms = cuda_time_ms(lambda: fn(tile))
            gbs = nbytes / ms / 1e6
            rows.setdefault(name, {})[str(tile)] = {"ms": ms, "GB/s": gbs, "of_copy": gbs / copy_gbs}
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="two configs only")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth_gbs()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_GB/s": copy_gbs,
               "configs": []}
    for S, E, k, M in CONFIGS[:2] if args.quick else CONFIGS:
        logits = torch.randn(S, E, device="cuda", requires_grad=True)
        x = torch.randn(S, M, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad_out = torch.randn(S, M, device="cuda", dtype=torch.bfloat16)
        ds_ms = cuda_time_ms(fwd_bwd(deepspeed_path, logits, x, k, grad_out))
        tm_ms = cuda_time_ms(fwd_bwd(turbomoe_path, logits, x, k, grad_out))
        results["configs"].append({"S": S, "E": E, "k": k, "M": M, "deepspeed_ms": ds_ms, "turbomoe_ms": tm_ms,
                                   "speedup": ds_ms / tm_ms})
    results["rows_S16384_E64_k2_M4096"] = row_bandwidths(16384, 64, 2, 4096, copy_gbs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(f"\n{results['device']}, torch {results['torch']}, bf16 tokens, fp32 logits, capacity factor "
          f"{CAPACITY_FACTOR}, forward + backward; copy bandwidth {copy_gbs:.0f} GB/s")
    print(f"{'S':>6} {'E':>3} {'k':>2} {'M':>5} | {'DeepSpeed ms':>12} {'turbomoe ms':>11} {'speedup':>8}")
    for c in results["configs"]:
        print(f"{c['S']:>6} {c['E']:>3} {c['k']:>2} {c['M']:>5} | {c['deepspeed_ms']:>12.3f} "
              f"{c['turbomoe_ms']:>11.3f} {c['speedup']:>7.1f}x")
    print("row kernels at S=16384 E=64 k=2 M=4096, % of copy bandwidth by tile (BLOCK_T, BLOCK_M, warps):")
    print(" " * 13 + " ".join(f"{t:>15}" for t in map(str, TILES)))
    for name, by_tile in results["rows_S16384_E64_k2_M4096"].items():
        print(f"  {name:<11}" + " ".join(f"{100 * r['of_copy']:>14.0f}%" for r in by_tile.values()))


if __name__ == "__main__":
    main()
