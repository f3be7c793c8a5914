"""Triton kernels for assign_slots: expert ids [S, k] -> buffer rows [S, k], kept counts [E].

The building block is `expert_ranks`: for routes in a given order, the rank of each route among
the routes of its expert, by a two-pass blocked scan (per-block histograms, an exclusive prefix
over blocks, then an in-block cumsum). Integer only, so it is deterministic. Priority-based drop
policies (rts, probs) rank routes by a sort of (expert, priority) keys built by a kernel.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from ..reference import Slots, hash32
from .launch import next_pow2


@triton.jit
def _onehot_tile(ids_ptr, n, E, pid, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, BLOCK_E)
    e = tl.load(ids_ptr + offs, mask=offs < n, other=-1)
    onehot = ((e[:, None] == cols[None, :]) & (cols < E)[None, :]).to(tl.int32)
    return offs, cols, e, onehot


@triton.jit
def _histogram_kernel(ids_ptr, hist_ptr, n, E, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    pid = tl.program_id(0)
    _, cols, _, onehot = _onehot_tile(ids_ptr, n, E, pid, BLOCK, BLOCK_E)
    tl.store(hist_ptr + pid * E + cols, tl.sum(onehot, axis=0), mask=cols < E)


@triton.jit
def _rank_kernel(ids_ptr, offsets_ptr, rank_ptr, n, E, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    pid = tl.program_id(0)
    offs, cols, e, onehot = _onehot_tile(ids_ptr, n, E, pid, BLOCK, BLOCK_E)
    before = tl.cumsum(onehot, axis=0) - onehot  # earlier routes of the same expert in this block
    base = tl.load(offsets_ptr + pid * E + cols, mask=cols < E, other=0)
    rank = tl.sum(onehot * (before + base[None, :]), axis=1)
    tl.store(rank_ptr + offs, tl.where(e >= 0, rank, -1), mask=offs < n)


def _block_histograms(ids_R: torch.Tensor, E: int):
    block_e = next_pow2(E)
    block = max(16, min(256, 8192 // block_e))
    nblocks = max(1, triton.cdiv(ids_R.numel(), block))
    hist = torch.empty(nblocks, E, dtype=torch.int32, device=ids_R.device)
    _histogram_kernel[(nblocks, )](ids_R, hist, ids_R.numel(), E, BLOCK=block, BLOCK_E=block_e)
    return hist, block, block_e


def expert_counts(ids_R: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routes per expert [E] int32 of ids [R] (-1 = no route); bincount without its host sync."""
    return _block_histograms(ids_R, num_experts)[0].sum(dim=0, dtype=torch.int32)


def expert_ranks(ids_R: torch.Tensor, num_experts: int):
    """ids [R] int32 in the order that matters (-1 = no route) -> rank [R] int32 of each route among
    the routes of its expert (-1 for no route), and totals [E] int32."""
    hist, block, block_e = _block_histograms(ids_R, num_experts)
    inclusive = torch.cumsum(hist, dim=0, dtype=torch.int32)
    rank = torch.empty_like(ids_R)
    _rank_kernel[(hist.shape[0], )](ids_R, inclusive - hist, rank, ids_R.numel(), num_experts, BLOCK=block,
                                    BLOCK_E=block_e)
    return rank, inclusive[-1]


@triton.jit
def _hash32(x):
    """lowbias32 on int64 lanes holding 32-bit values; the multiplies are split in 16-bit halves
    exactly as reference.hash32 does, so both backends give the same bits."""
    x = x & 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = ((x * 0x352D) + (((x * 0x7FEB) & 0xFFFF) << 16)) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = ((x * 0xA68B) + (((x * 0x846C) & 0xFFFF) << 16)) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _priority_key_kernel(ids_ptr, scores_ptr, key_ptr, n, E, seed_mix, BLOCK: tl.constexpr, BY_SCORE: tl.constexpr):
    """key = expert * 2**32 + priority (smaller first); unrouted routes sort after every expert."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    e = tl.load(ids_ptr + offs, mask=mask, other=-1).to(tl.int64)
    e = tl.where(e >= 0, e, E)
    if BY_SCORE:
        # Order-preserving map of fp32 bits to uint32, inverted so that higher scores come first.
        bits = tl.load(scores_ptr + offs, mask=mask, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
        bits = bits.to(tl.int64) & 0xFFFFFFFF
        ordered = tl.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits | 0x80000000)
        prio = 0xFFFFFFFF - ordered
    else:
        prio = _hash32(offs.to(tl.int64) ^ seed_mix)
    tl.store(key_ptr + offs, (e << 32) | prio, mask=mask)


@triton.jit
def _place_kernel(ids_ptr, rank_ptr, kept_rank_ptr, offset_ptr, slots_ptr, n, C, DROPLESS: tl.constexpr,
                  BLOCK: tl.constexpr):
    """slot = offset[e] + rank (dropless) or e * C + kept_rank when kept (capacity), else -1."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    e = tl.load(ids_ptr + offs, mask=mask, other=-1)
    if DROPLESS:
        rank = tl.load(rank_ptr + offs, mask=mask, other=-1)
        slot = tl.load(offset_ptr + e, mask=mask & (e >= 0), other=0) + rank
    else:
        kept_rank = tl.load(kept_rank_ptr + offs, mask=mask, other=-1)
        slot = e * C + kept_rank
        rank = kept_rank
    tl.store(slots_ptr + offs, tl.where((e >= 0) & (rank >= 0), slot, -1), mask=mask)


@triton.jit
def _keep_kernel(ids_ptr, rank_ptr, kept_ids_ptr, n, C, BLOCK: tl.constexpr):
    """kept_ids = id where the route's selection rank is under capacity, else -1."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    e = tl.load(ids_ptr + offs, mask=mask, other=-1)
    rank = tl.load(rank_ptr + offs, mask=mask, other=-1)
    tl.store(kept_ids_ptr + offs, tl.where((rank >= 0) & (rank < C), e, -1), mask=mask)


_BLOCK = 1024


def _selection_rank(ids_R, scores_R, E, drop_policy, seed, S, k):
    """Rank of each route (token-major order r = s*k + j) among its expert's routes, in the order
    the drop policy keeps them."""
    R = ids_R.numel()
    if drop_policy == "position":
        # First choices of every token before any second choice: rank in choice-major order.
        rank_cm, _ = expert_ranks(ids_R.view(S, k).t().contiguous().view(-1), E)
        return rank_cm.view(k, S).t().reshape(-1)
    seed_mix = int(hash32(torch.tensor(seed & 0xFFFFFFFF, dtype=torch.int64)))
    keys = torch.empty(R, dtype=torch.int64, device=ids_R.device)
    _priority_key_kernel[(triton.cdiv(R, _BLOCK), )](ids_R, scores_R, keys, R, E, seed_mix, BLOCK=_BLOCK,
                                                     BY_SCORE=drop_policy == "probs")
    keys_sorted, order = torch.sort(keys, stable=True)
    # Routes of expert e occupy sorted positions [start_e, start_e + count_e); unrouted ones come
    # last and are never kept, whatever rank they get.
    counts = expert_counts(ids_R, E)
    start = torch.cumsum(counts, 0) - counts
    sorted_ids = (keys_sorted >> 32).clamp_max(E - 1)
    rank = torch.empty(R, dtype=torch.int32, device=ids_R.device)
    rank[order] = (torch.arange(R, device=ids_R.device) - start[sorted_ids]).to(torch.int32)
    return rank


def assign_slots(expert_ids_SK: torch.Tensor, scores_SK: torch.Tensor, num_experts: int,
                 capacity: Optional[int] = None, drop_policy: str = "position", seed: int = 0) -> Slots:
    S, k = expert_ids_SK.shape
    E = num_experts
    ids = expert_ids_SK.to(torch.int32).contiguous().view(-1)
    # Ids outside [0, E) route nowhere rather than index out of bounds.
    ids = torch.where((ids >= 0) & (ids < E), ids, -1)
    R = ids.numel()
    slots = torch.empty(R, dtype=torch.int32, device=ids.device)
    grid = (max(1, triton.cdiv(R, _BLOCK)), )
    if capacity is None:
        rank, counts = expert_ranks(ids, E)
        offset = torch.cumsum(counts, 0, dtype=torch.int32) - counts
        _place_kernel[grid](ids, rank, rank, offset, slots, R, 0, DROPLESS=True, BLOCK=_BLOCK)
        return Slots(slots.view(S, k), counts, R, None)
    rank = _selection_rank(ids, scores_SK.contiguous().view(-1), E, drop_policy, seed, S, k)
    kept_ids = torch.empty_like(ids)
    _keep_kernel[grid](ids, rank, kept_ids, R, capacity, BLOCK=_BLOCK)
    kept_rank, kept_counts = expert_ranks(kept_ids, E)
    _place_kernel[grid](kept_ids, kept_rank, kept_rank, kept_rank, slots, R, capacity, DROPLESS=False, BLOCK=_BLOCK)
    return Slots(slots.view(S, k), kept_counts, E * capacity, capacity)
