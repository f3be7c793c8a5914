"""Triton SwiGLU over the output of the first expert GEMM: h [R, 2F] = [gate | up] -> a [R, F].

    a = s * silu(gate) * up                  (fp32 math, fp64 for fp64; stored in h's dtype; s = 1, or a row's scale)
    dgate = s * da * up * silu'(gate),  dup = s * da * silu(gate),  silu'(x) = sig * (1 + x * (1 - sig))
    ds = sum over the row of da * silu(gate) * up

With a row scale (the routing score: the MoE layer weighs a row before the second GEMM, which is
linear, instead of after it) the score's gradient comes from da and h, so the second GEMM's output
need not be kept for it. One read of h and one write of a (forward), one read of h and da and one
write of dh (backward): the memory floor of the op. The backward recomputes silu, so only h is saved.
"""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .launch import acc_dtype, tl_dtype

_BLOCK = 1024


@triton.jit
def _swiglu_fwd_kernel(h_ptr, s_ptr, a_ptr, F, stride_h, stride_a, SCALED: tl.constexpr, BLOCK: tl.constexpr,
                       ACC: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < F
    gate = tl.load(h_ptr + row * stride_h + cols, mask=ok, other=0.0).to(ACC)
    up = tl.load(h_ptr + row * stride_h + F + cols, mask=ok, other=0.0).to(ACC)
    a = gate * tl.sigmoid(gate) * up
    if SCALED:
        a *= tl.load(s_ptr + row).to(ACC)
    tl.store(a_ptr + row * stride_a + cols, a.to(a_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _swiglu_bwd_block(h_ptr, da_ptr, dh_ptr, row, start, F, stride_h, stride_da, stride_dh, scale,
                      SCALED: tl.constexpr, BLOCK: tl.constexpr, ACC: tl.constexpr):
    """dh of one block of a row's columns; returns the block's terms of ds (zeros unscaled)."""
    cols = start + tl.arange(0, BLOCK)
    ok = cols < F
    gate = tl.load(h_ptr + row * stride_h + cols, mask=ok, other=0.0).to(ACC)
    up = tl.load(h_ptr + row * stride_h + F + cols, mask=ok, other=0.0).to(ACC)
    da = tl.load(da_ptr + row * stride_da + cols, mask=ok, other=0.0).to(ACC)
    sig = tl.sigmoid(gate)
    silu = gate * sig  # formed first, as the forward: da * gate overflows where silu is 0 (gate -1e30)
    ds = tl.zeros([BLOCK], ACC)
    if SCALED:
        ds = da * (silu * up)
        da = da * scale
    tl.store(dh_ptr + row * stride_dh + cols, (da * up * sig * (1.0 + gate * (1.0 - sig))).to(dh_ptr.dtype.element_ty),
             mask=ok)
    tl.store(dh_ptr + row * stride_dh + F + cols, (da * silu).to(dh_ptr.dtype.element_ty), mask=ok)
    return ds


@triton.jit
def _swiglu_bwd_kernel(h_ptr, da_ptr, s_ptr, dh_ptr, ds_ptr, F, stride_h, stride_da, stride_dh,
                       SCALED: tl.constexpr, BLOCK: tl.constexpr, ACC: tl.constexpr):
    """Unscaled: a program a row's block of columns. Scaled: a program a row, over its blocks in
    order (the score's gradient sums the row in one fixed order: deterministic, no atomics)."""
    row = tl.program_id(0).to(tl.int64)
    if SCALED:
        scale = tl.load(s_ptr + row).to(ACC)
        ds = tl.zeros([BLOCK], ACC)
        for start in range(0, F, BLOCK):
            ds += _swiglu_bwd_block(h_ptr, da_ptr, dh_ptr, row, start, F, stride_h, stride_da, stride_dh, scale,
                                    SCALED, BLOCK, ACC)
        tl.store(ds_ptr + row, tl.sum(ds, axis=0))
    else:
        _swiglu_bwd_block(h_ptr, da_ptr, dh_ptr, row, tl.program_id(1) * BLOCK, F, stride_h, stride_da, stride_dh,
                          1.0, SCALED, BLOCK, ACC)


def swiglu_forward(h_R2F: torch.Tensor, scale_R: Optional[torch.Tensor] = None) -> torch.Tensor:
    R, F = h_R2F.shape[0], h_R2F.shape[1] // 2
    a = torch.empty(R, F, device=h_R2F.device, dtype=h_R2F.dtype)
    if R and F:
        _swiglu_fwd_kernel[(R, triton.cdiv(F, _BLOCK))](h_R2F, h_R2F if scale_R is None else scale_R, a, F,
                                                        h_R2F.stride(0), a.stride(0), SCALED=scale_R is not None,
                                                        BLOCK=_BLOCK, ACC=tl_dtype(acc_dtype(h_R2F.dtype)))
    return a


def swiglu_backward(h_R2F: torch.Tensor, da_RF: torch.Tensor,
                    scale_R: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(dh, ds): ds [R] fp32 (fp64 for fp64 h) where a row scale was given, else None."""
    R, F = da_RF.shape
    acc = acc_dtype(h_R2F.dtype)
    dh = torch.empty_like(h_R2F)
    ds = None if scale_R is None else torch.zeros(R, device=h_R2F.device, dtype=acc)
    if R and F:
        grid = (R, 1 if scale_R is not None else triton.cdiv(F, _BLOCK))
        _swiglu_bwd_kernel[grid](h_R2F, da_RF, h_R2F if scale_R is None else scale_R, dh, dh if ds is None else ds,
                                 F, h_R2F.stride(0), da_RF.stride(0), dh.stride(0), SCALED=scale_R is not None,
                                 BLOCK=_BLOCK, ACC=tl_dtype(acc))
    return dh, ds
