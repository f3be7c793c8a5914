"""Timing helpers shared by the benchmark scripts: CUDA-event medians and the copy ceiling."""
import statistics

import torch


def cuda_time_ms(fn, warmup: int = 10, iters: int = 40) -> float:
    """Median of CUDA-event timings of fn() after warm-up. The host queues every iteration without
    waiting, as in training, so a call costs its GPU time, or its host time where that is longer."""
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


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of 2 GiB, counting bytes read plus bytes written."""
    src = torch.randn(512 * 1024 * 1024, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), 3, 10)
    del src, dst
    return 2 * 512 * 1024 * 1024 * 4 / ms / 1e6
