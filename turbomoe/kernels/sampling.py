"""Triton kernels of top-2's second expert as DeepSpeed picks it (spec: reference.second_expert; the
CUDA backend's: csrc/sampling.cu): the argmax over the experts other than the first of the logits,
plus Gumbel noise where sampled, and its probability p2 = p1 * exp(l2 - l1); one launch each way.

The noise is made by reference.gumbel_noise, in PyTorch, before the launch: Triton's fp32 log is an
approximate instruction on the GPU, and the noise must be stock's bits (the same uniforms pick the
same experts). The argmax is torch.argmax's over the logits with the first expert's set to -inf: NaN
counts as the largest, ties go to the lower column. One program owns BLOCK_S rows and all E columns,
as the gating kernels do.
"""
import torch
import triton
import triton.language as tl

from .. import reference
from ..reference import as_contiguous
from .gating import _blocks


@triton.jit(do_not_specialize=["S"])
def _second_expert_fwd_kernel(logits_ptr, noise_ptr, first_ptr, first_score_ptr, ids_ptr, scores_ptr, counts_ptr,
                              S, E, NOISE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
    r_ok = rows < S
    cols = tl.arange(0, BLOCK_E)
    c_ok = cols < E
    tile = rows[:, None] * E + cols[None, :]
    f = tl.load(first_ptr + rows, mask=r_ok, other=-1)
    v = tl.load(logits_ptr + tile, mask=r_ok[:, None] & c_ok[None, :], other=0.0)
    if NOISE:
        v += tl.load(noise_ptr + tile, mask=r_ok[:, None] & c_ok[None, :], other=0.0).to(v.dtype)
    v = tl.where(cols[None, :] == f[:, None], float("-inf"), v)
    nan = (v != v) & c_ok[None, :]
    nan_col = tl.min(tl.where(nan, cols[None, :], BLOCK_E), axis=1)
    top = tl.max(tl.where(c_ok[None, :] & ~nan, v, float("-inf")), axis=1)
    top_col = tl.min(tl.where(c_ok[None, :] & (v == top[:, None]), cols[None, :], BLOCK_E), axis=1)
    routed = r_ok & (f >= 0)
    second = tl.where(routed, tl.where(nan_col < BLOCK_E, nan_col, top_col), -1)
    p1 = tl.load(first_score_ptr + rows, mask=r_ok, other=0.0)
    l1 = tl.load(logits_ptr + rows * E + f, mask=routed, other=0.0)
    l2 = tl.load(logits_ptr + rows * E + second, mask=routed, other=0.0)
    p2 = tl.where(routed, p1 * tl.exp(l2 - l1), 0.0)
    tl.store(ids_ptr + rows * 2, f, mask=r_ok)
    tl.store(ids_ptr + rows * 2 + 1, second.to(tl.int32), mask=r_ok)
    tl.store(scores_ptr + rows * 2, p1, mask=r_ok)
    tl.store(scores_ptr + rows * 2 + 1, p2, mask=r_ok)
    # the program's own counts first, then one integer add per expert: a row an atomic put thousands on a few
    # counters (the same counts in any order)
    n = tl.sum((routed[:, None] & (cols[None, :] == second[:, None])).to(tl.int32), axis=0)
    tl.atomic_add(counts_ptr + cols, n, mask=c_ok & (n > 0))


@triton.jit(do_not_specialize=["S"])
def _second_expert_bwd_kernel(logits_ptr, ids_ptr, first_score_ptr, g_ptr, g_logits_ptr, g_first_ptr, S, E,
                              BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
    r_ok = rows < S
    cols = tl.arange(0, BLOCK_E)
    f = tl.load(ids_ptr + rows * 2, mask=r_ok, other=-1)
    e2 = tl.load(ids_ptr + rows * 2 + 1, mask=r_ok, other=-1)
    g1 = tl.load(g_ptr + rows * 2, mask=r_ok, other=0.0)
    g2 = tl.load(g_ptr + rows * 2 + 1, mask=r_ok, other=0.0)
    routed = r_ok & (e2 >= 0)
    r = tl.exp(tl.load(logits_ptr + rows * E + e2, mask=routed, other=0.0)
               - tl.load(logits_ptr + rows * E + f, mask=routed, other=0.0))
    # p2 = p1 * r: d l2 = g2 * p2, d l1 = -g2 * p2 (their sum where the second is the first), d p1 = g1 + g2 * r
    d = tl.where(routed, g2 * tl.load(first_score_ptr + rows, mask=r_ok, other=0.0) * r, 0.0)
    tl.store(g_first_ptr + rows, tl.where(routed, g1 + g2 * r, g1), mask=r_ok)
    g = tl.where(cols[None, :] == e2[:, None], d[:, None], 0.0) - tl.where(cols[None, :] == f[:, None], d[:, None], 0.0)
    tl.store(g_logits_ptr + rows[:, None] * E + cols[None, :], g.to(g_logits_ptr.dtype.element_ty),
             mask=r_ok[:, None] & (cols < E)[None, :])


def second_expert_forward(logits_SE, first_ids_S1, first_scores_S1, counts_E, rand_SE):
    """ids [S, 2] int32 (first, second; -1 where the first is), scores [S, 2] (p1, p2), counts [E] int32
    with the second choices added; rand [S, E] fp32 uniforms, or None (the best other logit)."""
    logits_SE = logits_SE.contiguous()
    S, E = logits_SE.shape
    noise = None if rand_SE is None else reference.gumbel_noise(as_contiguous(rand_SE, torch.float32))
    ids = torch.empty(S, 2, dtype=torch.int32, device=logits_SE.device)
    scores = torch.empty(S, 2, dtype=logits_SE.dtype, device=logits_SE.device)
    counts = counts_E.to(torch.int32, copy=True).contiguous()
    block_s, block_e, nblocks, warps = _blocks(S, E)
    if S:
        _second_expert_fwd_kernel[(nblocks, )](
            logits_SE, logits_SE if noise is None else noise, as_contiguous(first_ids_S1, torch.int32),
            as_contiguous(first_scores_S1, logits_SE.dtype), ids, scores, counts, S, E, NOISE=noise is not None,
            BLOCK_S=block_s, BLOCK_E=block_e, num_warps=warps)
    return ids, scores, counts


def second_expert_backward(logits_SE, ids_S2, first_scores_S1, grad_scores_S2):
    """grad_logits [S, E] (two entries a routed row) and the first scores' gradient [S]."""
    logits_SE = logits_SE.contiguous()
    S, E = logits_SE.shape
    g_logits = torch.empty_like(logits_SE)
    g_first = torch.empty(S, dtype=logits_SE.dtype, device=logits_SE.device)
    block_s, block_e, nblocks, warps = _blocks(S, E)
    if S:
        _second_expert_bwd_kernel[(nblocks, )](
            logits_SE, as_contiguous(ids_S2, torch.int32), as_contiguous(first_scores_S1, logits_SE.dtype),
            as_contiguous(grad_scores_S2, logits_SE.dtype), g_logits, g_first, S, E, BLOCK_S=block_s,
            BLOCK_E=block_e, num_warps=warps)
    return g_logits, g_first
