"""Triton kernels of the decode experts: few rows per expert, counts read on the device.

    up       a [R, F] in w's dtype  SwiGLU of  x[token(r)] (* score) @ w1[g]  (gate | up columns), or
             h [S1, R, 2F] fp32     partial sums over S1 slices of K where K is split
    down     y [S2, R, M]  fp32     partial sums over S2 slices of F of  a @ w2[g]  (from h: a = the
                                    SwiGLU of sum_s h[s], rounded to the weights' dtype)
    combine  out [T, M]             out[t] = sum_j w[t, j] * sum_s y[s, slots[t, j]]  (fp32, x's dtype)

fp32 above is the accumulation dtype: fp64 weights accumulate in fp64 (reference.compute_dtype).

Rows are grouped as in turbomoe.kernels.grouped_gemm (group g owns rows offset_g .. offset_g +
counts[g]). Each kernel reads its producer's output as it is, so the experts are three launches after
the shuffle, not six (push_rows, two GEMMs, two split-K sums, pull_rows): the row gather is folded into
the first GEMM (row r reads x at token row_routes[r] // k', times its score with prescale); the
first GEMM applies SwiGLU itself (a program owns a tile of gate columns and the matching up columns)
unless K is split, when the second sums its split partials and applies it as it loads; the second's
split sums go into the combine. Splits are summed in a fixed order: deterministic, no atomics.

Why kernels beside the persistent grouped GEMM: at decode a group holds 1 to 64 rows, so the step is a
read of the selected experts' weights. Program axis 2 walks only the experts with rows (the u-th
nonzero count, found in the kernel), so the grid holds no idle expert programs and only those
experts' weights are read (selective loading); K is split where the programs would not fill the SMs.
On Hopper the weight tiles come by TMA (a descriptor over w [G, K, N]: 1.3-1.7x the bandwidth of
per-thread loads at these shapes, notes/inference.md). Fewer than 16 rows a tile multiply on the CUDA
cores (products kept per element, reduced once at the end), more through tl.dot, with the weights as
the MMA's wide side (SWAP) where a tile holds 32 rows. No launch depends on the counts' values:
CUDA-graph capturable. Rows past sum(counts) are neither read nor written.
"""
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ..reference import as_contiguous
from .launch import (acc_dtype, chain_launch, chain_wait, compute_capability, max_shared_mem, next_pow2, sm_count,
                     tl_dtype)

# The first GEMM splits K at most this many ways: every program of the second re-reads all of the
# first's K slices (fp32 gate and up partials) where it splits (tuned in the layer, notes/inference.md).
UP_MAX_SPLIT = 4


@triton.jit
def _acc_zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr,
               ACC: tl.constexpr):
    if BLOCK_M < 16:  # CUDA cores: products per element, one reduction over K at the end
        return tl.zeros((BLOCK_M, BLOCK_K, BLOCK_N), dtype=ACC)
    elif SWAP:
        return tl.zeros((BLOCK_N, BLOCK_M), dtype=ACC)
    else:
        return tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)


@triton.jit
def _acc_add(acc, a, b, BLOCK_M: tl.constexpr, SWAP: tl.constexpr, PRECISION: tl.constexpr):
    """acc += a [BLOCK_M, BLOCK_K] @ b [BLOCK_K, BLOCK_N] in acc's layout and dtype (tl.dot's out_dtype
    defaults to fp32: compiled, an fp64 acc then fails its type check, which the interpreter skips)."""
    if BLOCK_M < 16:
        return acc + a.to(acc.dtype)[:, :, None] * b.to(acc.dtype)[None, :, :]
    elif SWAP:  # the weights are the MMA's M side (64+ wide), the rows its N side
        return tl.dot(tl.trans(b), tl.trans(a), acc, input_precision=PRECISION, out_dtype=acc.dtype)
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=acc.dtype)


@triton.jit
def _acc_value(acc, BLOCK_M: tl.constexpr, SWAP: tl.constexpr):
    """[BLOCK_M, BLOCK_N] in acc's dtype."""
    if BLOCK_M < 16:
        return tl.sum(acc, axis=1)
    elif SWAP:
        return tl.trans(acc)
    else:
        return acc


@triton.jit
def _w_tile(w_desc, w_g, g, k0, ks, k_ok, c0, N, stride_wk, TMA: tl.constexpr, BLOCK_K: tl.constexpr,
            BLOCK_N: tl.constexpr):
    """Group g's weights [BLOCK_K, BLOCK_N] at rows ks (= k0 + arange), columns c0 + arange."""
    if TMA:  # zero past K and N (the descriptor's bounds); a K slice ends at K or on a BLOCK_K edge
        return w_desc.load([g, k0, c0]).reshape(BLOCK_K, BLOCK_N)
    else:
        cols = c0 + tl.arange(0, BLOCK_N)
        return tl.load(w_g + ks[:, None].to(tl.int64) * stride_wk + cols[None, :],
                       mask=k_ok[:, None] & (cols < N)[None, :], other=0.0)


@triton.jit(do_not_specialize=["R", "K", "N", "G", "k_per_split", "n_splits", "in_splits", "routes_per_token"])
def _few_rows_mm_kernel(x_ptr, row_routes_ptr, scale_ptr, w_ptr, w_desc, out_ptr, counts_ptr,
                        R, K, N, G, k_per_split, n_splits, in_splits, routes_per_token,
                        stride_xs, stride_xr, stride_wg, stride_wk, stride_os, stride_or,
                        GATHER: tl.constexpr, SCALE: tl.constexpr, GLU_IN: tl.constexpr, GLU_OUT: tl.constexpr,
                        SWAP: tl.constexpr, TMA: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr, ACC: tl.constexpr,
                        PDL: tl.constexpr):
    """The rows a: GATHER x [T, K] rows row_routes[r] // routes_per_token (* scale[row_routes[r]]);
    GLU_IN the SwiGLU of the sum over in_splits of x [in_splits, R, 2K] in ACC (gate then up); else
    x [R, K]. out: GLU_OUT SwiGLU(a @ w) [R, N / 2] in out's dtype (w's columns: gate then up; one K
    slice), else the partial sums [n_splits, R, N] in ACC (fp32; fp64 for fp64 w)."""
    chain_wait(PDL)
    pid_m = tl.program_id(0)  # the row tiles of one weight tile run side by side: their reads meet in L2
    pid_n = tl.program_id(1) // n_splits
    split = tl.program_id(1) % n_splits
    u = tl.program_id(2)
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
    scale = tl.zeros((BLOCK_M, ), dtype=ACC)
    src = rows
    if GATHER:
        route = tl.load(row_routes_ptr + rows, mask=row_ok, other=0)
        src = (route // routes_per_token).to(tl.int64)
        if SCALE:
            scale = tl.load(scale_ptr + route, mask=row_ok, other=0.0).to(ACC)
    out_n = N // 2 if GLU_OUT else N
    c0 = pid_n * BLOCK_N
    w_g = w_ptr + g.to(tl.int64) * stride_wg
    acc = _acc_zeros(BLOCK_M, BLOCK_N, BLOCK_K, SWAP, ACC)
    if GLU_OUT:
        acc_up = _acc_zeros(BLOCK_M, BLOCK_N, BLOCK_K, SWAP, ACC)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_hi
        a_ok = row_ok[:, None] & k_ok[None, :]
        p = x_ptr + src[:, None] * stride_xr + ks[None, :]
        if GLU_IN:
            gate = tl.zeros((BLOCK_M, BLOCK_K), dtype=ACC)
            up = tl.zeros((BLOCK_M, BLOCK_K), dtype=ACC)
            for s in range(in_splits):  # a fixed order: deterministic
                gate += tl.load(p + s * stride_xs, mask=a_ok, other=0.0)
                up += tl.load(p + s * stride_xs + K, mask=a_ok, other=0.0)
            a = gate * tl.sigmoid(gate) * up
        else:
            a = tl.load(p, mask=a_ok, other=0.0)
            if SCALE:
                a = a.to(ACC) * scale[:, None]
        a = a.to(w_ptr.dtype.element_ty)
        acc = _acc_add(acc, a, _w_tile(w_desc, w_g, g, k0, ks, k_ok, c0, N, stride_wk, TMA, BLOCK_K, BLOCK_N),
                       BLOCK_M, SWAP, PRECISION)
        if GLU_OUT:
            acc_up = _acc_add(acc_up, a, _w_tile(w_desc, w_g, g, k0, ks, k_ok, c0 + out_n, N, stride_wk, TMA,
                                                 BLOCK_K, BLOCK_N), BLOCK_M, SWAP, PRECISION)
    y = _acc_value(acc, BLOCK_M, SWAP)
    cols = c0 + tl.arange(0, BLOCK_N)
    mask = row_ok[:, None] & (cols < out_n)[None, :]
    if GLU_OUT:
        up = _acc_value(acc_up, BLOCK_M, SWAP)
        y = (y * tl.sigmoid(y) * up).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + split.to(tl.int64) * stride_os + rows[:, None] * stride_or + cols[None, :], y, mask=mask)


@triton.jit(do_not_specialize=["R", "N", "n_splits"])
def _combine_kernel(y_ptr, slots_ptr, scores_ptr, out_ptr, R, N, n_splits, stride_ys, stride_yr, stride_ot,
                    KK: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK: tl.constexpr, ACC: tl.constexpr,
                    PDL: tl.constexpr):
    chain_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    acc = tl.zeros([BLOCK], ACC)
    for j in tl.static_range(KK):  # a fixed order: deterministic
        slot = tl.load(slots_ptr + t * KK + j)
        if (slot >= 0) & (slot < R):  # outside y's rows: no route (reference.routed_slots)
            y = tl.zeros([BLOCK], ACC)
            for s in range(n_splits):
                y += tl.load(y_ptr + s * stride_ys + slot.to(tl.int64) * stride_yr + cols, mask=ok, other=0.0)
            if WEIGHTED:
                y *= tl.load(scores_ptr + t * KK + j).to(ACC)
            acc += y
    tl.store(out_ptr + t * stride_ot + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


class Tiles(NamedTuple):
    block_m: int
    block_n: int
    split: int  # K is cut in this many slices (at most)
    block_k: int
    num_warps: int
    num_stages: int
    swap: bool = False  # the weights as the MMA's M side (block_m >= 16)
    tma: bool = True  # weight tiles by TMA where the device and the strides allow


def few_rows_tiles(max_rows: int, routes: int, G: int, N: int, K: int, device: torch.device,
                   max_split: int = 16, glu: bool = False) -> Tiles:
    """Tiles for `routes` rows in G groups, at most max_rows a group, from the H100 sweeps at the decode
    layers' shapes (notes/inference.md): one row a tile on the CUDA cores where every group has one
    row (T = 1), in N tiles of 64 (32 where 64 fall short of the fill below at the largest split);
    else N tiles of 128 and 16 rows through tl.dot, or 32 rows with the weights as the MMA's M side
    where groups average 12 rows or more, 3 in the second GEMM (64 rows a tile was 2-5x slower at T =
    64); K tiles of 128
    in 3 stages. K is split in powers of two (slices of at least two K tiles, at most max_split)
    only until the programs that have rows fill the SMs: in the first GEMM once (twice for one-row
    tiles), counting gate and up columns apart (glu: N is both), as a split costs it its SwiGLU
    epilogue and the second GEMM then re-reads fp32 partials (Scout T = 8: the second GEMM 32 ->
    51 us); in the second four times, as its programs are short (K = F, 6-8 K tiles) and the fixed
    cost of each (finding its group, the epilogue) is hidden only by many (Scout's down GEMM at T =
    2-4: 32 us unsplit, 19-26 split 4-8 ways, for a 10-18 us floor). Unsplit, a first-GEMM program
    owns a tile of gate and one of up columns and buffers both a stage, so one fits an SM: where
    its programs would not fill the SMs once, N tiles of 64 double them (Scout T = 16: 91 -> 89
    us); where they take one to two waves, shallower buffers let three share an SM (2 stages, or K
    tiles of 64 with 32-row tiles), and where groups average 6 rows or more (a shared expert's many
    row tiles make the waves uneven) N and K tiles of 64 double the programs. The second GEMM takes
    2 stages with one-row and 32-row tiles, in K tiles of 64, except 128 where swapped tiles hold
    3 to 12 rows a group (Scout T = 32-256: 1.1-2.4 us faster than 16-row tiles or 3 stages,
    Qwen3 T = 64-256 0.3-1.1)."""
    if device.type != "cuda":  # the interpreter: small tiles, several splits
        return Tiles(min(16, next_pow2(max_rows)), 16, max(1, min(4, K // 32, max_split)), 16, 4, 1)
    groups = max(1.0, G * (1 - (1 - 1 / G) ** routes))  # expected groups with rows, routes spread evenly
    if max_rows <= 1:
        block_m, block_n, swap = 1, 64, False
    else:
        swap = routes >= (12 if glu else 3) * groups
        block_m, block_n = 32 if swap else 16, 128
    block_k, stages = 128, 3
    row_tiles = max(groups, routes / block_m)  # a program's rows: at least one tile a group with rows
    sms = sm_count(device)
    fill = (4 if not glu else 2 if block_m == 1 else 1) * sms

    def split_for(block_n):  # glu: gate and up columns counted apart (the split kernel's programs)
        split = 1
        while split < max_split and row_tiles * triton.cdiv(N, block_n) * split < fill and K // (2 * split) >= block_k:
            split *= 2
        return split
    split = split_for(block_n)
    if block_m == 1 and row_tiles * triton.cdiv(N, block_n) * split < fill:  # split to the limit, still short
        block_n = 32
        split = split_for(block_n)
    if glu and split == 1 and block_m > 1:
        unsplit = row_tiles * triton.cdiv(N // 2, block_n)  # a program owns a tile of gate and of up columns
        if unsplit < sms:  # too few programs, and a split would cost more
            block_n = 64
        elif unsplit < 2 * sms:
            if routes >= 6 * groups:  # several row tiles a group: twice the programs, each on 64-K tiles
                block_n, block_k = 64, 64
            else:
                block_k, stages = (64, 3) if swap else (128, 2)
    elif not glu and (swap or block_m == 1):  # 128-K swapped tiles below 12 rows a group
        block_k, stages = 128 if swap and routes < 12 * groups else 64, 2
    return Tiles(block_m, block_n, split, block_k, 4, stages, swap)


def _use_tma(w_GKN: torch.Tensor, tiles: Tiles) -> bool:
    """TMA needs 16-byte aligned rows, every tile starting on a 16-byte edge, and a Hopper or later GPU
    (the interpreter runs it anywhere and asserts the same alignment). K slices and column tiles start
    on tile edges, so only the up half's columns, from N / 2, can break it: an H100 raised "illegal
    instruction" there (F = 6, fp32; 2026-11-25), so such weights load without TMA everywhere."""
    es = w_GKN.element_size()
    if not tiles.tma or w_GKN.data_ptr() % 16 or any(st * es % 16 for st in w_GKN.stride()[:-1]):
        return False
    if w_GKN.shape[2] // 2 * es % 16:
        return False
    return w_GKN.device.type != "cuda" or compute_capability(w_GKN.device.index) >= 90


def _fit_smem(tiles: Tiles, w_GKN: torch.Tensor, glu_out: bool) -> Tiles:
    """Fewer stages, then shorter K tiles, until the pipeline's buffers (a weight tile a stage, two
    with the SwiGLU epilogue, and the rows) fit the device's shared memory: fp32 weights need it."""
    if w_GKN.device.type != "cuda":
        return tiles
    budget = max_shared_mem(w_GKN.device.index)
    def need(t):
        return ((1 + glu_out) * t.block_k * t.block_n * t.num_stages + t.block_m * t.block_k) * w_GKN.element_size()
    while need(tiles) > budget and (tiles.num_stages > 2 or tiles.block_k > 32):
        tiles = (tiles._replace(num_stages=tiles.num_stages - 1) if tiles.num_stages > 2
                 else tiles._replace(block_k=tiles.block_k // 2))
    return tiles


def _launch(x, row_routes, scale, w_GKN, counts_G, max_rows, routes_per_token, tiles, max_split=16, glu_out=False):
    """x: [T, K] with row_routes (rows gathered), [S, R, 2K] in w's acc_dtype (the SwiGLU of its
    split sums) or [R, K]. glu_out: w's columns are [gate | up] and, where K is not split, the output
    is their SwiGLU [R, N / 2] in w's dtype. max_split: few_rows_tiles' where tiles is None."""
    gather, glu_in = row_routes is not None, x.dim() == 3
    R = row_routes.shape[0] if gather else x.shape[-2]
    G, K, N = w_GKN.shape
    max_groups = min(G, R)  # groups that can have rows: program axis 2
    tiles = _fit_smem(tiles or few_rows_tiles(max_rows, R, G, N, K, x.device, max_split, glu_out), w_GKN, glu_out)
    k_per_split = triton.cdiv(triton.cdiv(K, tiles.split), tiles.block_k) * tiles.block_k
    split = max(1, triton.cdiv(K, k_per_split)) if K else 1  # K = 0: zeros below
    glu_out = glu_out and split == 1
    out_n = N // 2 if glu_out else N
    out = (torch.empty(R, out_n, device=x.device, dtype=w_GKN.dtype) if glu_out
           else torch.empty(split, R, N, device=x.device, dtype=acc_dtype(w_GKN.dtype)))
    if R == 0 or out_n == 0 or max_groups == 0:
        return out
    if K == 0:  # empty sums: zero (and SwiGLU(0) = 0)
        return out.zero_()
    exact = w_GKN.dtype == torch.float64 or (w_GKN.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32)
    precision = "ieee" if exact else "tf32"
    grid = (triton.cdiv(max(max_rows, 1), tiles.block_m), triton.cdiv(out_n, tiles.block_n) * split, max_groups)
    w_desc = None
    if _use_tma(w_GKN, tiles):
        from triton.tools.tensor_descriptor import TensorDescriptor
        w_desc = TensorDescriptor.from_tensor(w_GKN, [1, tiles.block_k, tiles.block_n])
    _few_rows_mm_kernel[grid](x, row_routes if gather else x, scale if scale is not None else x, w_GKN, w_desc, out,
                              counts_G, R, K, N, G, k_per_split, split, x.shape[0] if glu_in else 0, routes_per_token,
                              x.stride(0) if glu_in else 0, x.stride(-2), w_GKN.stride(0), w_GKN.stride(1),
                              0 if glu_out else out.stride(0), out.stride(-2), GATHER=gather,
                              SCALE=scale is not None, GLU_IN=glu_in, GLU_OUT=glu_out, SWAP=tiles.swap,
                              TMA=w_desc is not None, PRECISION=precision, BLOCK_M=tiles.block_m,
                              BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, BLOCK_G=next_pow2(G),
                              ACC=tl_dtype(acc_dtype(w_GKN.dtype)),
                              num_warps=tiles.num_warps, num_stages=tiles.num_stages, **chain_launch(x.device))
    return out


def _check_weights(w_GKN: torch.Tensor, counts_G: torch.Tensor) -> torch.Tensor:
    """The counts as the kernel reads them (at unit stride)."""
    if w_GKN.stride(-1) != 1:
        raise ValueError("the weights' last dimension must be contiguous")
    if counts_G.shape != (w_GKN.shape[0], ) or counts_G.dtype != torch.int32:
        raise ValueError(f"counts must be int32 [{w_GKN.shape[0]}], got {counts_G.dtype} {tuple(counts_G.shape)}")
    return as_contiguous(counts_G, torch.int32)


def few_rows_up(x_TK: torch.Tensor, row_routes_R: torch.Tensor, routes_per_token: int, w_GKN: torch.Tensor,
                counts_G: torch.Tensor, max_rows: int, scores: Optional[torch.Tensor] = None,
                tiles: Optional[Tiles] = None) -> torch.Tensor:
    """Row r of group g is x[row_routes[r] // routes_per_token] (times scores.flatten()[row_routes[r]]
    first, rounded to x's dtype: Llama 4's prescale) @ w[g], w's columns [gate | up] (2F). Returns its
    SwiGLU a [R, F] in w's dtype, or where K is split the fp32 (fp64 for fp64 w) partial sums h [S, R,
    2F] (few_rows_down takes either). max_rows bounds every count (at decode: the token count)."""
    counts_G = _check_weights(w_GKN, counts_G)
    if x_TK.dim() != 2 or x_TK.shape[1] != w_GKN.shape[1] or x_TK.stride(1) != 1:
        raise ValueError(f"x must be [T, {w_GKN.shape[1]}] with contiguous rows, got {tuple(x_TK.shape)}")
    if w_GKN.shape[2] % 2:
        raise ValueError(f"w's columns must be [gate | up], an even count, got {w_GKN.shape[2]}")
    row_routes_R = as_contiguous(row_routes_R, row_routes_R.dtype)  # the kernel reads it at unit stride
    return _launch(x_TK, row_routes_R, None if scores is None else scores.reshape(-1), w_GKN, counts_G, max_rows,
                   routes_per_token, tiles, UP_MAX_SPLIT, glu_out=True)


def few_rows_down(h: torch.Tensor, w_GKN: torch.Tensor, counts_G: torch.Tensor, max_rows: int,
                  tiles: Optional[Tiles] = None) -> torch.Tensor:
    """y [S', R, N] fp32 (fp64 for fp64 w) partial sums: row r of group g is a[r] @ w[g], where a is
    few_rows_up's output: the SwiGLU rows [R, K] in w's dtype, or partial sums h [S, R, 2K] in y's
    dtype (columns [gate | up]) whose sum's SwiGLU, in that dtype rounded to w's, is a."""
    counts_G = _check_weights(w_GKN, counts_G)
    K, acc = w_GKN.shape[1], acc_dtype(w_GKN.dtype)
    if not ((h.dim() == 3 and h.shape[2] == 2 * K and h.dtype == acc)
            or (h.dim() == 2 and h.shape[1] == K and h.dtype == w_GKN.dtype)):
        raise ValueError(f"h must be {acc} [S, R, {2 * K}] or {w_GKN.dtype} [R, {K}], got {h.dtype} {tuple(h.shape)}")
    return _launch(h.contiguous(), None, None, w_GKN, counts_G, max_rows, 1, tiles)


def combine(y_SRN: torch.Tensor, slots_TK: torch.Tensor, scores_TK: Optional[torch.Tensor], dtype: torch.dtype):
    """out [T, N] (dtype): out[t] = sum_j scores[t, j] * sum_s y[s, slots[t, j]] in fp32 (fp64 for fp64
    y), routes with a slot outside [0, R) skipped; scores None: unit weights."""
    S, R, N = y_SRN.shape
    T, kk = slots_TK.shape
    y_SRN = as_contiguous(y_SRN, y_SRN.dtype)  # the kernel reads a row's columns at unit stride
    out = torch.empty(T, N, device=y_SRN.device, dtype=dtype)
    if T == 0 or N == 0:
        return out
    block = min(1024, next_pow2(N))
    while block > 128 and T * triton.cdiv(N, block) < 2 * sm_count(out.device):  # few tokens: more programs
        block //= 2
    _combine_kernel[(T, triton.cdiv(N, block))](y_SRN, slots_TK.contiguous(),
                                                slots_TK if scores_TK is None else scores_TK.contiguous(), out,
                                                R, N, S, y_SRN.stride(0), y_SRN.stride(1), out.stride(0), KK=kk,
                                                WEIGHTED=scores_TK is not None, BLOCK=block,
                                                ACC=tl_dtype(acc_dtype(y_SRN.dtype)),
                                                **chain_launch(out.device))
    return out
