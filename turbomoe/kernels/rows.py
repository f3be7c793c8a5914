"""Triton kernels that move rows between the token layout [S, M] and the expert buffer [R, M].

Two kernels serve the four directions, so each row of output has exactly one writer (no atomics):
  push_rows  token s writes (score *) src[s] into row slots[s, j] of the buffer, for every j:
             scatter forward, and gather backward (where it also forms grad_score = <src[s], y[row]>)
  pull_rows  token s reads its k rows and sums (score *) y[row] in fp32:
             gather forward, and scatter backward (unit scores)
Buffer rows that no route reaches are zeroed by extra programs of the push kernel. Which rows those
are follows from the kept counts (capacity C: rows e*C + p with p >= kept[e]; dropless: rows past
the sum of kept), or, for bare slots, from row_routes, the inverse of slots. With RENORM the weights
are the kept scores over their sum (reference.renormalize_kept), formed per token, and gather's
backward turns the dot products into gradients of the raw scores.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from .launch import acc_dtype, next_pow2, tl_dtype


@triton.jit(do_not_specialize=["n", "R"])
def _invert_slots_kernel(slots_ptr, row_routes_ptr, n, R, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slots_ptr + offs, mask=offs < n, other=-1)
    tl.store(row_routes_ptr + slot, offs, mask=(offs < n) & (slot >= 0) & (slot < R))


def invert_slots(slots_SK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """row_routes [R] int32: the route s * k + j that owns each buffer row, or -1."""
    row_routes = torch.full((num_rows, ), -1, dtype=torch.int32, device=slots_SK.device)
    n = slots_SK.numel()
    if n:
        _invert_slots_kernel[(triton.cdiv(n, 1024), )](slots_SK, row_routes, n, num_rows, BLOCK=1024)
    return row_routes


@triton.jit
def _empty_rows(rows, R, row_routes_ptr, kept_ptr, C, E, LAYOUT: tl.constexpr, BLOCK_E: tl.constexpr):
    """Mask of buffer rows that no route reaches."""
    if LAYOUT:
        if C > 0:
            expert = rows // C
            kept = tl.load(kept_ptr + expert, mask=rows < R, other=0)
            empty = (rows < R) & (rows - expert * C >= kept)
        else:
            e = tl.arange(0, BLOCK_E)
            total = tl.sum(tl.load(kept_ptr + e, mask=e < E, other=0), axis=0)
            empty = (rows < R) & (rows >= total)
    else:
        empty = (rows < R) & (tl.load(row_routes_ptr + rows, mask=rows < R, other=0) < 0)
    return empty


@triton.jit
def _div(a, b, DIV_RN: tl.constexpr):
    """a / b, IEEE-rounded with DIV_RN (fp32, where Triton's / is approximate; fp64's is exact)."""
    if DIV_RN:
        return tl.math.div_rn(a, b)
    else:
        return a / b


@triton.jit
def _renormalized(slots_ptr, scores_ptr, toks, tmask, R, K: tl.constexpr, KP: tl.constexpr, EPS: tl.constexpr,
                  ACC: tl.constexpr, DIV_RN: tl.constexpr):
    """Weights [BLOCK_T, KP] = kept scores over max(their sum, EPS), the kept mask, the denominator
    and whether EPS replaced the sum (then the weights no longer depend on each other)."""
    kcol = tl.arange(0, KP)
    idx = toks[:, None] * K + kcol[None, :]
    slot = tl.load(slots_ptr + idx, mask=tmask[:, None] & (kcol < K)[None, :], other=-1)
    kept = (slot >= 0) & (slot < R)
    p = tl.load(scores_ptr + idx, mask=kept, other=0.0).to(ACC)
    total = tl.sum(p, axis=1)
    # As the reference's clamp_min: a NaN sum stays NaN (NaN weights, NaN gradients), not eps.
    clamped = total < EPS
    denom = tl.where(clamped, EPS, total)
    # IEEE division: a lone kept route weighs exactly 1, so its score's gradient is exactly 0, as in
    # the CUDA kernels and the reference.
    return _div(p, denom[:, None], DIV_RN), kept, denom, clamped


@triton.jit
def _column(t, kcol, j):
    """Column j of t [BLOCK_T, KP]."""
    return tl.sum(tl.where(kcol[None, :] == j, t, 0.0), axis=1)


# M stays specialised: its divisibility lets rows move in 16-byte vectors.
@triton.jit(do_not_specialize=["S", "R", "n_token_blocks", "C", "E"])
def _push_rows_kernel(src_ptr, slots_ptr, scores_ptr, y_ptr, row_routes_ptr, kept_ptr, out_ptr, dscores_ptr,
                      S, M, R, n_token_blocks, C, E,
                      K: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_Z: tl.constexpr, BLOCK_E: tl.constexpr, LAYOUT: tl.constexpr,
                      HAS_SCORES: tl.constexpr, DOT: tl.constexpr, RENORM: tl.constexpr, EPS: tl.constexpr,
                      ACC: tl.constexpr, DIV_RN: tl.constexpr):
    pid = tl.program_id(0)
    cols0 = tl.arange(0, BLOCK_M)
    if pid < n_token_blocks:
        toks = pid * BLOCK_T + tl.arange(0, BLOCK_T)
        tmask = toks < S
        kcol = tl.arange(0, KP)
        dots = tl.zeros([BLOCK_T, KP], ACC)
        if RENORM:
            w, kept, denom, clamped = _renormalized(slots_ptr, scores_ptr, toks, tmask, R, K, KP, EPS, ACC, DIV_RN)
        for m0 in range(0, M, BLOCK_M):
            cols = m0 + cols0
            cmask = cols < M
            v = tl.load(src_ptr + toks[:, None].to(tl.int64) * M + cols[None, :],
                        mask=tmask[:, None] & cmask[None, :], other=0.0)
            for j in tl.static_range(K):
                slot = tl.load(slots_ptr + toks * K + j, mask=tmask, other=-1)
                routed = tmask & (slot >= 0) & (slot < R)
                ok = routed[:, None] & cmask[None, :]
                row = slot.to(tl.int64)[:, None] * M + cols[None, :]
                if HAS_SCORES:
                    if RENORM:
                        score = _column(w, kcol, j)
                    else:
                        score = tl.load(scores_ptr + toks * K + j, mask=tmask, other=0.0).to(ACC)
                    tl.store(out_ptr + row, (v.to(ACC) * score[:, None]).to(out_ptr.dtype.element_ty), mask=ok)
                else:
                    tl.store(out_ptr + row, v.to(out_ptr.dtype.element_ty), mask=ok)
                if DOT:
                    y = tl.load(y_ptr + row, mask=ok, other=0.0).to(ACC)
                    # A dropped route's score gets no gradient: not 0 x (NaN or Inf in grad_out).
                    d = tl.where(routed, tl.sum(v.to(ACC) * y, axis=1), 0.0)
                    dots = tl.where(kcol[None, :] == j, dots + d[:, None], dots)
        if DOT:
            if RENORM:  # dL/dp_j = (d_j - sum_i w_i d_i) / D, or d_j / EPS where EPS replaced D
                wd = tl.where(clamped, 0.0, tl.sum(w * dots, axis=1))
                dots = tl.where(kept, _div(dots - wd[:, None], denom[:, None], DIV_RN), 0.0)
            tl.store(dscores_ptr + toks[:, None] * K + kcol[None, :], dots,
                     mask=tmask[:, None] & (kcol < K)[None, :])
    else:
        # BLOCK_Z rows a program, BLOCK_T at a time; stores are masked to the empty ones.
        zeros = tl.zeros([BLOCK_T, BLOCK_M], out_ptr.dtype.element_ty)
        for r0 in tl.static_range(0, BLOCK_Z, BLOCK_T):
            rows = (pid - n_token_blocks) * BLOCK_Z + r0 + tl.arange(0, BLOCK_T)
            empty = _empty_rows(rows, R, row_routes_ptr, kept_ptr, C, E, LAYOUT, BLOCK_E)
            for m0 in range(0, M, BLOCK_M):
                cols = m0 + cols0
                tl.store(out_ptr + rows[:, None].to(tl.int64) * M + cols[None, :], zeros,
                         mask=empty[:, None] & (cols < M)[None, :])


@triton.jit(do_not_specialize=["S", "R"])
def _pull_rows_kernel(y_ptr, slots_ptr, scores_ptr, out_ptr, S, M, R,
                      K: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr,
                      HAS_SCORES: tl.constexpr, RENORM: tl.constexpr, EPS: tl.constexpr, ACC: tl.constexpr,
                      DIV_RN: tl.constexpr):
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = toks < S
    kcol = tl.arange(0, KP)
    if RENORM:
        w, kept, denom, clamped = _renormalized(slots_ptr, scores_ptr, toks, tmask, R, K, KP, EPS, ACC, DIV_RN)
    for m0 in range(0, M, BLOCK_M):
        cols = m0 + tl.arange(0, BLOCK_M)
        cmask = cols < M
        acc = tl.zeros([BLOCK_T, BLOCK_M], ACC)
        for j in tl.static_range(K):
            slot = tl.load(slots_ptr + toks * K + j, mask=tmask, other=-1)
            routed = tmask & (slot >= 0) & (slot < R)
            ok = routed[:, None] & cmask[None, :]
            y = tl.load(y_ptr + slot.to(tl.int64)[:, None] * M + cols[None, :], mask=ok, other=0.0).to(ACC)
            if HAS_SCORES:
                if RENORM:
                    score = _column(w, kcol, j)
                else:  # a dropped route adds nothing, whatever its score (0 x NaN or Inf would be NaN)
                    score = tl.load(scores_ptr + toks * K + j, mask=routed, other=0.0).to(ACC)
                y = y * score[:, None]
            acc += y
        tl.store(out_ptr + toks[:, None].to(tl.int64) * M + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=tmask[:, None] & cmask[None, :])


def _renorm_args(dtype: torch.dtype) -> dict:
    """The accumulation dtype, its eps, and whether its division needs div_rn (fp32)."""
    acc = acc_dtype(dtype)
    return dict(EPS=torch.finfo(acc).eps, ACC=tl_dtype(acc), DIV_RN=acc == torch.float32)


def row_tile(M: int, element_size: int):
    """(BLOCK_T, BLOCK_M, num_warps): 16-byte vectors per thread, about 8 KB of a row per tile."""
    block_m = min(next_pow2(M), 8192 // element_size)
    block_t = max(1, min(64, 4096 // block_m))
    return block_t, block_m, 8 if block_t * block_m >= 4096 else 4


def push_rows(src_SM: torch.Tensor, slots_SK: torch.Tensor, out_RM: torch.Tensor,
              kept_counts_E: Optional[torch.Tensor] = None, capacity: Optional[int] = None,
              scores_SK: Optional[torch.Tensor] = None, y_RM: Optional[torch.Tensor] = None,
              dscores_SK: Optional[torch.Tensor] = None, renormalize: bool = False):
    """out[slots[s, j]] = (w[s, j] *) src[s], and rows no route reaches zeroed; with y given,
    dscores[s, j] = dL/dscores[s, j] from <src[s], y[slots[s, j]]> in fp32. w = scores, or with
    renormalize reference.renormalize_kept(scores, slots). The empty rows follow from kept_counts
    and capacity (None: dropless) when given, else from slots alone."""
    if renormalize and scores_SK is None:
        raise ValueError("push_rows: renormalize needs scores")
    S, M = src_SM.shape
    K = slots_SK.shape[1]
    R = out_RM.shape[0]
    block_t, block_m, warps = row_tile(M, src_SM.element_size())
    if M == 0 or S + R == 0:
        if dscores_SK is not None:
            dscores_SK.zero_()
        return
    layout = kept_counts_E is not None
    row_routes = invert_slots(slots_SK, R) if not layout else slots_SK
    E = kept_counts_E.numel() if layout else 1
    block_z = max(block_t, 64)
    n_token_blocks = triton.cdiv(S, block_t)
    grid = (n_token_blocks + triton.cdiv(R, block_z), )
    _push_rows_kernel[grid](src_SM, slots_SK, scores_SK if scores_SK is not None else src_SM,
                            y_RM if y_RM is not None else src_SM, row_routes,
                            kept_counts_E if layout else slots_SK, out_RM,
                            dscores_SK if dscores_SK is not None else src_SM,
                            S, M, R, n_token_blocks, capacity or 0, E, K=K, KP=next_pow2(K), BLOCK_T=block_t,
                            BLOCK_M=block_m, BLOCK_Z=block_z, BLOCK_E=next_pow2(E), LAYOUT=layout,
                            HAS_SCORES=scores_SK is not None, DOT=y_RM is not None, RENORM=renormalize,
                            **_renorm_args(src_SM.dtype), num_warps=warps)


def pull_rows(y_RM: torch.Tensor, slots_SK: torch.Tensor, out_SM: torch.Tensor,
              scores_SK: Optional[torch.Tensor] = None, renormalize: bool = False):
    """out[s] = sum_j (w[s, j] *) y[slots[s, j]], accumulated in fp32 (fp64 for fp64); w = scores,
    or with renormalize reference.renormalize_kept(scores, slots)."""
    if renormalize and scores_SK is None:
        raise ValueError("pull_rows: renormalize needs scores")
    S, M = out_SM.shape
    K = slots_SK.shape[1]
    block_t, block_m, warps = row_tile(M, y_RM.element_size())
    if S == 0 or M == 0:
        return
    _pull_rows_kernel[(triton.cdiv(S, block_t), )](
        y_RM, slots_SK, scores_SK if scores_SK is not None else y_RM, out_SM, S, M, y_RM.shape[0],
        K=K, KP=next_pow2(K), BLOCK_T=block_t, BLOCK_M=block_m, HAS_SCORES=scores_SK is not None,
        RENORM=renormalize, **_renorm_args(y_RM.dtype), num_warps=warps)
