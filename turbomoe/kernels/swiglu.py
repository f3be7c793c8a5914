"""Triton SwiGLU over the output of the first expert GEMM: h [R, 2F] = [gate | up] -> a [R, F].

    a = silu(gate) * up                      (fp32 math, stored in h's dtype)
    dgate = da * up * silu'(gate),  dup = da * silu(gate),  silu'(x) = s * (1 + x * (1 - s))

One read of h and one write of a (forward), one read of h and da and one write of dh (backward):
the memory floor of the op. The backward recomputes silu, so only h is saved.
"""
import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _swiglu_fwd_kernel(h_ptr, a_ptr, F, stride_h, stride_a, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < F
    gate = tl.load(h_ptr + row * stride_h + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + row * stride_h + F + cols, mask=ok, other=0.0).to(tl.float32)
    a = gate * tl.sigmoid(gate) * up
    tl.store(a_ptr + row * stride_a + cols, a.to(a_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _swiglu_bwd_kernel(h_ptr, da_ptr, dh_ptr, F, stride_h, stride_da, stride_dh, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < F
    gate = tl.load(h_ptr + row * stride_h + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + row * stride_h + F + cols, mask=ok, other=0.0).to(tl.float32)
    da = tl.load(da_ptr + row * stride_da + cols, mask=ok, other=0.0).to(tl.float32)
    s = tl.sigmoid(gate)
    dgate = da * up * s * (1.0 + gate * (1.0 - s))
    dup = da * gate * s
    tl.store(dh_ptr + row * stride_dh + cols, dgate.to(dh_ptr.dtype.element_ty), mask=ok)
    tl.store(dh_ptr + row * stride_dh + F + cols, dup.to(dh_ptr.dtype.element_ty), mask=ok)


def swiglu_forward(h_R2F: torch.Tensor) -> torch.Tensor:
    R, F = h_R2F.shape[0], h_R2F.shape[1] // 2
    a = torch.empty(R, F, device=h_R2F.device, dtype=h_R2F.dtype)
    if R and F:
        _swiglu_fwd_kernel[(R, triton.cdiv(F, _BLOCK))](h_R2F, a, F, h_R2F.stride(0), a.stride(0), BLOCK=_BLOCK)
    return a


def swiglu_backward(h_R2F: torch.Tensor, da_RF: torch.Tensor) -> torch.Tensor:
    R, F = da_RF.shape
    dh = torch.empty_like(h_R2F)
    if R and F:
        _swiglu_bwd_kernel[(R, triton.cdiv(F, _BLOCK))](h_R2F, da_RF, dh, F, h_R2F.stride(0), da_RF.stride(0),
                                                        dh.stride(0), BLOCK=_BLOCK)
    return dh
