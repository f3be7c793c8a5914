"""Triton kernels for topk_gating: logits [S, E] -> top-k ids, scores, counts and loss partials.

One program owns BLOCK_S rows and all E columns, so a row's softmax, top-k and backward need no
communication between programs. Counts are integer atomics (order-free, so deterministic);
float reductions across rows are written as per-program partials and summed by torch.
"""
import torch
import triton
import triton.language as tl

from .launch import acc_dtype, next_pow2, tl_dtype


@triton.jit
def _row_probs(logits_ptr, rows, cols, S, E, stride_s, SIGMOID: tl.constexpr, ACC: tl.constexpr):
    """Loads a [BLOCK_S, BLOCK_E] tile; returns probs, softmax, logsumexp, valid rows, valid cells.

    Rows with a NaN or Inf logit are invalid: they route nowhere and get no gradient.
    """
    rmask = rows < S
    cmask = cols < E
    m2 = rmask[:, None] & cmask[None, :]
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_s + cols[None, :], mask=m2, other=0.0).to(ACC)
    bad = (x != x) | (tl.abs(x) == float("inf"))
    valid = rmask & (tl.sum(tl.where(bad & m2, 1, 0), axis=1) == 0)
    cells = valid[:, None] & cmask[None, :]
    x = tl.where(cells, x, float("-inf"))
    mx = tl.max(x, axis=1)
    mx = tl.where(valid, mx, 0.0)
    ex = tl.exp(x - mx[:, None])  # exp(-inf) = 0 outside the valid cells
    den = tl.sum(ex, axis=1)
    den = tl.where(valid, den, 1.0)
    softmax = ex / den[:, None]
    lse = tl.where(valid, mx + tl.log(den), 0.0)
    if SIGMOID:
        probs = tl.where(cells, 1.0 / (1.0 + tl.exp(-x)), 0.0)
    else:
        probs = softmax
    return probs, softmax, lse, valid, cells


@triton.jit
def _gating_fwd_kernel(logits_ptr, bias_ptr, ids_ptr, scores_ptr, lse_ptr, probsum_ptr, counts_ptr, first_ptr,
                       S, E, stride_s,
                       K: tl.constexpr, KP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr,
                       SIGMOID: tl.constexpr, RENORM: tl.constexpr, HAS_BIAS: tl.constexpr, ACC: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_E)
    kcol = tl.arange(0, KP)
    probs, _, lse, valid, cells = _row_probs(logits_ptr, rows, cols, S, E, stride_s, SIGMOID, ACC)
    tl.store(lse_ptr + rows, lse, mask=rows < S)
    tl.store(probsum_ptr + pid * E + cols, tl.sum(probs, axis=0), mask=cols < E)

    sel = probs
    if HAS_BIAS:
        sel = sel + tl.load(bias_ptr + cols, mask=cols < E, other=0.0).to(ACC)[None, :]
    sel = tl.where(cells, sel, float("-inf"))
    ids_t = tl.full([BLOCK_S, KP], -1, tl.int32)
    sc_t = tl.zeros([BLOCK_S, KP], ACC)
    chosen = tl.zeros([BLOCK_S, BLOCK_E], tl.int32)
    for j in tl.static_range(K):
        best = tl.max(sel, axis=1)
        # The lowest column among equal maxima: ties go to the lower expert id.
        idx = tl.min(tl.where(sel == best[:, None], cols[None, :], BLOCK_E), axis=1)
        hit = (cols[None, :] == idx[:, None]) & cells
        score = tl.sum(tl.where(hit, probs, 0.0), axis=1)
        sel = tl.where(hit, float("-inf"), sel)
        ids_t = tl.where(kcol[None, :] == j, tl.where(valid, idx, -1)[:, None], ids_t)
        sc_t = tl.where(kcol[None, :] == j, score[:, None], sc_t)
        chosen += hit.to(tl.int32)
        if j == 0:
            tl.atomic_add(first_ptr + cols, tl.sum(hit.to(tl.int32), axis=0), mask=cols < E)
    tl.atomic_add(counts_ptr + cols, tl.sum(chosen, axis=0), mask=cols < E)
    if RENORM:
        total = tl.sum(sc_t, axis=1)
        sc_t = sc_t / tl.where(total > 0, total, 1.0)[:, None]
    out = rows[:, None] * K + kcol[None, :]
    omask = (rows < S)[:, None] & (kcol < K)[None, :]
    tl.store(ids_ptr + out, ids_t, mask=omask)
    tl.store(scores_ptr + out, sc_t, mask=omask)


@triton.jit
def _gating_bwd_kernel(logits_ptr, ids_ptr, scores_ptr, grad_scores_ptr, lse_ptr, aux_grad_ptr, z_coef_ptr,
                       grad_logits_ptr, S, E, stride_s,
                       K: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr,
                       SIGMOID: tl.constexpr, RENORM: tl.constexpr, ACC: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_E)
    rmask = rows < S
    probs, softmax, lse, valid, cells = _row_probs(logits_ptr, rows, cols, S, E, stride_s, SIGMOID, ACC)

    # d loss / d probs: aux-loss term (already scaled by coef * ce / S) plus the score gradients.
    grad_p = tl.load(aux_grad_ptr + cols, mask=cols < E, other=0.0).to(ACC)[None, :] + tl.zeros_like(probs)
    if RENORM:
        # score_j = p_j / D with D = sum of the k chosen p: dp_i = (g_i - sum_j g_j score_j) / D.
        gs_dot = tl.zeros([BLOCK_S], ACC)
        denom = tl.zeros([BLOCK_S], ACC)
        for j in tl.static_range(K):
            g = tl.load(grad_scores_ptr + rows * K + j, mask=rmask, other=0.0).to(ACC)
            sc = tl.load(scores_ptr + rows * K + j, mask=rmask, other=0.0).to(ACC)
            e = tl.load(ids_ptr + rows * K + j, mask=rmask, other=-1)
            gs_dot += g * sc
            denom += tl.sum(tl.where(cols[None, :] == e[:, None], probs, 0.0), axis=1)
        denom = tl.where(denom > 0, denom, 1.0)
    for j in tl.static_range(K):
        g = tl.load(grad_scores_ptr + rows * K + j, mask=rmask, other=0.0).to(ACC)
        e = tl.load(ids_ptr + rows * K + j, mask=rmask, other=-1)
        if RENORM:
            g = (g - gs_dot) / denom
        grad_p += tl.where(cols[None, :] == e[:, None], g[:, None], 0.0)

    if SIGMOID:
        grad_l = grad_p * probs * (1.0 - probs)
    else:
        grad_l = probs * (grad_p - tl.sum(probs * grad_p, axis=1)[:, None])
    # z-loss = sum_s lse_s^2 / S: d/dlogits = (2 / S) * lse * softmax; z_coef holds g_z * 2 / S.
    z_coef = tl.load(z_coef_ptr).to(ACC)
    grad_l += (z_coef * lse)[:, None] * softmax
    grad_l = tl.where(cells, grad_l, 0.0)
    tl.store(grad_logits_ptr + rows[:, None].to(tl.int64) * stride_s + cols[None, :], grad_l,
             mask=rmask[:, None] & (cols < E)[None, :])


def _blocks(S: int, E: int):
    block_e = next_pow2(E)
    block_s = max(1, min(64, 4096 // block_e, next_pow2(S)))
    return block_s, block_e, triton.cdiv(S, block_s)


def gating_forward(logits_SE: torch.Tensor, k: int, sigmoid: bool, renormalize: bool, bias_E=None):
    """Returns ids [S,k] int32, scores [S,k], counts [E] int32, first-choice counts [E] int32,
    lse [S] and the per-row-block probability sums [nblocks, E] (for the aux loss)."""
    logits_SE = logits_SE.contiguous()
    S, E = logits_SE.shape
    acc = acc_dtype(logits_SE.dtype)
    dev = logits_SE.device
    block_s, block_e, nblocks = _blocks(S, E)
    ids = torch.empty(S, k, dtype=torch.int32, device=dev)
    scores = torch.empty(S, k, dtype=acc, device=dev)
    lse = torch.empty(S, dtype=acc, device=dev)
    probsum = torch.empty(nblocks, E, dtype=acc, device=dev)
    counts = torch.zeros(2, E, dtype=torch.int32, device=dev)
    if S > 0:
        _gating_fwd_kernel[(nblocks, )](
            logits_SE, bias_E if bias_E is not None else logits_SE, ids, scores, lse, probsum, counts[0], counts[1],
            S, E, logits_SE.stride(0), K=k, KP=next_pow2(k), BLOCK_S=block_s, BLOCK_E=block_e,
            SIGMOID=sigmoid, RENORM=renormalize, HAS_BIAS=bias_E is not None, ACC=tl_dtype(acc),
            num_warps=4 if block_s * block_e <= 4096 else 8)
    return ids, scores, counts[0], counts[1], lse, probsum


def gating_backward(logits_SE, ids, scores, grad_scores, lse, aux_grad_E, z_coef, sigmoid: bool, renormalize: bool):
    """grad_logits [S, E] in the dtype of logits; aux_grad_E [E] and z_coef [1] are device tensors."""
    logits_SE = logits_SE.contiguous()
    S, E = logits_SE.shape
    k = ids.shape[1]
    block_s, block_e, nblocks = _blocks(S, E)
    grad = torch.empty_like(logits_SE)
    if S > 0:
        _gating_bwd_kernel[(nblocks, )](
            logits_SE, ids, scores, grad_scores.contiguous(), lse, aux_grad_E, z_coef, grad, S, E, logits_SE.stride(0),
            K=k, BLOCK_S=block_s, BLOCK_E=block_e, SIGMOID=sigmoid, RENORM=renormalize,
            ACC=tl_dtype(acc_dtype(logits_SE.dtype)), num_warps=4 if block_s * block_e <= 4096 else 8)
    return grad
