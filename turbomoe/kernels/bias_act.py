"""Triton bias + activation over rows in groups: y [R, N], b [G, N] -> act(y + b[g(r)]) [R, N].

    g(r) = groups[r]              the dropless rows (row_groups of the counts), or
    g(r) = (r // C) % G           the capacity buffer [.., G, C, N] seen as rows;
    a row whose group is >= G (unrouted rows past the counts) is zero out and its gradient zero: a
    grouped GEMM leaves such rows unspecified (any bits, NaN too), and the bias's gradient (a one-hot
    GEMM over all rows) would take 0 x NaN from them.

    act  none | gelu_tanh (Megatron's fused bias-GELU) | gelu (erf)
    gelu_tanh(z) = z sig(2u), u = sqrt(2/pi) (z + 0.044715 z^3)     (0.5 (1 + tanh u) = sig(2u))
        d/dz     = sig(2u) + z sig(2u) (1 - sig(2u)) 2 sqrt(2/pi) (1 + 3 * 0.044715 z^2)
    gelu(z)      = z Phi(z),   d/dz = Phi(z) + z phi(z)

fp32 math, one rounding to y's dtype. Forward: one read of y, one write; backward: one read of y and
of the output's gradient, one write of z's (the gradient of y, and per group of b): the memory floor.
With act none the backward only zeroes the rows past the groups (one read, one write).
The bias gradient, a sum over each group's rows, is the caller's (autograd/bias_act.py).
"""
import torch
import triton
import triton.language as tl

ACTS = ("none", "gelu_tanh", "gelu")
_BLOCK = 1024


@triton.jit
def _tanh_sig(z):
    """sig(2u) = 0.5 (1 + tanh u), u = sqrt(2/pi) (z + 0.044715 z^3): no overflow at large |z|."""
    return tl.sigmoid(1.5957691216057308 * (z + 0.044715 * z * z * z))


@triton.jit
def _normal_cdf(z):
    return 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))


@triton.jit
def _group(g_ptr, row, cols, G, rows_per_group, HAS_GROUPS: tl.constexpr):
    """g(row), >= G past the groups, and in_group: g < G broadcast to the block (the interpreter takes
    no scalar in a mask)."""
    if HAS_GROUPS:
        g = tl.load(g_ptr + row).to(tl.int64)
    else:
        g = (row // rows_per_group) % G
    return g, cols * 0 + g < G


@triton.jit
def _biased_row(y_ptr, b_ptr, g, in_group, row, cols, ok, N):
    """z = y[row, cols] + b[g, cols] in fp32."""
    y = tl.load(y_ptr + row * N + cols, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + g * N + cols, mask=ok & in_group, other=0.0).to(tl.float32)  # g >= G: no bias
    return y + b


@triton.jit
def _bias_act_fwd_kernel(y_ptr, b_ptr, g_ptr, out_ptr, N, G, rows_per_group,
                         HAS_GROUPS: tl.constexpr, ACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    g, in_group = _group(g_ptr, row, cols, G, rows_per_group, HAS_GROUPS)
    z = _biased_row(y_ptr, b_ptr, g, in_group, row, cols, ok, N)
    if ACT == "gelu_tanh":
        z = z * _tanh_sig(z)
    elif ACT == "gelu":
        z = z * _normal_cdf(z)
    tl.store(out_ptr + row * N + cols, tl.where(in_group, z, 0.0).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _bias_act_bwd_kernel(y_ptr, b_ptr, g_ptr, dout_ptr, dz_ptr, N, G, rows_per_group,
                         HAS_GROUPS: tl.constexpr, ACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    g, in_group = _group(g_ptr, row, cols, G, rows_per_group, HAS_GROUPS)
    dout = tl.load(dout_ptr + row * N + cols, mask=ok, other=0.0).to(tl.float32)
    if ACT == "none":  # (y_ptr is dout's: not read)
        dz = dout
    else:
        z = _biased_row(y_ptr, b_ptr, g, in_group, row, cols, ok, N)
        if ACT == "gelu_tanh":  # 2 sqrt(2/pi) = 1.5957691216057308, 3 * 0.044715 = 0.134145
            s = _tanh_sig(z)
            grad = s + z * s * (1.0 - s) * 1.5957691216057308 * (1.0 + 0.134145 * z * z)
        else:  # 1 / sqrt(2 pi) = 0.3989422804014327
            grad = _normal_cdf(z) + z * 0.3989422804014327 * tl.exp(-0.5 * z * z)
        dz = dout * grad
    tl.store(dz_ptr + row * N + cols, tl.where(in_group, dz, 0.0).to(dz_ptr.dtype.element_ty), mask=ok)


def _launch(kernel, y_RN, b_GN, groups_R, rows_per_group, act, *tensors):
    R, N = y_RN.shape
    if R and N:
        kernel[(R, triton.cdiv(N, _BLOCK))](y_RN, b_GN, y_RN if groups_R is None else groups_R, *tensors, N,
                                            b_GN.shape[0], rows_per_group or 1, HAS_GROUPS=groups_R is not None,
                                            ACT=act, BLOCK=_BLOCK)


def bias_act_forward(y_RN: torch.Tensor, b_GN: torch.Tensor, groups_R, rows_per_group, act: str) -> torch.Tensor:
    """act(y + b[g(r)]); y and b contiguous, groups_R [R] int (or None with rows_per_group)."""
    out = torch.empty_like(y_RN)
    _launch(_bias_act_fwd_kernel, y_RN, b_GN, groups_R, rows_per_group, act, out)
    return out


def bias_act_backward(y_RN: torch.Tensor, b_GN: torch.Tensor, groups_R, rows_per_group, act: str,
                      dout_RN: torch.Tensor) -> torch.Tensor:
    """The gradient of z = y + b[g(r)], in y's dtype, zero past the groups; y is None with act none
    (dout's dtype then)."""
    y_RN = dout_RN if y_RN is None else y_RN
    dz = torch.empty_like(y_RN)
    _launch(_bias_act_bwd_kernel, y_RN, b_GN, groups_R, rows_per_group, act, dout_RN, dz)
    return dz
