"""SwiGLU with a hand-written backward: h [R, 2F] = [gate | up] -> s * silu(gate) * up [R, F],
s an optional fp32 row scale [R] (the routing score, applied before the second expert GEMM; its
gradient is formed in the backward kernel from da and h).

Only h (and s) are saved (the backward recomputes silu). CUDA tensors use the Triton kernels; CPU
tensors use plain PyTorch (the reference).
"""
from typing import Optional

import torch
import torch.nn.functional as F

from ..reference import compute_dtype
from . import Function, once_differentiable


def swiglu_reference(h_R2F: torch.Tensor, scale_R: Optional[torch.Tensor] = None) -> torch.Tensor:
    gate, up = h_R2F.chunk(2, dim=-1)
    if scale_R is None:
        return F.silu(gate) * up
    c = compute_dtype(h_R2F.dtype)  # scaled in fp32 (fp64 for fp64) and rounded once, as the kernel does
    return (F.silu(gate.to(c)) * up.to(c) * scale_R.to(c)[:, None]).to(h_R2F.dtype)


class SwiGLU(Function):

    @staticmethod
    def forward(h_R2F, scale_R=None):
        from ..kernels.swiglu import swiglu_forward
        return swiglu_forward(h_R2F, scale_R)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    @once_differentiable  # kernels: create_graph gives the gradient; differentiating it raises
    def backward(ctx, da_RF):
        from ..kernels.swiglu import swiglu_backward
        h_R2F, scale_R = ctx.saved_tensors
        dh, ds = swiglu_backward(h_R2F, da_RF.contiguous(), scale_R)
        return dh, None if ds is None else ds.to(scale_R.dtype)


def swiglu(h_R2F: torch.Tensor, scale_R: Optional[torch.Tensor] = None, kernels: bool = True) -> torch.Tensor:
    """s * silu(h[:, :F]) * h[:, F:] (s: scale [R], or 1); Triton on CUDA, PyTorch on the CPU or with
    kernels=False (differentiable twice: the reference experts)."""
    if h_R2F.dim() != 2 or h_R2F.shape[1] % 2:
        raise ValueError(f"swiglu needs h of shape [R, 2F], got {tuple(h_R2F.shape)}")
    if scale_R is not None and (scale_R.shape != h_R2F.shape[:1] or not scale_R.is_floating_point()
                                or scale_R.device != h_R2F.device):
        raise ValueError(f"swiglu's scale must be a float [{h_R2F.shape[0]}] on {h_R2F.device}, got "
                         f"{scale_R.dtype} {tuple(scale_R.shape)} on {scale_R.device}")
    if kernels and h_R2F.is_cuda and h_R2F.stride(1) == 1:
        if scale_R is not None:
            scale_R = scale_R.contiguous()
        if torch.compiler.is_compiling():  # a custom op: traced without a graph break (turbomoe.custom_ops)
            from .. import custom_ops
            return custom_ops.swiglu(h_R2F, scale_R)
        return SwiGLU.apply(h_R2F, scale_R)
    return swiglu_reference(h_R2F, scale_R)
