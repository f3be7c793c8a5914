"""Small helpers shared by the kernel launchers: block sizes and dtype mapping."""
import functools

import torch
import triton
import triton.language as tl

from ..reference import compute_dtype as acc_dtype  # noqa: F401 (re-exported for the launchers)

_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32, torch.float64: tl.float64}


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def tl_dtype(dtype: torch.dtype):
    return _TL[dtype]


def sm_count(device: torch.device) -> int:
    """The device's SMs; 4 off the GPU (the interpreter: a few programs still exercise the tiling)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


@functools.lru_cache(maxsize=None)
def compute_capability(device_index: int) -> int:
    """The GPU's compute capability as one int (90: sm_90)."""
    major, minor = torch.cuda.get_device_capability(device_index)
    return 10 * major + minor


@functools.lru_cache(maxsize=None)
def max_shared_mem(device_index: int) -> int:
    """Bytes of shared memory a program may use on that GPU (the opt-in limit)."""
    return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]
