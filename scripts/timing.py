"""Timing helpers shared by the benchmark scripts: CUDA-event medians and the copy ceiling.

Two ways to time a step, both CUDA-event medians after warm-up:
  queued  events around each step, steps issued back to back, one sync at the end (the method of
          triton.testing.do_bench): the step's GPU time while the CPU keeps ahead, as in training,
          where the previous layer's kernels hide this one's launch time; a step whose host time
          is longer than its GPU time costs its host time
  synced  each step issued onto an idle GPU and waited for: adds the CPU time the step spends
          before and between its kernels where the GPU runs out of work
"""
import statistics
import threading
import sys
import time
from typing import Dict, List, Tuple

import torch


def require_gpu(script: str):
    """Exit with a message (not an assertion from deep inside torch) where there is no CUDA GPU."""
    if not torch.cuda.is_available():
        sys.exit(f"{script} times CUDA kernels: it needs a CUDA GPU, and torch sees none here")


def _times_ms(fns, iters: int, synced: bool, block: int = 1) -> List[List[float]]:
    """Per-call times of each of fns, ms: rounds of `block` calls of each fn in turn, until each
    has iters calls. CUDA events; synced: the GPU drained before each call and the call waited
    for, else calls back to back. Without CUDA, wall-clock times (a smoke run only)."""
    rounds = -(-iters // block)
    if not torch.cuda.is_available():
        times = [[] for _ in fns]
        for _ in range(rounds):
            for fn, ts in zip(fns, times):
                for _ in range(block):
                    t0 = time.perf_counter()
                    fn()
                    ts.append(1e3 * (time.perf_counter() - t0))
        return times
    events = [[] for _ in fns]
    torch.cuda.synchronize()
    for _ in range(rounds):
        for fn, evs in zip(fns, events):
            for _ in range(block):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                if synced:
                    torch.cuda.synchronize()
                start.record()
                fn()
                end.record()
                if synced:
                    end.synchronize()
                evs.append((start, end))
    torch.cuda.synchronize()
    return [[start.elapsed_time(end) for start, end in evs] for evs in events]


def cuda_time_ms(fn, warmup: int = 10, iters: int = 40) -> float:
    """Queued median of fn(), ms."""
    for _ in range(warmup):
        fn()
    return statistics.median(_times_ms([fn], iters, synced=False)[0])


def synced_time_ms(fn, iters: int = 40) -> float:
    """Synced median of fn(), ms (call after a warm-up)."""
    return statistics.median(_times_ms([fn], iters, synced=True)[0])


def step_times_ms(fn, warmup: int = 3, iters: int = 20) -> Tuple[float, float]:
    """(queued, synced) medians of fn(), ms."""
    for _ in range(warmup):
        fn()
    return tuple(statistics.median(_times_ms([fn], iters, synced)[0]) for synced in (False, True))


def capture_graph(fn, calls: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `calls` calls of fn, captured after 3 warm-up calls on a side stream (as
    torch.cuda.graph wants). Capture fails (raises) for fn that syncs with the host or whose shapes
    depend on data."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def interleaved_medians_ms(fns, warmup: int = 10, iters: int = 40, block: int = 10) -> List[float]:
    """Queued medians of each of fns, ms, timed in turns of `block` calls back to back: where the
    host sets the pace (eager steps of small ops), its speed drifts by up to 2x between runs on a
    shared machine, and a ratio of two times taken minutes apart inherits that drift; taken in the
    same rounds, it does not. Blocks keep each fn's calls queued behind one another, as in training
    (a call that syncs the host would otherwise start the next fn's call on an idle GPU)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    return [statistics.median(ts) for ts in _times_ms(fns, iters, synced=False, block=block)]


def paired_times_ms(fn_a, fn_b, warmup: int = 3, iters: int = 20) -> Dict[str, Tuple[float, float]]:
    """(queued, synced) medians of fn_a ("a"), of fn_b ("b") and of t(a) - t(b) within each round
    ("a_minus_b"), ms, a and b alternated call by call. A difference of two separate medians moves
    with whatever drifts between them (host load, clocks: enough to turn it negative where a is
    mostly b); differences within a round cancel the drift."""
    for _ in range(warmup):
        fn_a()
        fn_b()
    medians = {"a": [], "b": [], "a_minus_b": []}
    for synced in (False, True):
        ta, tb = _times_ms([fn_a, fn_b], iters, synced)
        for key, ts in (("a", ta), ("b", tb), ("a_minus_b", [x - y for x, y in zip(ta, tb)])):
            medians[key].append(statistics.median(ts))
    return {key: tuple(v) for key, v in medians.items()}


def profile_step(fn, label: str, steps: int = 3, top: int = 14) -> float:
    """Prints the kernels of fn() (us per call, launches per call, from torch.profiler over `steps`
    calls) and the host's time to issue one call onto an idle GPU (no sync: where it exceeds the
    kernels' time, queued steps are bound by the host); returns the kernels' ms per call."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    issue_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    kernels = sorted(((e.key, e.device_time_total / steps, e.count // steps) for e in prof.key_averages()
                      if e.device_time_total > 0), key=lambda t: -t[1])
    total = sum(t for _, t, _ in kernels)
    print(f"{label}: kernel time {total / 1e3:.2f} ms/step in {sum(c for _, _, c in kernels)} launches; "
          f"CPU issue time {issue_ms:.2f} ms/step")
    for key, t, c in kernels[:top]:
        print(f"  {t:9.1f} us  x{c:<3d} {key[:110]}")
    return total / 1e3


def reset_grads(tensors):
    """Gradients to None between training steps, as zero_grad(set_to_none=True) does, over a list
    made once (a module's zero_grad walks its whole tree every call: ~0.4 ms at 64 experts)."""
    for t in tensors:
        t.grad = None


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of 2 GiB, counting bytes read plus bytes written."""
    src = torch.randn(512 * 1024 * 1024, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), 3, 10)
    return 2 * 512 * 1024 * 1024 * 4 / ms / 1e6


def thread_wakeup_us(slept_us: float = 200.0, n: int = 50) -> float:
    """Median time, us, from signalling a thread that has waited slept_us to its running again
    (Python threads, so the GIL hand-over is in it). An eager backward of CUDA tensors pays two such
    hand-offs, to autograd's device thread and back. It differs between virtual machines of the same
    kind, and it is a large part of the eager time of small steps."""
    lat = []
    for _ in range(n):
        go, woke = threading.Event(), []
        t = threading.Thread(target=lambda: (go.wait(), woke.append(time.perf_counter())))
        t.start()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < slept_us * 1e-6:  # spin, so the waiter has surely gone to sleep
            pass
        t_set = time.perf_counter()
        go.set()
        t.join()
        lat.append(1e6 * (woke[0] - t_set))
    return statistics.median(lat)
