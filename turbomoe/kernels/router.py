"""The router's logits x [S, M] @ w [E, M]^T as kernels: at decode a GEMV for a few tokens, and in
training fp32 logits from bf16 tokens with their gradients (the section below the decode kernels).

At decode the router is a read of w (E * M, 160-512 KB at the decode layers' shapes) that BLAS runs
as a split-K GEMV plus a reduction kernel: two launches, 4.8-6.5 us on the H100 for ~2 us of
reads (notes/inference.md). Here a program owns one logit (an expert, a token) and reads K in tiles
of up to 8192 elements (at the decode shapes all of a row's loads in flight at once: programs that
looped over K tiles for 8 tokens each took 5.3 us at Scout's T = 16, one-tile programs 2.3 at T = 1),
products in fp32 on the CUDA cores, reduced once at the end: one launch, a fixed summation order
(deterministic), rounded to x's dtype as F.linear rounds. The tokens' rows and w's rows are re-read
by E and T programs, from L2, so from tens of tokens router_logit_parts takes over: a program a
16-token tile, up to 32 experts and one 128-wide K slice through the tensor cores, its fp32 partial
sums left for the Triton index_shuffling to add in order as it loads them (one launch, and no
reduction kernel: 1.8-3.5 us at Scout's T = 32-256 and Qwen3's T = 16-64, H100).
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from ..reference import as_contiguous
from .launch import acc_dtype, chain_launch, chain_wait, next_pow2, sm_count, tl_dtype


@triton.jit(do_not_specialize=["K"])
def _router_kernel(x_ptr, w_ptr, out_ptr, K, stride_xt, stride_we, stride_ot, ACC: tl.constexpr,
                   BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    chain_wait(PDL)
    e = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1).to(tl.int64)
    acc = tl.zeros((BLOCK_K, ), dtype=ACC)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + t * stride_xt + ks, mask=k_ok, other=0.0)
        w = tl.load(w_ptr + e * stride_we + ks, mask=k_ok, other=0.0)
        acc += x.to(ACC) * w.to(ACC)
    tl.store(out_ptr + t * stride_ot + e, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["T", "E", "K"])
def _router_parts_kernel(x_ptr, w_ptr, out_ptr, T, E, K, stride_xt, stride_we, stride_os, stride_ot,
                         BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    chain_wait(PDL)
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    exps = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    ks = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    t_ok = toks < T
    e_ok = exps < E
    k_ok = ks < K
    x = tl.load(x_ptr + toks[:, None].to(tl.int64) * stride_xt + ks[None, :], mask=t_ok[:, None] & k_ok[None, :],
                other=0.0)
    w = tl.load(w_ptr + exps[:, None].to(tl.int64) * stride_we + ks[None, :], mask=e_ok[:, None] & k_ok[None, :],
                other=0.0)
    tl.store(out_ptr + tl.program_id(2).to(tl.int64) * stride_os + toks[:, None].to(tl.int64) * stride_ot
             + exps[None, :], tl.dot(x, tl.trans(w)), mask=t_ok[:, None] & e_ok[None, :])


PARTS_BLOCK_K = 128  # H100, bf16 (notes/inference.md): 128-K slices beat 256 and 512 at both decode layers


def router_logit_parts(x_TM: torch.Tensor, w_EM: torch.Tensor) -> torch.Tensor:
    """fp32 [S, T, E] partial sums of x @ w^T over S slices of K (PARTS_BLOCK_K each), every slice a
    program of 16 tokens x up to 32 experts through the tensor cores, all loads in flight at once:
    the router in one launch for tens to hundreds of tokens (F.linear takes two: a split-K GEMV and
    its reduction). The Triton index_shuffling sums them in order (parts_dtype), so nothing else
    runs between. 16-bit x and w (fp32 would go through TF32)."""
    if x_TM.dim() != 2 or w_EM.dim() != 2 or x_TM.shape[1] != w_EM.shape[1]:
        raise ValueError(f"x [T, M] and w [E, M] expected, got {tuple(x_TM.shape)} and {tuple(w_EM.shape)}")
    if x_TM.dtype != w_EM.dtype or x_TM.dtype not in (torch.bfloat16, torch.float16) or x_TM.device != w_EM.device:
        raise ValueError(f"x and w must be bf16 or fp16 on one device, got {x_TM.dtype} on {x_TM.device} and "
                         f"{w_EM.dtype} on {w_EM.device}")
    x_TM, w_EM = x_TM.contiguous(), w_EM.contiguous()
    (T, K), E = x_TM.shape, w_EM.shape[0]
    S = max(1, triton.cdiv(K, PARTS_BLOCK_K))
    out = torch.empty(S, T, E, device=x_TM.device, dtype=torch.float32)
    if T == 0 or E == 0:
        return out
    if K == 0:
        return out.zero_()
    block_e = min(32, max(16, next_pow2(E)))
    _router_parts_kernel[(triton.cdiv(T, 16), triton.cdiv(E, block_e), S)](
        x_TM, w_EM, out, T, E, K, x_TM.stride(0), w_EM.stride(0), out.stride(0), out.stride(1), BLOCK_T=16,
        BLOCK_E=block_e, BLOCK_K=PARTS_BLOCK_K, num_warps=4, num_stages=1, **chain_launch(x_TM.device))
    return out


def router_logits(x_TM: torch.Tensor, w_EM: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) [T, E] in x's dtype, summed in fp32 (fp64 for fp64 inputs)."""
    if x_TM.dim() != 2 or w_EM.dim() != 2 or x_TM.shape[1] != w_EM.shape[1]:
        raise ValueError(f"x [T, M] and w [E, M] expected, got {tuple(x_TM.shape)} and {tuple(w_EM.shape)}")
    if x_TM.dtype != w_EM.dtype or x_TM.device != w_EM.device:
        raise ValueError(f"x and w must share dtype and device, got {x_TM.dtype} on {x_TM.device} and "
                         f"{w_EM.dtype} on {w_EM.device}")
    x_TM, w_EM = x_TM.contiguous(), w_EM.contiguous()
    (T, K), E = x_TM.shape, w_EM.shape[0]
    out = torch.empty(T, E, device=x_TM.device, dtype=x_TM.dtype)
    if T == 0 or E == 0:
        return out
    if K == 0:
        return out.zero_()
    _router_kernel[(E, T)](x_TM, w_EM, out, K, x_TM.stride(0), w_EM.stride(0), out.stride(0),
                           ACC=tl_dtype(acc_dtype(x_TM.dtype)), BLOCK_K=max(16, min(next_pow2(K), 8192)), num_warps=4,
                           num_stages=2, **chain_launch(x_TM.device))
    return out


# ------------------------------------------------------------ fp32 router logits in training
# logits [S, E] fp32 = x [S, M] bf16 @ w [E, M]^T (w fp32 or bf16) and its two gradients, each one
# launch (the weight gradient's split sums: one more), on bf16 tensor cores with fp32 sums: an fp32
# operand is split in registers into three bf16 terms (reference.bf16_terms), so every product is
# exact in fp32, as in the fp32 GEMM of DeepSpeed's and Megatron's routers. Products of two second-
# or-lower terms (g1 w1 aside) fall below 2^-24 of the leading one and are left out, as the
# reference does. Built as kernels for the host's sake: cuBLAS and the split's PyTorch glue took ~15
# launches and ~20 Python ops a forward + backward, most of a drop-in layer's host time
# (notes/deepspeed.md, 2026-11-28).


@triton.jit
def _to_bf16(v, F32: tl.constexpr):
    """v rounded to the nearest-even bf16: the GPU's own cast (cvt.rn); off the GPU on the bits, as
    torch's cast rounds (the interpreter's own fp32 -> bf16 cast truncates); NaN stays NaN, inf inf."""
    if F32:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        bits = tl.where(v != v, 0x7FC00000, bits)
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    return v.to(tl.bfloat16)


@triton.jit
def _split3(v, F32: tl.constexpr):
    """reference.bf16_terms of an fp32 tile: three bf16 tiles whose fp32 sum is v (normal range)."""
    t0 = _to_bf16(v, F32)
    r = v - t0.to(tl.float32)  # exact: a value minus its own rounding
    t1 = _to_bf16(r, F32)
    return t0, t1, _to_bf16(r - t1.to(tl.float32), F32)


@triton.jit
def _dot(a, b, acc, F32: tl.constexpr):
    """acc + a @ b of bf16 tiles; F32 off the GPU, where the interpreter's bf16 tl.dot is wrong: the
    same exact products of the same values, in fp32."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _span(start, BLOCK: tl.constexpr, end):
    """Indices start + [0, BLOCK) and which of them are below end."""
    ids = start + tl.arange(0, BLOCK)
    return ids, ids < end


@triton.jit
def _tile(ptr, rows, cols, stride_r, r_ok, c_ok):
    """ptr[rows, cols] (rows stride_r apart, columns contiguous), zero outside r_ok x c_ok."""
    return tl.load(ptr + rows[:, None] * stride_r + cols[None, :], mask=r_ok[:, None] & c_ok[None, :], other=0.0)


@triton.jit(do_not_specialize=["S"])
def _split_logits_kernel(x_ptr, w_ptr, out_ptr, S, M, E, stride_xs, stride_we, W_SPLIT: tl.constexpr,
                         BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, F32: tl.constexpr):
    rows, r_ok = _span(tl.program_id(0).to(tl.int64) * BLOCK_S, BLOCK_S, S)
    exps, e_ok = _span(tl.program_id(1) * BLOCK_E, BLOCK_E, E)
    # w's leading terms and its lower ones summed apart, as the spec's separate GEMMs: the small
    # products are not rounded against the large running sum (the tensor cores' fp32 sums drop low bits)
    acc = tl.zeros((BLOCK_S, BLOCK_E), dtype=tl.float32)
    low = tl.zeros((BLOCK_S, BLOCK_E), dtype=tl.float32)
    for k0 in range(0, M, BLOCK_K):
        ks, k_ok = _span(k0, BLOCK_K, M)
        x = _tile(x_ptr, rows, ks, stride_xs, r_ok, k_ok)
        w = _tile(w_ptr, exps, ks, stride_we, e_ok, k_ok)
        if W_SPLIT:
            w0, w1, w2 = _split3(w, F32)
            acc = _dot(x, tl.trans(w0), acc, F32)
            low = _dot(x, tl.trans(w1), low, F32)
            low = _dot(x, tl.trans(w2), low, F32)
        else:
            acc = _dot(x, tl.trans(w), acc, F32)
    tl.store(out_ptr + rows[:, None] * E + exps[None, :], acc + low, mask=r_ok[:, None] & e_ok[None, :])


@triton.jit(do_not_specialize=["S"])
def _split_grad_x_kernel(g_ptr, w_ptr, add_ptr, gx_ptr, S, M, E, stride_we, stride_xs, W_SPLIT: tl.constexpr,
                         ADD: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                         F32: tl.constexpr):
    rows, r_ok = _span(tl.program_id(0).to(tl.int64) * BLOCK_S, BLOCK_S, S)
    cols, c_ok = _span(tl.program_id(1) * BLOCK_M, BLOCK_M, M)
    acc = tl.zeros((BLOCK_S, BLOCK_M), dtype=tl.float32)
    for e0 in range(0, E, BLOCK_E):
        es, e_ok = _span(e0, BLOCK_E, E)
        g = _tile(g_ptr, rows, es, E, r_ok, e_ok)
        w = _tile(w_ptr, es, cols, stride_we, e_ok, c_ok)
        g0, g1, g2 = _split3(g, F32)
        if W_SPLIT:
            w0, w1, w2 = _split3(w, F32)
            acc = _dot(g0, w0, acc, F32)
            acc = _dot(g1, w0, acc, F32)
            acc = _dot(g0, w1, acc, F32)
            acc = _dot(g2, w0, acc, F32)
            acc = _dot(g1, w1, acc, F32)
            acc = _dot(g0, w2, acc, F32)
        else:
            acc = _dot(g0, w, acc, F32)
            acc = _dot(g1, w, acc, F32)
            acc = _dot(g2, w, acc, F32)
    if ADD:  # x's other gradient, added in fp32 before the one rounding
        acc += _tile(add_ptr, rows, cols, stride_xs, r_ok, c_ok).to(tl.float32)
    tl.store(gx_ptr + rows[:, None] * stride_xs + cols[None, :], _to_bf16(acc, F32),
             mask=r_ok[:, None] & c_ok[None, :])


@triton.jit(do_not_specialize=["S", "rows_per_split"])
def _split_grad_w_kernel(g_ptr, x_ptr, part_ptr, S, M, E, rows_per_split, stride_xs, BLOCK_E: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, F32: tl.constexpr):
    es, e_ok = _span(tl.program_id(0) * BLOCK_E, BLOCK_E, E)
    cols, c_ok = _span(tl.program_id(1) * BLOCK_M, BLOCK_M, M)
    split = tl.program_id(2).to(tl.int64)
    start = split * rows_per_split
    end = tl.minimum(start + rows_per_split, S)
    acc = tl.zeros((BLOCK_E, BLOCK_M), dtype=tl.float32)
    for s0 in range(start, end, BLOCK_S):
        rows, r_ok = _span(s0, BLOCK_S, end)
        g = tl.load(g_ptr + rows[None, :] * E + es[:, None], mask=e_ok[:, None] & r_ok[None, :], other=0.0)  # g^T
        x = _tile(x_ptr, rows, cols, stride_xs, r_ok, c_ok)
        g0, g1, g2 = _split3(g, F32)
        acc = _dot(g0, x, acc, F32)
        acc = _dot(g1, x, acc, F32)
        acc = _dot(g2, x, acc, F32)
    tl.store(part_ptr + split * E * M + es[:, None] * M + cols[None, :], acc, mask=e_ok[:, None] & c_ok[None, :])


@triton.jit
def _bf16_terms_kernel(t_ptr, out_ptr, rows, N, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, F32: tl.constexpr):
    r, r_ok = _span(tl.program_id(0).to(tl.int64) * BLOCK_R, BLOCK_R, rows)
    c, c_ok = _span(tl.program_id(1) * BLOCK_N, BLOCK_N, N)
    t0, t1, t2 = _split3(_tile(t_ptr, r, c, N, r_ok, c_ok), F32)
    base = out_ptr + r[:, None] * (3 * N) + c[None, :]
    ok = r_ok[:, None] & c_ok[None, :]
    tl.store(base, t0, mask=ok)
    tl.store(base + N, t1, mask=ok)
    tl.store(base + 2 * N, t2, mask=ok)


def bf16_terms(t32: torch.Tensor) -> torch.Tensor:
    """reference.bf16_terms of an fp32 [..., N] in one launch (the PyTorch form takes six): [..., 3, N]
    bf16, the same bits (NaN's payload aside) where |t| >= 2^-102 or t is 0 or not finite; below, a
    remainder under fp32's smallest normal may flush to zero where the device flushes subnormals.
    For the split's cuBLAS form above SPLIT_KERNEL_MAX_EXPERTS (autograd.router)."""
    from ..reference import BF16_TERMS
    if t32.dtype != torch.float32:
        raise ValueError(f"bf16_terms takes fp32, got {t32.dtype}")
    t32 = t32.contiguous()
    N = t32.shape[-1]
    rows = t32.numel() // N if N else 0
    out = torch.empty((*t32.shape[:-1], BF16_TERMS, N), dtype=torch.bfloat16, device=t32.device)
    if rows == 0:
        return out
    block_n = min(1024, max(16, next_pow2(N)))
    block_r = 2048 // block_n  # 2048 values a program: a few tokens' logit gradients, or part of a weight row
    _bf16_terms_kernel[(triton.cdiv(rows, block_r), triton.cdiv(N, block_n))](
        t32, out, rows, N, BLOCK_R=block_r, BLOCK_N=block_n, F32=not t32.is_cuda, num_warps=4)
    return out


# Up to this many experts the kernels take 0.3-0.4 ms less host time a forward + backward than
# cuBLAS's GEMMs with the split's glue, and about the same GPU time or less (H100, 2026-11-28:
# kernels / cuBLAS us, before the GPU's own bf16 cast cut the kernels' time by 6-19% more: 47 / 39
# at S 4096, M 2048, E 8; 73 / 64 at 8192, 2048, 8; 213 / 194 at 16384, 4096, 16; 173 / 177 at
# 65536, 768, 16). At E = 64 and 128 the best tiles of a sweep took 1.4-1.5x cuBLAS's GPU time,
# so autograd.router takes reference.split_* there (their operands split by bf16_terms below).
SPLIT_KERNEL_MAX_EXPERTS = 16


def _rows_last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _split_checks(x_SM: torch.Tensor, w_EM: torch.Tensor):
    if x_SM.dtype != torch.bfloat16 or w_EM.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"the router split takes bf16 x and a bf16 or fp32 w, got {x_SM.dtype} and {w_EM.dtype}")
    if x_SM.dim() != 2 or w_EM.dim() != 2 or x_SM.shape[1] != w_EM.shape[1]:
        raise ValueError(f"x [S, M] and w [E, M] expected, got {tuple(x_SM.shape)} and {tuple(w_EM.shape)}")


def split_logits(x_SM: torch.Tensor, w_EM: torch.Tensor) -> torch.Tensor:
    """x [S, M] bf16 @ w [E, M]^T (w bf16 or fp32) -> [S, E] fp32, products exact, fp32 sums: one launch
    (spec: reference.split_logits)."""
    _split_checks(x_SM, w_EM)
    (S, M), E = x_SM.shape, w_EM.shape[0]
    out = torch.empty((S, E), dtype=torch.float32, device=x_SM.device)
    if S == 0 or E == 0:
        return out
    if M == 0:
        return out.zero_()
    x_SM, w_EM = _rows_last_contiguous(x_SM), _rows_last_contiguous(w_EM)
    block_e = min(128, max(16, next_pow2(E)))
    n_e = triton.cdiv(E, block_e)
    # Tiles from an H100 sweep (notes/deepspeed.md, 2026-11-28): 128 tokens where that still gives
    # half the SMs a program, 8 warps and 64-wide K tiles for the widest expert tiles.
    block_s = 128 if triton.cdiv(S, 128) * n_e * 2 >= sm_count(x_SM.device) else 64
    _split_logits_kernel[(triton.cdiv(S, block_s), n_e)](
        x_SM, w_EM, out, S, M, E, x_SM.stride(0), w_EM.stride(0), W_SPLIT=w_EM.dtype == torch.float32,
        BLOCK_S=block_s, BLOCK_E=block_e, BLOCK_K=64 if block_e >= 128 else 128, F32=not x_SM.is_cuda,
        num_warps=8 if block_e >= 64 else 4, num_stages=3)
    return out


def split_grads(g_SE: torch.Tensor, x_SM: torch.Tensor, w_EM: torch.Tensor, need_x: bool = True, need_w: bool = True,
                gx_add: Optional[torch.Tensor] = None):
    """The gradients of split_logits for an fp32 g [S, E]: (g @ w [S, M] bf16, + gx_add [S, M] where
    given, g^T @ x [E, M] in w's dtype), None where not needed; one launch each, the weight's plus a
    sum of its split parts in a fixed order (spec: reference.split_grads)."""
    _split_checks(x_SM, w_EM)
    (S, M), E = x_SM.shape, w_EM.shape[0]
    g_SE = as_contiguous(g_SE, torch.float32)  # no dispatcher calls where it already is
    x_SM, w_EM = _rows_last_contiguous(x_SM), _rows_last_contiguous(w_EM)
    gx = gw = None
    if need_x:
        gx = torch.empty((S, M), dtype=torch.bfloat16, device=x_SM.device)
        gx_add = as_contiguous(gx_add, torch.bfloat16)  # its stride is gx's
        if S and M:
            wide = E >= 64
            _split_grad_x_kernel[(triton.cdiv(S, 128), triton.cdiv(M, 128))](
                g_SE, w_EM, gx if gx_add is None else gx_add, gx, S, M, E, w_EM.stride(0), gx.stride(0),
                W_SPLIT=w_EM.dtype == torch.float32, ADD=gx_add is not None, BLOCK_S=128, BLOCK_M=128, BLOCK_E=16,
                F32=not x_SM.is_cuda, num_warps=8 if wide else 4, num_stages=2 if wide else 1)
            # E = 0: the loop adds nothing, the store writes the zeros
    if need_w:
        block_e, block_m, block_s = min(64, max(16, next_pow2(E))), 256, 32
        n_e, n_m = triton.cdiv(E, block_e), triton.cdiv(M, block_m)
        # Split the token sum until the programs fill the SMs twice; parts summed in order after.
        splits = max(1, min(triton.cdiv(S, 4 * block_s), 2 * sm_count(x_SM.device) // max(1, n_e * n_m)))
        rows_per_split = triton.cdiv(triton.cdiv(S, splits), block_s) * block_s if S else block_s
        splits = max(1, triton.cdiv(S, rows_per_split))
        part = torch.empty((splits, E, M), dtype=torch.float32, device=x_SM.device)
        if E and M:
            _split_grad_w_kernel[(n_e, n_m, splits)](
                g_SE, x_SM, part, S, M, E, rows_per_split, x_SM.stride(0), BLOCK_E=block_e, BLOCK_M=block_m,
                BLOCK_S=block_s, F32=not x_SM.is_cuda, num_warps=4, num_stages=3)
        gw = (part[0] if splits == 1 else part.sum(0)).to(w_EM.dtype)
    return gx, gw
