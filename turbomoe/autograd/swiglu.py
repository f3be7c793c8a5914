"""SwiGLU with a hand-written backward: h [R, 2F] = [gate | up] -> silu(gate) * up [R, F].

Only h is saved (the backward recomputes silu). CUDA tensors use the Triton kernels; CPU tensors
use plain PyTorch (the reference).
"""
import torch
import torch.nn.functional as F


def swiglu_reference(h_R2F: torch.Tensor) -> torch.Tensor:
    gate, up = h_R2F.chunk(2, dim=-1)
    return F.silu(gate) * up


class SwiGLU(torch.autograd.Function):

    @staticmethod
    def forward(ctx, h_R2F):
        from ..kernels.swiglu import swiglu_forward
        ctx.save_for_backward(h_R2F)
        return swiglu_forward(h_R2F)

    @staticmethod
    def backward(ctx, da_RF):
        from ..kernels.swiglu import swiglu_backward
        (h_R2F,) = ctx.saved_tensors
        return swiglu_backward(h_R2F, da_RF.contiguous())


def swiglu(h_R2F: torch.Tensor) -> torch.Tensor:
    """silu(h[:, :F]) * h[:, F:]; Triton on CUDA, PyTorch on the CPU."""
    if h_R2F.dim() != 2 or h_R2F.shape[1] % 2:
        raise ValueError(f"swiglu needs h of shape [R, 2F], got {tuple(h_R2F.shape)}")
    if h_R2F.is_cuda and h_R2F.stride(1) == 1:
        if torch.compiler.is_compiling():  # a custom op: traced without a graph break (turbomoe.custom_ops)
            from .. import custom_ops
            return custom_ops.swiglu(h_R2F)
        return SwiGLU.apply(h_R2F)
    return swiglu_reference(h_R2F)
