"""Triton kernels of the decode experts: few rows per expert, counts read on the device.

    up       h [S1, R, 2F] fp32  partial sums over S1 slices of K of  x[token(r)] (* score) @ w1[g]
    down     y [S2, R, M]  fp32  partial sums over S2 slices of F of  silu(h_gate) * h_up @ w2[g],
                                 h = sum_s h[s], the SwiGLU rounded to the weights' dtype
    combine  out [T, M]          out[t] = sum_j w[t, j] * sum_s y[s, slots[t, j]]  (fp32, x's dtype)

Rows are grouped as in turbomoe.kernels.grouped_gemm (group g owns rows offset_g .. offset_g +
counts[g]). Each kernel reads its producer's output as it is, so the experts are three launches after
the shuffle, not six (push_rows, two GEMMs, two split-K sums, pull_rows): the row gather is folded into
the first GEMM (row r reads x at token row_routes[r] // k', times its score with prescale), the first
GEMM's split sums and SwiGLU into the second's operand load, the second's split sums into the
combine. Splits are summed in a fixed order: deterministic, no atomics.

Why kernels beside the persistent grouped GEMM: at decode a group holds 1 to 64 rows, so the step is a
read of the selected experts' weights. Program axis 1 walks only the experts with rows (the u-th
nonzero count, found in the kernel), so the grid holds no idle expert programs and only those
experts' weights are read (selective loading); K is split until every SM has programs. Fewer than 16
rows multiply on the CUDA cores (products kept per element, reduced once at the end), more through
tl.dot. No launch depends on the counts' values: CUDA-graph capturable. Rows past sum(counts) are
neither read nor written.
"""
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .launch import next_pow2, sm_count

# The first GEMM's (fill, max_split) for few_rows_tiles: every program of the second GEMM re-reads
# the first's K slices (its SwiGLU operand), so the first splits less (tuned with both GEMMs in the
# layer: 4-19% faster than 8x the SMs and 16 slices at T = 1-8, notes/inference.md).
UP_SPLITS = (2, 4)


@triton.jit(do_not_specialize=["R", "K", "N", "G", "k_per_split", "n_splits", "in_splits", "routes_per_token"])
def _few_rows_mm_kernel(x_ptr, row_routes_ptr, scale_ptr, w_ptr, out_ptr, counts_ptr,
                        R, K, N, G, k_per_split, n_splits, in_splits, routes_per_token,
                        stride_xs, stride_xr, stride_wg, stride_wk, stride_os, stride_or,
                        GATHER: tl.constexpr, SCALE: tl.constexpr, PRECISION: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_G: tl.constexpr):
    """GATHER: a = x [T, K] rows row_routes[r] // routes_per_token (* scale[row_routes[r]]); else
    a = SwiGLU of the sum over in_splits of x [in_splits, R, 2K] (gate then up). out: [n_splits, R, N]."""
    pid_n = tl.program_id(0)
    u = tl.program_id(1)
    pid_m = tl.program_id(2) // n_splits
    split = tl.program_id(2) % n_splits
    gs = tl.arange(0, BLOCK_G)
    counts = tl.load(counts_ptr + gs, mask=gs < G, other=0)
    nz = counts > 0
    hit = nz & (tl.cumsum(nz.to(tl.int32), axis=0) == u + 1)  # this program's group: the u-th with rows
    m = tl.sum(tl.where(hit, counts, 0), axis=0)
    if pid_m * BLOCK_M >= m:  # fewer than u + 1 groups have rows (m = 0), or no rows in this tile
        return
    g = tl.sum(tl.where(hit, gs, 0), axis=0)
    row_start = tl.sum(tl.where(gs < g, counts, 0), axis=0)
    rows_in = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = (rows_in < m) & (row_start + rows_in < R)
    rows = tl.where(row_ok, row_start + rows_in, 0).to(tl.int64)
    if GATHER:
        route = tl.load(row_routes_ptr + rows, mask=row_ok, other=0)
        src = (route // routes_per_token).to(tl.int64)
        if SCALE:
            scale = tl.load(scale_ptr + route, mask=row_ok, other=0.0).to(tl.float32)
    else:
        src = rows
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_g = w_ptr + g.to(tl.int64) * stride_wg
    if BLOCK_M >= 16:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:  # CUDA cores: products per element, one reduction over K at the end
        acc3 = tl.zeros((BLOCK_M, BLOCK_K, BLOCK_N), dtype=tl.float32)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_hi
        a_ok = row_ok[:, None] & k_ok[None, :]
        if GATHER:
            a = tl.load(x_ptr + src[:, None] * stride_xr + ks[None, :], mask=a_ok, other=0.0)
            if SCALE:
                a = a.to(tl.float32) * scale[:, None]
        else:
            gate = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
            up = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
            for s in range(in_splits):  # a fixed order: deterministic
                p = x_ptr + s * stride_xs + src[:, None] * stride_xr + ks[None, :]
                gate += tl.load(p, mask=a_ok, other=0.0)
                up += tl.load(p + K, mask=a_ok, other=0.0)
            a = gate * tl.sigmoid(gate) * up
        a = a.to(w_ptr.dtype.element_ty)
        b = tl.load(w_g + ks[:, None].to(tl.int64) * stride_wk + cols[None, :],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if BLOCK_M >= 16:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        else:
            acc3 += a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :]
    if BLOCK_M < 16:
        acc = tl.sum(acc3, axis=1)
    out = out_ptr + split.to(tl.int64) * stride_os + rows[:, None] * stride_or + cols[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["N", "n_splits"])
def _combine_kernel(y_ptr, slots_ptr, scores_ptr, out_ptr, N, n_splits, stride_ys, stride_yr, stride_ot,
                    KK: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(KK):  # a fixed order: deterministic
        slot = tl.load(slots_ptr + t * KK + j)
        if slot >= 0:
            y = tl.zeros([BLOCK], tl.float32)
            for s in range(n_splits):
                y += tl.load(y_ptr + s * stride_ys + slot.to(tl.int64) * stride_yr + cols, mask=ok, other=0.0)
            if WEIGHTED:
                y *= tl.load(scores_ptr + t * KK + j).to(tl.float32)
            acc += y
    tl.store(out_ptr + t * stride_ot + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


class Tiles(NamedTuple):
    block_m: int
    block_n: int
    split: int  # K is cut in this many slices (at most)
    block_k: int
    num_warps: int
    num_stages: int


def few_rows_tiles(max_rows: int, routes: int, G: int, N: int, K: int, device: torch.device, fill: int = 8,
                   max_split: int = 16) -> Tiles:
    """Tiles for `routes` rows in G groups, at most max_rows a group, from the H100 sweeps at the decode
    layers' shapes (notes/inference.md): one row a tile on the CUDA cores with N tiles of 64 where
    every group has one row (T = 1), else 16 rows through tl.dot with N tiles of 128 (64 rows a tile
    was 2-5x slower at T = 64); K tiles of 128; K split in powers of two (slices of at least two K
    tiles, at most max_split) until the programs that have rows fill the SMs `fill` times over."""
    if device.type != "cuda":  # the interpreter: small tiles, several splits
        return Tiles(min(16, next_pow2(max_rows)), 16, max(1, min(4, K // 32, max_split)), 16, 4, 1)
    block_m, block_n = (1, 64) if max_rows <= 1 else (16, 128)
    block_k = 128
    groups = max(1, min(G, routes))
    programs = groups * triton.cdiv(N, block_n) * triton.cdiv(triton.cdiv(routes, groups), block_m)
    split = 1
    while split < max_split and programs * split < fill * sm_count(device) and K // (2 * split) >= block_k:
        split *= 2
    return Tiles(block_m, block_n, split, block_k, 4, 3)


def _launch(x, row_routes, scale, w_GKN, counts_G, max_rows, in_splits, routes_per_token, tiles, splits=()):
    """splits: few_rows_tiles' (fill, max_split) where tiles is None, its defaults if empty."""
    R = row_routes.shape[0] if x.dim() == 2 else x.shape[1]
    G, K, N = w_GKN.shape
    max_groups = min(G, R)  # groups that can have rows: program axis 1
    tiles = tiles or few_rows_tiles(max_rows, R, G, N, K, x.device, *splits)
    k_per_split = triton.cdiv(triton.cdiv(K, tiles.split), tiles.block_k) * tiles.block_k
    split = max(1, triton.cdiv(K, k_per_split))
    out = torch.empty(split, R, N, device=x.device, dtype=torch.float32)
    if R == 0 or N == 0 or max_groups == 0:
        return out
    if K == 0:  # empty sums: zero
        return out.zero_()
    precision = "ieee" if w_GKN.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32 else "tf32"
    grid = (triton.cdiv(N, tiles.block_n), max_groups, triton.cdiv(max(max_rows, 1), tiles.block_m) * split)
    gather = x.dim() == 2
    _few_rows_mm_kernel[grid](x, row_routes, scale if scale is not None else x, w_GKN, out, counts_G,
                              R, K, N, G, k_per_split, split, in_splits, routes_per_token,
                              0 if gather else x.stride(0), x.stride(-2), w_GKN.stride(0), w_GKN.stride(1),
                              out.stride(0), out.stride(1), GATHER=gather, SCALE=scale is not None,
                              PRECISION=precision, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                              BLOCK_K=tiles.block_k, BLOCK_G=next_pow2(G), num_warps=tiles.num_warps,
                              num_stages=tiles.num_stages)
    return out


def _check_weights(w_GKN: torch.Tensor, counts_G: torch.Tensor):
    if w_GKN.stride(-1) != 1:
        raise ValueError("the weights' last dimension must be contiguous")
    if counts_G.shape != (w_GKN.shape[0], ) or counts_G.dtype != torch.int32:
        raise ValueError(f"counts must be int32 [{w_GKN.shape[0]}], got {counts_G.dtype} {tuple(counts_G.shape)}")


def few_rows_up(x_TK: torch.Tensor, row_routes_R: torch.Tensor, routes_per_token: int, w_GKN: torch.Tensor,
                counts_G: torch.Tensor, max_rows: int, scores: Optional[torch.Tensor] = None,
                tiles: Optional[Tiles] = None) -> torch.Tensor:
    """h [S, R, N] fp32 partial sums: row r of group g is x[row_routes[r] // routes_per_token] @ w[g]
    (times scores.flatten()[row_routes[r]] first, rounded to x's dtype: Llama 4's prescale).
    max_rows bounds every count (at decode: the token count)."""
    _check_weights(w_GKN, counts_G)
    if x_TK.dim() != 2 or x_TK.shape[1] != w_GKN.shape[1] or x_TK.stride(1) != 1:
        raise ValueError(f"x must be [T, {w_GKN.shape[1]}] with contiguous rows, got {tuple(x_TK.shape)}")
    return _launch(x_TK, row_routes_R, None if scores is None else scores.reshape(-1), w_GKN, counts_G, max_rows,
                   1, routes_per_token, tiles, UP_SPLITS)


def few_rows_down(h_SRN: torch.Tensor, w_GKN: torch.Tensor, counts_G: torch.Tensor, max_rows: int,
                  tiles: Optional[Tiles] = None) -> torch.Tensor:
    """y [S', R, N] fp32 partial sums: row r of group g is SwiGLU(sum_s h[s, r]) @ w[g], h's columns
    [gate | up] (2K), the SwiGLU in fp32 rounded to w's dtype."""
    _check_weights(w_GKN, counts_G)
    if h_SRN.dim() != 3 or h_SRN.shape[2] != 2 * w_GKN.shape[1] or h_SRN.dtype != torch.float32:
        raise ValueError(f"h must be fp32 [S, R, {2 * w_GKN.shape[1]}], got {h_SRN.dtype} {tuple(h_SRN.shape)}")
    h_SRN = h_SRN.contiguous()
    return _launch(h_SRN, h_SRN, None, w_GKN, counts_G, max_rows, h_SRN.shape[0], 1, tiles)


def combine(y_SRN: torch.Tensor, slots_TK: torch.Tensor, scores_TK: Optional[torch.Tensor], dtype: torch.dtype):
    """out [T, N] (dtype): out[t] = sum_j scores[t, j] * sum_s y[s, slots[t, j]] in fp32, routes with
    slot -1 skipped; scores None: unit weights."""
    S, R, N = y_SRN.shape
    T, kk = slots_TK.shape
    out = torch.empty(T, N, device=y_SRN.device, dtype=dtype)
    if T == 0 or N == 0:
        return out
    block = min(1024, next_pow2(N))
    _combine_kernel[(T, triton.cdiv(N, block))](y_SRN, slots_TK.contiguous(),
                                                slots_TK if scores_TK is None else scores_TK.contiguous(), out,
                                                N, S, y_SRN.stride(0), y_SRN.stride(1), out.stride(0), KK=kk,
                                                WEIGHTED=scores_TK is not None, BLOCK=block)
    return out
