"""Where the host time of a step goes: issue time per step, GPU time per step, and a cProfile table.

    python scripts/profile_host.py gating  [--S 4096 --E 8 --k 1 --M 2048]
    python scripts/profile_host.py deepspeed [--S 8192 --E 8 --k 1 --M 2048 --F 5632] [--identity-experts]
    python scripts/profile_host.py layer   [--S 8192 --E 64 --k 2 --M 2048 --F 5632]
    python scripts/profile_host.py launch  (the cost of one Triton launch, one torch op, one Function)

issue = wall time to queue N steps after a sync, divided by N (N small enough that the launch
queue never fills, so this is the host's cost alone); gpu = CUDA-event time of one step issued
onto an idle GPU after a warm-up, minus nothing: where issue > gpu, the step is host-bound.
"""
import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import require_gpu  # noqa: E402


def issue_us(step, n=20):
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    t = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return t


def kernel_count(step):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    return sum(e.count for e in events), sum(e.device_time_total for e in events)


def op_table(step, top, steps=5):
    """torch.profiler's host time per op (self CPU time, us per step), most expensive first."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    print(f"  {'self CPU us/step':>16} {'calls/step':>10}  op (torch.profiler, {steps} steps)")
    for e in rows:
        print(f"  {e.self_cpu_time_total / steps:16.1f} {e.count / steps:10.1f}  {e.key[:90]}")


def python_table(step, top, steps=20):
    """cProfile's table of the Python functions (own time, most first) over `steps` steps."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    print("\n".join(s.getvalue().splitlines()[:top + 12]))


def report(name, step, top):
    host = issue_us(step)
    n_kernels, gpu_us = kernel_count(step)
    print(f"{name}: host issue {host:.0f} us/step, {n_kernels} GPU ops, GPU busy {gpu_us:.0f} us/step")
    op_table(step, top)
    python_table(step, top)


def launch_costs():
    """us per call: a standard Triton launch, torch.empty, an empty autograd.Function apply."""
    from turbomoe.kernels.rows import pull_rows
    y = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(64, device="cuda", dtype=torch.int32).view(64, 1)
    out = torch.empty(64, 128, device="cuda", dtype=torch.bfloat16)

    class Nop(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a

        @staticmethod
        def backward(ctx, g):
            return g

    a = torch.randn(4, device="cuda", requires_grad=True)
    cases = {"pull_rows (launcher + Triton launch)": lambda: pull_rows(y, slots, out),
             "torch.empty": lambda: torch.empty(64, 128, device="cuda"),
             "torch add": lambda: y + y,
             "autograd.Function apply": lambda: Nop.apply(a)}
    # The same kernel launched through JITFunction.run, and straight through its compiled launcher.
    import triton
    from turbomoe.kernels.rows import _pull_rows_kernel, _renorm_args, row_tile
    bt, bm, w = row_tile(128, 2)
    grid = (triton.cdiv(64, bt), )
    args = (y, slots, y, out, 64, 128, 64)
    # pull_rows's own launch arguments (turbomoe/kernels/rows.py)
    meta = dict(K=1, KP=1, BLOCK_T=bt, BLOCK_M=bm, HAS_SCORES=False, RENORM=False, **_renorm_args(y.dtype))
    compiled = _pull_rows_kernel[grid](*args, **meta, num_warps=w)
    cases["JITFunction launch"] = lambda: _pull_rows_kernel[grid](*args, **meta, num_warps=w)
    stream = torch.cuda.current_stream().cuda_stream
    full = args + tuple(meta.values())
    cases["compiled.run launch"] = lambda: compiled.run(grid[0], 1, 1, stream, compiled.function,
                                                        compiled.packed_metadata, None, None, None, *full)
    for name, fn in cases.items():
        try:
            print(f"  {name:<40} {issue_us(fn, 2000):7.1f} us")
        except Exception as e:  # noqa: BLE001 (a probe of Triton internals: report and go on)
            print(f"  {name:<40} failed: {type(e).__name__}: {e}")


def gating_stages(S, E, k, M):
    """Host issue time of each stage of the gating path alone, and any synchronizing call in it."""
    import turbomoe
    from turbomoe import ops
    logits = torch.randn(S, E, device="cuda", requires_grad=True)
    x = torch.randn(S, M, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    C = turbomoe.capacity(S, E, k, 1.0, 4)
    policy = "rts" if k == 1 else "position"
    g = ops.topk_gating(logits, k, renormalize=k > 1)
    s = ops.assign_slots(g.expert_ids, g.scores, E, C, policy, 0)
    buf = ops.scatter_tokens(x, s)
    out = ops.gather_tokens(buf, s, g.scores)
    gy = torch.randn_like(out)
    stages = {"topk_gating": lambda: ops.topk_gating(logits, k, renormalize=k > 1),
              "assign_slots": lambda: ops.assign_slots(g.expert_ids, g.scores, E, C, policy, 0),
              "scatter_tokens": lambda: ops.scatter_tokens(x, s),
              "gather_tokens": lambda: ops.gather_tokens(buf, s, g.scores),
              "backward (all)": lambda: torch.autograd.backward(
                  [out, g.aux_loss], [gy, torch.ones_like(g.aux_loss)], retain_graph=True)}

    def backward_here():
        with torch.autograd.set_multithreading_enabled(False):
            stages["backward (all)"]()
    stages["backward, calling thread"] = backward_here
    for name, fn in stages.items():
        print(f"  {name:<16} {issue_us(fn, 50):7.1f} us")
    torch.cuda.set_sync_debug_mode("error")
    try:
        for fn in stages.values():
            fn()
        print("  no synchronizing call")
    except RuntimeError as e:
        print(f"  synchronizing call: {e}")
    finally:
        torch.cuda.set_sync_debug_mode("default")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["gating", "stages", "deepspeed", "layer", "launch"])
    p.add_argument("--S", type=int, default=None)
    p.add_argument("--E", type=int, default=8)
    p.add_argument("--k", type=int, default=1)
    p.add_argument("--M", type=int, default=2048)
    p.add_argument("--F", type=int, default=5632)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--identity-experts", action="store_true",
                   help="deepspeed: the non-expert part alone (experts replaced by the identity)")
    a = p.parse_args()
    torch.manual_seed(0)
    if a.what == "launch":
        launch_costs()
        return
    require_gpu(f"profile_host.py {a.what}")
    if a.what == "stages":
        gating_stages(a.S or 4096, a.E, a.k, a.M)
        return
    if a.what == "gating":
        from bench_gating import fwd_bwd, turbomoe_path
        S = a.S or 4096
        logits = torch.randn(S, a.E, device="cuda", requires_grad=True)
        x = torch.randn(S, a.M, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        step = fwd_bwd(turbomoe_path(None), logits, x, a.k, torch.randn_like(x))
    elif a.what == "deepspeed":
        from bench_deepspeed import identity_experts, layer_step
        from turbomoe.integrations import deepspeed as tds
        S = a.S or 8192
        with torch.device("cuda"):
            layer = tds.MoE(a.M, tds.SwiGLUExpert(a.M, a.F), a.E, k=a.k, capacity_factor=1.25).to(torch.bfloat16)
        x = torch.randn(S, a.M, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        step = layer_step(layer, x, torch.randn_like(x))
        if a.identity_experts:
            with identity_experts(layer):
                report(f"deepspeed, identity experts, S={S} E={a.E} k={a.k} M={a.M}", step, a.top)
            return
    else:
        from bench_layer import DEV, DTYPE, build, train_step
        S = a.S or 8192
        mod, rows = build("turbomoe", (S, a.M, a.F, a.E, a.k))
        mod = mod.to(DEV, DTYPE).train()
        x = torch.randn(rows, a.M, device=DEV, dtype=DTYPE, requires_grad=True)
        step = train_step(mod, x, torch.randn_like(x))
    report(f"{a.what} S={S} E={a.E} k={a.k} M={a.M}", step, a.top)


if __name__ == "__main__":
    main()
