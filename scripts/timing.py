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
import time
from typing import Tuple

import torch


def cuda_time_ms(fn, warmup: int = 10, iters: int = 40) -> float:
    """Queued median of fn(), ms."""
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    torch.cuda.synchronize()
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def synced_time_ms(fn, iters: int = 40) -> float:
    """Synced median of fn(), ms (call after a warm-up)."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def step_times_ms(fn, warmup: int = 3, iters: int = 20) -> Tuple[float, float]:
    """(queued, synced) medians of fn(), ms. Without CUDA both are the wall-clock median (a smoke
    run only)."""
    if not torch.cuda.is_available():
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times), statistics.median(times)
    return cuda_time_ms(fn, warmup, iters), synced_time_ms(fn, iters)


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
    del src, dst
    return 2 * 512 * 1024 * 1024 * 4 / ms / 1e6
