"""Triton index shuffling (serving's routing step): logits [T, E] -> top-k ids and scores, counts [E],
and the permutation of the T * k routes into expert-contiguous rows (slots [T, k] and its inverse
row_routes [T * k]); the spec is reference.index_shuffling.

Up to ONE_BLOCK_TILES tiles of tokens (BLOCK_T tokens each: _tile), one program does it all in one
launch: a pass of top-k over the tiles (counting per expert in registers), then a pass that ranks
each route among its expert's routes in token order (a cumsum over a one-hot tile, carried from
tile to tile). Beyond, two launches: one program per tile does the top-k and writes its expert
histogram; then each program sums the histograms of the tiles before it (fixed order) and ranks its
own tile. Integer ranks, no atomics: deterministic. Nothing is read on the host, so both paths are
CUDA-graph capturable.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from ..reference import ShuffledRoutes
from .gating import _row_probs, _tile_probs, _tile_ptrs, _topk
from .launch import acc_dtype, chain_launch, chain_wait, next_pow2, tl_dtype

ONE_BLOCK_TILES = 1  # the single-program path up to this many tiles of tokens (measured: notes/inference.md)


@triton.jit
def _topk_tile(logits_ptr, ids_ptr, scores_ptr, t0, T, E, stride_t, stride_p, N_PARTS: tl.constexpr, K: tl.constexpr,
               KP: tl.constexpr, SHARED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
               SIGMOID: tl.constexpr, RENORM: tl.constexpr, ACC: tl.constexpr, PARTS: tl.constexpr):
    """Top-k of tokens t0 .. t0 + BLOCK_T (ties to the lower id), stored in rows of K + SHARED
    (the shared expert's column: expert E, score 1); returns their counts [BLOCK_E]. PARTS (a dtype):
    the logits are the sum over N_PARTS of fp32 partial sums (the split router's), in order, rounded
    to PARTS as a GEMM's output is (all N_PARTS loads issued at once)."""
    rows = t0 + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    kcol = tl.arange(0, KP)
    if PARTS is None:
        probs, _, _, valid, cells = _row_probs(logits_ptr, rows, cols, T, E, stride_t, SIGMOID, ACC)
    else:
        p, m2 = _tile_ptrs(logits_ptr, rows, cols, T, E, stride_t)
        x = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
        for s in tl.static_range(N_PARTS):  # a fixed order: deterministic
            x += tl.load(p + s * stride_p, mask=m2, other=0.0)
        probs, _, _, valid, cells = _tile_probs(x.to(PARTS, fp_downcast_rounding="rtne").to(ACC), rows, cols, T, E,
                                                SIGMOID)
    ids_t, sc_t, chosen, _ = _topk(probs, probs, valid, cells, cols, K, KP, BLOCK_T, BLOCK_E, RENORM, ACC)
    if SHARED:
        ids_t = tl.where(kcol[None, :] == K, E, ids_t)
        sc_t = tl.where(kcol[None, :] == K, 1.0, sc_t)
        chosen += ((cols[None, :] == E) & (rows < T)[:, None]).to(tl.int32)
    out = rows[:, None] * (K + SHARED) + kcol[None, :]
    omask = (rows < T)[:, None] & (kcol < K + SHARED)[None, :]
    tl.store(ids_ptr + out, ids_t, mask=omask)
    tl.store(scores_ptr + out, sc_t, mask=omask)
    return tl.sum(chosen, axis=0)


@triton.jit
def _rank_tile(ids_ptr, slots_ptr, routes_ptr, t0, T, start, K: tl.constexpr, BLOCK_T: tl.constexpr,
               BLOCK_E: tl.constexpr):
    """Slots of tokens t0 .. t0 + BLOCK_T: start[e] (the first free row of expert e) plus the routes
    of e earlier in the tile; row_routes at those rows. A token chooses an expert at most once, so
    token order is route order within an expert. Returns the tile's counts [BLOCK_E]."""
    toks = t0 + tl.arange(0, BLOCK_T)
    tmask = toks < T
    cols = tl.arange(0, BLOCK_E)
    cnt = tl.zeros([BLOCK_T, BLOCK_E], tl.int32)
    for j in tl.static_range(K):
        e = tl.load(ids_ptr + toks * K + j, mask=tmask, other=-1)
        cnt += (e[:, None] == cols[None, :]).to(tl.int32)
    row_of = tl.cumsum(cnt, axis=0) - cnt + start[None, :]  # [BLOCK_T, BLOCK_E]
    for j in tl.static_range(K):
        e = tl.load(ids_ptr + toks * K + j, mask=tmask, other=-1)
        slot = tl.sum(tl.where(e[:, None] == cols[None, :], row_of, 0), axis=1)
        routed = e >= 0
        tl.store(slots_ptr + toks * K + j, tl.where(routed, slot, -1), mask=tmask)
        tl.store(routes_ptr + slot, toks * K + j, mask=tmask & routed)
    return tl.sum(cnt, axis=0)


@triton.jit
def _clear_rows(routes_ptr, r0, r1, total, BLOCK_R: tl.constexpr):
    """row_routes = -1 for rows r0 .. r1 past the routed total."""
    for r in range(r0, r1, BLOCK_R):
        rows = r + tl.arange(0, BLOCK_R)
        tl.store(routes_ptr + rows, tl.full([BLOCK_R], -1, tl.int32), mask=(rows >= total) & (rows < r1))


# Below, K counts the routes of a token (k, plus 1 with a shared expert) and EC the count columns
# (E, plus 1); the top-k tile takes the routed k and E.
@triton.jit(do_not_specialize=["T", "E", "stride_t", "stride_p"])
def _shuffle_one_block_kernel(logits_ptr, ids_ptr, scores_ptr, counts_ptr, slots_ptr, routes_ptr, T, E, stride_t,
                              stride_p, N_PARTS: tl.constexpr, PARTS: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                              SHARED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                              SIGMOID: tl.constexpr, RENORM: tl.constexpr, ACC: tl.constexpr, PDL: tl.constexpr):
    chain_wait(PDL)
    cols = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for t0 in range(0, T, BLOCK_T):
        counts += _topk_tile(logits_ptr, ids_ptr, scores_ptr, t0, T, E, stride_t, stride_p, N_PARTS, K - SHARED, KP,
                             SHARED, BLOCK_T, BLOCK_E, SIGMOID, RENORM, ACC, PARTS)
    tl.store(counts_ptr + cols, counts, mask=cols < E + SHARED)
    tl.debug_barrier()  # the rank pass reads the ids other threads of this program stored
    start = tl.cumsum(counts, axis=0) - counts
    for t0 in range(0, T, BLOCK_T):
        start += _rank_tile(ids_ptr, slots_ptr, routes_ptr, t0, T, start, K, BLOCK_T, BLOCK_E)
    _clear_rows(routes_ptr, 0, T * K, tl.sum(counts, axis=0), BLOCK_T * KP)


@triton.jit(do_not_specialize=["T", "E", "stride_t", "stride_p"])
def _topk_blocks_kernel(logits_ptr, ids_ptr, scores_ptr, hist_ptr, T, E, stride_t, stride_p,
                        N_PARTS: tl.constexpr, PARTS: tl.constexpr, K: tl.constexpr,
                        KP: tl.constexpr, SHARED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                        SIGMOID: tl.constexpr, RENORM: tl.constexpr, ACC: tl.constexpr, PDL: tl.constexpr):
    chain_wait(PDL)
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    counts = _topk_tile(logits_ptr, ids_ptr, scores_ptr, pid * BLOCK_T, T, E, stride_t, stride_p, N_PARTS, K - SHARED,
                        KP, SHARED, BLOCK_T, BLOCK_E, SIGMOID, RENORM, ACC, PARTS)
    tl.store(hist_ptr + pid * (E + SHARED) + cols, counts, mask=cols < E + SHARED)


@triton.jit(do_not_specialize=["T", "EC", "nblocks"])
def _rank_blocks_kernel(ids_ptr, hist_ptr, counts_ptr, slots_ptr, routes_ptr, T, EC, nblocks, K: tl.constexpr,
                        KP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr, PDL: tl.constexpr):
    chain_wait(PDL)
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    totals = tl.zeros([BLOCK_E], tl.int32)
    before = tl.zeros([BLOCK_E], tl.int32)  # routes of each expert in the tiles before this one
    for b0 in range(0, nblocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        h = tl.load(hist_ptr + b[:, None] * EC + cols[None, :], mask=(b < nblocks)[:, None] & (cols < EC)[None, :],
                    other=0)
        totals += tl.sum(h, axis=0)
        before += tl.sum(tl.where((b < pid)[:, None], h, 0), axis=0)
    if pid == 0:
        tl.store(counts_ptr + cols, totals, mask=cols < EC)
    start = tl.cumsum(totals, axis=0) - totals + before
    _rank_tile(ids_ptr, slots_ptr, routes_ptr, pid * BLOCK_T, T, start, K, BLOCK_T, BLOCK_E)
    r0 = pid * BLOCK_T * K
    _clear_rows(routes_ptr, r0, tl.minimum(r0 + BLOCK_T * K, T * K), tl.sum(totals, axis=0), BLOCK_T * KP)


def _tile(EC: int, T: int):
    """(BLOCK_T, BLOCK_E, num_warps): tiles of 4 tokens up to 512 tokens, then as many as keep the
    programs near 128 (at most 64 tokens a tile); 8 warps from 16 tokens. A program's top-k runs k
    reductions over its tile in turn, so small tiles in many programs win: H100, E 16 to 128, k 1 to
    8, 1.9-3x faster than tiles of 4096 cells (notes/inference.md)."""
    block_t = min(64, max(4, next_pow2(triton.cdiv(T, 128))))
    return block_t, next_pow2(EC), 8 if block_t >= 16 else 4


def index_shuffling(logits_TE: torch.Tensor, k: int, score_func: str = "softmax", renormalize: bool = False,
                    shared_expert: bool = False, one_block_tiles: int = ONE_BLOCK_TILES,
                    parts_dtype: Optional[torch.dtype] = None) -> ShuffledRoutes:
    """parts_dtype: logits_TE is [S, T, E] fp32, partial sums of the logits (router_logit_parts),
    whose sum in order, rounded to parts_dtype, is the logits."""
    if parts_dtype is not None and (logits_TE.dim() != 3 or logits_TE.dtype != torch.float32):
        raise ValueError(f"logit parts must be fp32 [S, T, E], got {logits_TE.dtype} {tuple(logits_TE.shape)}")
    parts = logits_TE if parts_dtype is not None else logits_TE[None]
    _, T, E = parts.shape
    dev = logits_TE.device
    if parts.stride(2) != 1:
        parts = parts.contiguous()
    acc = acc_dtype(parts_dtype or logits_TE.dtype)
    sh = int(shared_expert)
    kr, ec = k + sh, E + sh  # routes per token, count columns
    ids = torch.empty(T, kr, dtype=torch.int32, device=dev)
    scores = torch.empty(T, kr, dtype=acc, device=dev)
    counts = torch.empty(ec, dtype=torch.int32, device=dev)
    slots = torch.empty(T, kr, dtype=torch.int32, device=dev)
    routes = torch.empty(T * kr, dtype=torch.int32, device=dev)
    block_t, block_e, warps = _tile(ec, T)
    meta = dict(K=kr, KP=next_pow2(kr), BLOCK_T=block_t, BLOCK_E=block_e, num_warps=warps, **chain_launch(dev))
    gate = dict(SHARED=sh, SIGMOID=score_func == "sigmoid", RENORM=renormalize, ACC=tl_dtype(acc))
    src = dict(stride_p=parts.stride(0), N_PARTS=parts.shape[0], PARTS=parts_dtype and tl_dtype(parts_dtype))
    nblocks = triton.cdiv(T, block_t)
    if nblocks <= one_block_tiles:
        _shuffle_one_block_kernel[(1, )](parts, ids, scores, counts, slots, routes, T, E, parts.stride(1), **src,
                                         **meta, **gate)
    else:
        hist = torch.empty(nblocks, ec, dtype=torch.int32, device=dev)
        _topk_blocks_kernel[(nblocks, )](parts, ids, scores, hist, T, E, parts.stride(1), **src, **meta, **gate)
        _rank_blocks_kernel[(nblocks, )](ids, hist, counts, slots, routes, T, ec, nblocks,
                                         BLOCK_B=max(1, min(64, 4096 // block_e)), **meta)
    return ShuffledRoutes(ids, scores, counts, slots, routes)
