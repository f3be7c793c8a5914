"""Triton kernels for topk_gating: logits [S, E] -> top-k ids, scores, counts and loss partials.

One program owns BLOCK_S rows and all E columns, so a row's softmax, top-k and backward need no
communication between programs. Reductions across rows (counts, the aux and z losses) are written
as per-program partials and summed in a fixed order by a one-program kernel: deterministic, and
two launches for the whole forward.
"""
import torch
import triton
import triton.language as tl

from ..reference import aux_loss_coefficient, aux_loss_divisor
from .launch import acc_dtype, next_pow2, tl_dtype
from .rows import _column  # column j of a [rows, KP] tile


@triton.jit
def _tile_ptrs(logits_ptr, rows, cols, S, E, stride_s):
    """Pointers to the [BLOCK_S, BLOCK_E] tile of logits at rows x cols, and its in-bounds mask."""
    return logits_ptr + rows[:, None].to(tl.int64) * stride_s + cols[None, :], (rows < S)[:, None] & (cols < E)[None, :]


@triton.jit
def _row_probs(logits_ptr, rows, cols, S, E, stride_s, SIGMOID: tl.constexpr, ACC: tl.constexpr):
    """Loads a [BLOCK_S, BLOCK_E] tile; returns probs, softmax, logsumexp, valid rows, valid cells."""
    p, m2 = _tile_ptrs(logits_ptr, rows, cols, S, E, stride_s)
    x = tl.load(p, mask=m2, other=0.0).to(ACC)
    return _tile_probs(x, rows, cols, S, E, SIGMOID)


@triton.jit
def _tile_probs(x, rows, cols, S, E, SIGMOID: tl.constexpr):
    """probs, softmax, logsumexp, valid rows, valid cells of a loaded tile of logits x (its
    accumulation dtype). Rows with a NaN or Inf logit are invalid: they route nowhere and get no
    gradient."""
    rmask = rows < S
    cmask = cols < E
    m2 = rmask[:, None] & cmask[None, :]
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
def _topk(sel, probs, valid, cells, cols, K: tl.constexpr, KP: tl.constexpr, BLOCK_S: tl.constexpr,
          BLOCK_E: tl.constexpr, RENORM: tl.constexpr, ACC: tl.constexpr):
    """Top-k of BLOCK_S rows: K times the largest selection value sel among the valid cells not chosen
    yet, ties to the lower column; the score is probs there (sel may differ: gating's bias). Returns
    ids [BLOCK_S, KP] (-1 in invalid rows), scores [BLOCK_S, KP] (divided by their sum with RENORM),
    the chosen cells [BLOCK_S, BLOCK_E] and the first choices' cells."""
    ids_t = tl.full([BLOCK_S, KP], -1, tl.int32)
    sc_t = tl.zeros([BLOCK_S, KP], ACC)
    kcol = tl.arange(0, KP)
    chosen = tl.zeros([BLOCK_S, BLOCK_E], tl.int32)
    first = chosen
    for j in tl.static_range(K):
        # Among the experts not chosen yet (a mask, not -inf: -inf is a value an expert may hold).
        avail = cells & (chosen == 0)
        best = tl.max(tl.where(avail, sel, float("-inf")), axis=1)
        # The lowest column among equal maxima: ties go to the lower expert id.
        idx = tl.min(tl.where(avail & (sel == best[:, None]), cols[None, :], BLOCK_E), axis=1)
        hit = (cols[None, :] == idx[:, None]) & cells
        score = tl.sum(tl.where(hit, probs, 0.0), axis=1)
        ids_t = tl.where(kcol[None, :] == j, tl.where(valid, idx, -1)[:, None], ids_t)
        sc_t = tl.where(kcol[None, :] == j, score[:, None], sc_t)
        chosen += hit.to(tl.int32)
        if j == 0:
            first = chosen
    if RENORM:
        total = tl.sum(sc_t, axis=1)  # the columns past K hold 0
        # Correctly rounded division: for k = 1 a score is exactly 1, as in the reference.
        total = tl.where(total > 0, total, 1.0)[:, None]
        if ACC == tl.float32:
            sc_t = tl.div_rn(sc_t, total)
        else:
            sc_t = sc_t / total  # fp64 division is correctly rounded already
    return ids_t, sc_t, chosen, first


@triton.jit(do_not_specialize=["S", "E", "stride_s"])
def _gating_fwd_kernel(logits_ptr, bias_ptr, ids_ptr, scores_ptr, lse_ptr, partial_ptr, S, E, stride_s,
                       K: tl.constexpr, KP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr,
                       SIGMOID: tl.constexpr, RENORM: tl.constexpr, HAS_BIAS: tl.constexpr, ACC: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_E)
    kcol = tl.arange(0, KP)
    probs, _, lse, valid, cells = _row_probs(logits_ptr, rows, cols, S, E, stride_s, SIGMOID, ACC)
    tl.store(lse_ptr + rows, lse, mask=rows < S)
    # Per-block partials [4, E]: probability sums, route counts, first-choice counts, z-loss sum.
    part = partial_ptr + pid * 4 * E
    tl.store(part + cols, tl.sum(probs, axis=0), mask=cols < E)
    tl.store(part + 3 * E, tl.sum(lse * lse, axis=0))

    sel = probs
    if HAS_BIAS:
        sel = sel + tl.load(bias_ptr + cols, mask=cols < E, other=0.0).to(ACC)[None, :]
    # A NaN selection value (a NaN bias) ranks as -inf, as in the reference.
    sel = tl.where(cells & (sel == sel), sel, float("-inf"))
    ids_t, sc_t, chosen, first = _topk(sel, probs, valid, cells, cols, K, KP, BLOCK_S, BLOCK_E, RENORM, ACC)
    tl.store(part + E + cols, tl.sum(chosen.to(ACC), axis=0), mask=cols < E)
    tl.store(part + 2 * E + cols, tl.sum(first.to(ACC), axis=0), mask=cols < E)
    out = rows[:, None] * K + kcol[None, :]
    omask = (rows < S)[:, None] & (kcol < K)[None, :]
    tl.store(ids_ptr + out, ids_t, mask=omask)
    tl.store(scores_ptr + out, sc_t, mask=omask)


@triton.jit
def _aux_coefficient(coef, E, COEF_DIV: tl.constexpr, ACC: tl.constexpr):
    """reference.aux_loss_coefficient = E / COEF_DIV (aux_loss_divisor). A float argument reaches a
    kernel as fp32, so in fp64 it is formed here (64 / 6 rounded to fp32 was 3e-8 off: the sweep on
    the GPU)."""
    if ACC == tl.float64:
        coef = E.to(tl.float64) / COEF_DIV
    return coef


@triton.jit(do_not_specialize=["nblocks", "S", "E"])
def _gating_stats_kernel(partial_ptr, counts_ptr, ce_ptr, aux_ptr, z_ptr, nblocks, S, E, coef,
                         FIRST_ONLY: tl.constexpr, COEF_DIV: tl.constexpr, BLOCK_B: tl.constexpr,
                         BLOCK_E: tl.constexpr, ACC: tl.constexpr):
    """One program: sums the per-block partials in a fixed order (deterministic) into counts [E],
    ce [E] (the aux loss's fraction of routes), aux and z."""
    coef = _aux_coefficient(coef, E, COEF_DIV, ACC)
    cols = tl.arange(0, BLOCK_E)
    blocks = tl.arange(0, BLOCK_B)
    cmask = cols < E
    probsum = tl.zeros([BLOCK_E], ACC)
    counts = tl.zeros([BLOCK_E], ACC)
    first = tl.zeros([BLOCK_E], ACC)
    zsum = tl.zeros([BLOCK_B], ACC)
    for b0 in range(0, nblocks, BLOCK_B):
        b = b0 + blocks
        bmask = b < nblocks
        tile = partial_ptr + b[:, None] * 4 * E + cols[None, :]
        m2 = bmask[:, None] & cmask[None, :]
        probsum += tl.sum(tl.load(tile, mask=m2, other=0.0), axis=0)
        counts += tl.sum(tl.load(tile + E, mask=m2, other=0.0), axis=0)
        first += tl.sum(tl.load(tile + 2 * E, mask=m2, other=0.0), axis=0)
        zsum += tl.load(partial_ptr + b * 4 * E + 3 * E, mask=bmask, other=0.0)
    tl.store(counts_ptr + cols, counts.to(tl.int32), mask=cmask)
    if FIRST_ONLY:
        ce = first / S
    else:
        ce = counts / S
    tl.store(ce_ptr + cols, ce, mask=cmask)
    tl.store(aux_ptr, coef * tl.sum(probsum / S * ce, axis=0))
    tl.store(z_ptr, tl.sum(zsum, axis=0) / S)


@triton.jit(do_not_specialize=["S", "E", "stride_s"])
def _gating_bwd_kernel(logits_ptr, ids_ptr, grad_scores_ptr, lse_ptr, ce_ptr, g_aux_ptr, g_z_ptr,
                       grad_logits_ptr, S, E, stride_s, coef,
                       K: tl.constexpr, KP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr,
                       SIGMOID: tl.constexpr, RENORM: tl.constexpr, HAS_GS: tl.constexpr, HAS_AUX: tl.constexpr,
                       HAS_Z: tl.constexpr, COEF_DIV: tl.constexpr, ACC: tl.constexpr):
    pid = tl.program_id(0)
    coef = _aux_coefficient(coef, E, COEF_DIV, ACC)
    rows = pid * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_E)
    rmask = rows < S
    probs, softmax, lse, valid, cells = _row_probs(logits_ptr, rows, cols, S, E, stride_s, SIGMOID, ACC)

    # d loss / d probs. The aux term: d/dp_se of coef * sum_e (sum_s p_se / S) * ce_e, scaled by
    # 1/S per element here, before any sum.
    grad_p = tl.zeros_like(probs)
    direct = tl.zeros_like(probs)  # terms already taken through d probs / d logits
    if HAS_AUX:
        g_aux = tl.load(g_aux_ptr).to(ACC)
        ce = tl.load(ce_ptr + cols, mask=cols < E, other=0.0).to(ACC)
        grad_p += (g_aux * coef / S * ce)[None, :]
    if HAS_GS:
        kcol = tl.arange(0, KP)
        kmask = rmask[:, None] & (kcol < K)[None, :]
        g_t = tl.load(grad_scores_ptr + rows[:, None] * K + kcol[None, :], mask=kmask, other=0.0).to(ACC)
        e_t = tl.load(ids_ptr + rows[:, None] * K + kcol[None, :], mask=kmask, other=-1)
        if RENORM:
            # score_j = s_j = r_j / D, D = sum of the k chosen probs r. Through the logits directly:
            # d/dl_i = s_i (g_i - sum_j s_j g_j) (softmax: a softmax over the chosen logits), times
            # (1 - r_i) for sigmoid; never r / D^2, whose D^2 underflows in fp32 (NaN) when the
            # bias steers the choice to experts of tiny probability. Exactly 0 for k = 1.
            r_t = tl.zeros([BLOCK_S, KP], ACC)
            for j in tl.static_range(K):
                e_j = tl.sum(tl.where(kcol[None, :] == j, e_t, 0), axis=1)
                r_j = tl.sum(tl.where(cols[None, :] == e_j[:, None], probs, 0.0), axis=1)
                r_t = tl.where(kcol[None, :] == j, r_j[:, None], r_t)
            denom = tl.sum(r_t, axis=1)
            denom = tl.where(denom > 0, denom, 1.0)[:, None]
            # Correctly rounded, as in the forward: for k = 1, s = 1 and g - s g = 0 exactly (the
            # GPU's approximate fp32 division left ~1e-8 there; the interpreter and CUDA are exact).
            if ACC == tl.float32:
                s_t = tl.div_rn(r_t, denom)
            else:
                s_t = r_t / denom
            sg = tl.sum(s_t * g_t, axis=1)
        for i in tl.static_range(K):
            g_i = tl.sum(tl.where(kcol[None, :] == i, g_t, 0.0), axis=1)
            e_i = tl.sum(tl.where(kcol[None, :] == i, e_t, 0), axis=1)
            if RENORM:
                d_i = _column(s_t, kcol, i) * (g_i - sg)
                if SIGMOID:
                    d_i = d_i * (1.0 - _column(r_t, kcol, i))
                direct += tl.where(cols[None, :] == e_i[:, None], d_i[:, None], 0.0)
            else:
                grad_p += tl.where(cols[None, :] == e_i[:, None], g_i[:, None], 0.0)

    if SIGMOID:
        grad_l = grad_p * probs * (1.0 - probs) + direct
    else:
        grad_l = probs * (grad_p - tl.sum(probs * grad_p, axis=1)[:, None]) + direct
    if HAS_Z:
        # z-loss = sum_s lse_s^2 / S: d/dlogits = (2 / S) * lse * softmax.
        g_z = tl.load(g_z_ptr).to(ACC)
        grad_l += (g_z * 2.0 / S * lse)[:, None] * softmax
    grad_l = tl.where(cells, grad_l, 0.0)
    tl.store(grad_logits_ptr + rows[:, None].to(tl.int64) * stride_s + cols[None, :], grad_l,
             mask=rmask[:, None] & (cols < E)[None, :])


def _blocks(S: int, E: int):
    """(BLOCK_S, BLOCK_E, programs, num_warps) of the kernels whose program owns BLOCK_S whole rows."""
    block_e = next_pow2(E)
    block_s = max(1, min(64, 4096 // block_e, next_pow2(S)))
    return block_s, block_e, triton.cdiv(S, block_s), 4 if block_s * block_e <= 4096 else 8


def gating_forward(logits_SE: torch.Tensor, k: int, sigmoid: bool, renormalize: bool, bias_E=None):
    """Returns ids [S,k] int32, scores [S,k], counts [E] int32, ce [E] (the aux loss's route
    fractions), lse [S], aux and z (0-d)."""
    logits_SE = logits_SE.contiguous()
    S, E = logits_SE.shape
    acc = acc_dtype(logits_SE.dtype)
    dev = logits_SE.device
    block_s, block_e, nblocks, warps = _blocks(S, E)
    ids = torch.empty(S, k, dtype=torch.int32, device=dev)
    scores = torch.empty(S, k, dtype=acc, device=dev)
    lse = torch.empty(S, dtype=acc, device=dev)
    partials = torch.empty(max(nblocks, 1), 4, E, dtype=acc, device=dev)
    counts = torch.empty(E, dtype=torch.int32, device=dev)
    stats = torch.empty(E + 2, dtype=acc, device=dev)  # ce [E], aux, z
    if S > 0:
        _gating_fwd_kernel[(nblocks, )](
            logits_SE, bias_E if bias_E is not None else logits_SE, ids, scores, lse, partials,
            S, E, logits_SE.stride(0), K=k, KP=next_pow2(k), BLOCK_S=block_s, BLOCK_E=block_e,
            SIGMOID=sigmoid, RENORM=renormalize, HAS_BIAS=bias_E is not None, ACC=tl_dtype(acc),
            num_warps=warps)
    else:
        partials.zero_()
    _gating_stats_kernel[(1, )](partials, counts, stats, stats[E:], stats[E + 1:], max(nblocks, 1), max(S, 1), E,
                                aux_loss_coefficient(E, k), FIRST_ONLY=k <= 2, COEF_DIV=aux_loss_divisor(k),
                                BLOCK_B=max(1, 4096 // block_e),
                                BLOCK_E=block_e, ACC=tl_dtype(acc))
    return ids, scores, counts, stats[:E], lse, stats[E], stats[E + 1]


def gating_backward(logits_SE, ids, grad_scores, lse, ce_E, g_aux, g_z, sigmoid: bool, renormalize: bool):
    """grad_logits [S, E] in the dtype of logits. grad_scores, g_aux and g_z may be None (no
    gradient flows from them); g_aux and g_z stay on the device, so there is no host sync."""
    logits_SE = logits_SE.contiguous()
    S, E = logits_SE.shape
    k = ids.shape[1]
    block_s, block_e, nblocks, warps = _blocks(S, E)
    grad = torch.empty_like(logits_SE)
    if S > 0:
        _gating_bwd_kernel[(nblocks, )](
            logits_SE, ids, grad_scores.contiguous() if grad_scores is not None else lse, lse, ce_E,
            g_aux if g_aux is not None else lse, g_z if g_z is not None else lse, grad, S, E, logits_SE.stride(0),
            aux_loss_coefficient(E, k), K=k, KP=next_pow2(k), BLOCK_S=block_s, BLOCK_E=block_e, SIGMOID=sigmoid,
            RENORM=renormalize, HAS_GS=grad_scores is not None, HAS_AUX=g_aux is not None, HAS_Z=g_z is not None,
            COEF_DIV=aux_loss_divisor(k),
            ACC=tl_dtype(acc_dtype(logits_SE.dtype)), num_warps=warps)
    return grad
