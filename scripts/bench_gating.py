"""Times the MoE gating path on the GPU: turbomoe's fused ops against DeepSpeed's TopKGate gating
functions and MOELayer dispatch/combine, in the same run.

Gating path = router softmax/top-k, capacity, scatter into the expert buffer, score-weighted gather,
forward + backward, from fp32 logits [S, E] and bf16 tokens [S, M]; the experts are the identity
and the router GEMM is left out, for both. DeepSpeed's path is its own code, called the way
MOELayer.forward calls it (sparse routes, ep_size = 1). Also prints achieved GB/s of scatter and
gather (forward and backward) beside a device-to-device copy bandwidth measured here.
turbomoe is timed on both kernel backends: "cuda" (turbomoe/csrc, the default where it builds)
and "triton"; eagerly (steps issued back to back) and replayed from a CUDA graph. All of a
config's paths are timed in the same rounds, one step of each in turn (timing.interleaved_medians_ms):
at S = 4096 the eager steps are host-bound, and the host's speed drifts between runs.

"In a model": each step is issued behind a model's other GPU work (an 8192^3 bf16 GEMM, about
1.4 ms on an H100), and the GEMM's own time is subtracted. There a path's host time hides behind
the queued GPU work unless the path waits on the GPU: turbomoe's never does; DeepSpeed's reads the
capacity on the host, so its host time stays exposed. The host's thread wake-up latency is printed
too: two wake-ups (to autograd's device thread and back) are part of every eager step.

    python scripts/bench_gating.py [--quick] [--json out.json]
"""
import argparse
import functools
import json

import torch
from timing import capture_graph, copy_bandwidth_gbs, cuda_time_ms, interleaved_medians_ms, require_gpu, thread_wakeup_us

import turbomoe
from turbomoe import ops

CONFIGS = [(S, E, k, M) for S in (4096, 16384) for E in (8, 64) for k in (1, 2) for M in (2048, 4096)]
CAPACITY_FACTOR, MIN_CAPACITY = 1.0, 4
MODEL_GEMM = 8192  # the "in a model" steps run behind an n^3 bf16 GEMM


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


def turbomoe_path(backend):
    def path(logits, x, k, seed=0):
        S, E = logits.shape
        g = ops.topk_gating(logits, k, renormalize=k > 1, backend=backend)
        C = turbomoe.capacity(S, E, k, CAPACITY_FACTOR, MIN_CAPACITY)
        s = ops.assign_slots(g.expert_ids, g.scores, E, C, "rts" if k == 1 else "position", seed, backend=backend)
        buf = ops.scatter_tokens(x, s, backend=backend)
        return ops.gather_tokens(buf, s, g.scores, backend=backend), g.aux_loss
    return path


def fwd_bwd(path, logits, x, k, grad_out):
    def step():
        logits.grad = x.grad = None
        out, aux = path(logits, x, k)
        torch.autograd.backward([out, aux], [grad_out, torch.ones_like(aux)])
    return step


def cuda_graph(step):
    """Captures step (forward + backward) once; returns a replay. Possible only for a path with no
    host sync and no data-dependent shapes: turbomoe's, not DeepSpeed's (it reads C on the host)."""
    return capture_graph(step).replay


def behind(work, step):
    """step issued right after work, as a layer's gating follows the model's other kernels."""
    def both():
        work()
        step()
    return both


def row_bandwidths(S, E, k, M, copy_gbs, backend):
    """Achieved GB/s of the row kernels (scatter and gather, forward and backward) at one config,
    launched directly so autograd's own overhead stays out. Bytes = each input read once, each
    output written once, kept rows only where a kernel touches only those."""
    push_rows, pull_rows = ops._impl(backend).push_rows, ops._impl(backend).pull_rows
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
        "scatter fwd": (lambda: push_rows(x, s.slots, buf, s.kept_counts, s.capacity), (S + R) * M * e),
        "scatter bwd": (lambda: pull_rows(y, s.slots, out), (kept + S) * M * e),
        "gather fwd": (lambda: pull_rows(y, s.slots, out, g.scores), (kept + S) * M * e),
        "gather bwd": (lambda: push_rows(x, s.slots, buf, s.kept_counts, s.capacity, g.scores, y, dscores),
                       (S + kept + R) * M * e),
    }
    rows = {}
    for name, (fn, nbytes) in cases.items():
        ms = cuda_time_ms(fn)
        gbs = nbytes / ms / 1e6
        rows[name] = {"ms": ms, "GB/s": gbs, "of_copy": gbs / copy_gbs}
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="two configs only")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    require_gpu("bench_gating.py")
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth_gbs()
    backends = ["cuda", "triton"] if ops.csrc.available() else ["triton"]
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_GB/s": copy_gbs,
               "thread_wakeup_us": thread_wakeup_us(), "backends": backends, "configs": []}
    a = torch.randn(MODEL_GEMM, MODEL_GEMM, device="cuda", dtype=torch.bfloat16)
    model_work = functools.partial(torch.mm, a, a)
    for S, E, k, M in CONFIGS[:2] if args.quick else CONFIGS:
        logits = torch.randn(S, E, device="cuda", requires_grad=True)
        x = torch.randn(S, M, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad_out = torch.randn(S, M, device="cuda", dtype=torch.bfloat16)
        ds = fwd_bwd(deepspeed_path, logits, x, k, grad_out)
        eager = [fwd_bwd(turbomoe_path(b), logits, x, k, grad_out) for b in backends]
        graphed = cuda_graph(fwd_bwd(turbomoe_path(backends[0]), logits, x, k, grad_out))
        t_ds, *t_eager, t_graph, t_gemm, t_ds_behind, t_behind = interleaved_medians_ms(
            [ds, *eager, graphed, model_work, behind(model_work, ds), behind(model_work, eager[0])])
        row = {"S": S, "E": E, "k": k, "M": M, "deepspeed_ms": t_ds, "graph_ms": t_graph, "model_gemm_ms": t_gemm,
               "deepspeed_in_model_ms": t_ds_behind - t_gemm, "in_model_ms": t_behind - t_gemm}
        for b, ms in zip(backends, t_eager):
            row[f"{b}_ms"] = ms
        for key in [f"{b}_ms" for b in backends] + ["graph_ms"]:
            row[key.replace("_ms", "_speedup")] = row["deepspeed_ms"] / row[key]
        row["in_model_speedup"] = row["deepspeed_in_model_ms"] / row["in_model_ms"]
        results["configs"].append(row)
    results["rows_S16384_E64_k2_M4096"] = {b: row_bandwidths(16384, 64, 2, 4096, copy_gbs, b) for b in backends}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(f"\n{results['device']}, torch {results['torch']}, bf16 tokens, fp32 logits, capacity factor "
          f"{CAPACITY_FACTOR}, forward + backward; copy bandwidth {copy_gbs:.0f} GB/s; host thread wake-up "
          f"{results['thread_wakeup_us']:.0f} us")
    heads = [f"{b} eager" for b in backends] + [f"{backends[0]} graphed"]
    print(f"{'S':>6} {'E':>3} {'k':>2} {'M':>5} | {'DeepSpeed':>9} | " + " | ".join(f"{h:>17}" for h in heads)
          + f" || in a model: {'DeepSpeed':>9} | {backends[0] + ' eager':>17}   (ms, speedup)")
    for c in results["configs"]:
        cells = [f"{c[key + '_ms']:>8.3f} {c[key + '_speedup']:>7.1f}x" for key in backends + ["graph"]]
        print(f"{c['S']:>6} {c['E']:>3} {c['k']:>2} {c['M']:>5} | {c['deepspeed_ms']:>9.3f} | " + " | ".join(cells)
              + f" || {'':>11} {c['deepspeed_in_model_ms']:>9.3f} | {c['in_model_ms']:>8.3f} "
              f"{c['in_model_speedup']:>7.1f}x")
    for b, rows in results["rows_S16384_E64_k2_M4096"].items():
        print(f"row kernels ({b}) at S=16384 E=64 k=2 M=4096:")
        for name, r in rows.items():
            print(f"  {name:<12} {r['ms']:.3f} ms  {r['GB/s']:.0f} GB/s  {100 * r['of_copy']:.0f}% of copy")


if __name__ == "__main__":
    main()
