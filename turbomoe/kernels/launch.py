"""Small helpers shared by the kernel launchers: block sizes, dtype mapping, device properties and
the decode chain's dependent launches."""
import contextlib
import functools
import os

import torch
import triton
import triton.language as tl

from ..reference import compute_dtype as acc_dtype  # noqa: F401 (re-exported for the launchers)

_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32, torch.float64: tl.float64}


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def tl_dtype(dtype: torch.dtype):
    return _TL[dtype]


def on_device(device: torch.device):
    """A CUDA device made current inside (Triton launches on the current device whatever device its
    tensors are on, and CUDA graphs capture there); nothing for other devices."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


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


# Programmatic dependent launch (Hopper+): a kernel of the decode chain (router -> shuffle -> the
# few-rows GEMMs -> combine) is scheduled while its producer still runs and waits on the device for
# it, which hides a launch's latency at each link (a decode layer is a few microseconds of work per
# kernel). TURBOMOE_PDL=0 turns it off.
PDL = os.environ.get("TURBOMOE_PDL", "1") != "0"


@functools.lru_cache(maxsize=None)
def _pdl_ok(device_index: int) -> bool:
    from triton.backends.nvidia.compiler import CUDAOptions
    return compute_capability(device_index) >= 90 and "launch_pdl" in CUDAOptions.__dataclass_fields__


def chain_launch(device: torch.device) -> dict:
    """Launch arguments of a chain kernel: its PDL constexpr, and launch_pdl where the GPU has it."""
    on = PDL and device.type == "cuda" and _pdl_ok(device.index if device.index is not None else 0)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def chain_wait(PDL: tl.constexpr):
    """First in every program of a chain kernel: wait for the producer kernel (and so, transitively,
    every earlier one) to finish and flush, then let the consumer be scheduled. Waiting before any
    early exit keeps the chain ordered: a kernel finishes only after its producer has."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
