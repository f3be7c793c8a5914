"""Triton kernels for assign_slots: expert ids [S, k] -> buffer rows [S, k], kept counts [E].

The building block is a blocked rank: for routes in a given order (token-major r = s*k + j, or
choice-major: every first choice before any second), the rank of each route among the routes of
its expert. Pass 1 writes per-block expert histograms; torch's cumsum turns them into prefixes
over blocks; pass 2 ranks inside each block with a cumsum over a one-hot tile and writes either
the rank or the final slot. Integer only, so deterministic. Priority drop policies (rts, probs)
sort (expert, priority) keys and keep the first C of each expert.
Ids outside [0, E) route nowhere, checked inside the kernels (no host sync).
"""
import torch
import triton
import triton.language as tl

from ..reference import Slots, hash32_int
from .launch import next_pow2

SELECT, CAPACITY, DROPLESS = 0, 1, 2  # what the rank pass writes


@triton.jit
def _route_tile(ids_ptr, sel_ptr, n, S, K, E, C, pid, CHOICE_MAJOR: tl.constexpr, HAS_SEL: tl.constexpr,
                BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    """Positions pid*BLOCK.. in the chosen order -> their routes r, expert ids e (-1 = none, or not
    selected when sel is given: kept iff sel[r] < C) and the one-hot tile [BLOCK, BLOCK_E]."""
    i = pid * BLOCK + tl.arange(0, BLOCK)
    if CHOICE_MAJOR:
        r = (i % S) * K + i // S
    else:
        r = i
    e = tl.load(ids_ptr + r, mask=i < n, other=-1)
    e = tl.where((e >= 0) & (e < E), e, -1).to(tl.int32)  # range-checked before narrowing
    if HAS_SEL:
        e = tl.where(tl.load(sel_ptr + r, mask=i < n, other=C) < C, e, -1)
    cols = tl.arange(0, BLOCK_E)
    onehot = (e[:, None] == cols[None, :]).to(tl.int32)
    return i, r, cols, e, onehot


@triton.jit(do_not_specialize=["n", "S", "E", "C"])
def _histogram_kernel(ids_ptr, sel_ptr, hist_ptr, n, S, E, C, K: tl.constexpr, CHOICE_MAJOR: tl.constexpr,
                      HAS_SEL: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    pid = tl.program_id(0)
    _, _, cols, _, onehot = _route_tile(ids_ptr, sel_ptr, n, S, K, E, C, pid, CHOICE_MAJOR, HAS_SEL, BLOCK, BLOCK_E)
    tl.store(hist_ptr + pid * E + cols, tl.sum(onehot, axis=0), mask=cols < E)


@triton.jit(do_not_specialize=["n", "S", "E", "C", "last_block"])
def _rank_kernel(ids_ptr, sel_ptr, inclusive_ptr, out_ptr, n, S, E, C, last_block, K: tl.constexpr,
                 CHOICE_MAJOR: tl.constexpr, HAS_SEL: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr,
                 BLOCK_E: tl.constexpr):
    pid = tl.program_id(0)
    i, r, cols, e, onehot = _route_tile(ids_ptr, sel_ptr, n, S, K, E, C, pid, CHOICE_MAJOR, HAS_SEL, BLOCK,
                                        BLOCK_E)
    # Routes of the same expert in earlier blocks, then earlier in this block.
    before = tl.load(inclusive_ptr + pid * E + cols, mask=cols < E, other=0) - tl.sum(onehot, axis=0)
    rank = tl.sum(onehot * (tl.cumsum(onehot, axis=0) - 1 + before[None, :]), axis=1)
    routed = e >= 0
    if MODE == 0:  # selection rank: kept iff < C
        out = tl.where(routed, rank, C)
    elif MODE == 1:  # capacity: expert e owns rows [e*C, (e+1)*C)
        out = tl.where(routed, e * C + rank, -1)
    else:  # dropless: expert e owns rows from the sum of the counts of experts before it
        totals = tl.load(inclusive_ptr + last_block * E + cols, mask=cols < E, other=0)
        offset = tl.cumsum(totals, axis=0) - totals
        out = tl.where(routed, tl.sum(tl.where(cols[None, :] == e[:, None], offset[None, :], 0), axis=1) + rank, -1)
    tl.store(out_ptr + r, out, mask=i < n)


def _ranks(ids_R, sel_R, E: int, C: int, S: int, k: int, choice_major: bool, mode: int):
    """One rank pass over R = S*k routes -> out [R] int32 (per mode) and totals [E] int32."""
    R = ids_R.numel()
    S = max(S, 1)  # with no routes the kernels still take i % S (masked): keep it defined
    block_e = next_pow2(E)
    block = max(16, min(1024, 16384 // block_e))
    nblocks = max(1, triton.cdiv(R, block))
    hist = torch.empty(nblocks, E, dtype=torch.int32, device=ids_R.device)
    meta = dict(K=k, CHOICE_MAJOR=choice_major, HAS_SEL=sel_R is not None, BLOCK=block, BLOCK_E=block_e,
                num_warps=8 if block * block_e >= 8192 else 4)
    sel = sel_R if sel_R is not None else ids_R
    _histogram_kernel[(nblocks, )](ids_R, sel, hist, R, S, E, C, **meta)
    inclusive = torch.cumsum(hist, dim=0, dtype=torch.int32)
    out = torch.empty(R, dtype=torch.int32, device=ids_R.device)
    _rank_kernel[(nblocks, )](ids_R, sel, inclusive, out, R, S, E, C, nblocks - 1, MODE=mode, **meta)
    return out, inclusive[-1]


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


@triton.jit(do_not_specialize=["n", "E", "seed_mix"])
def _priority_key_kernel(ids_ptr, scores_ptr, key_ptr, n, E, seed_mix, BLOCK: tl.constexpr, BY_SCORE: tl.constexpr):
    """key = expert * 2**32 + priority (smaller first); unrouted routes sort after every expert."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    e = tl.load(ids_ptr + offs, mask=mask, other=-1).to(tl.int64)
    e = tl.where((e >= 0) & (e < E), e, E)
    if BY_SCORE:
        # Order-preserving map of fp32 bits to uint32, inverted so that higher scores come first.
        # As the reference: NaN ranks as -inf, and -0.0 as +0.0 (equal scores tie).
        score = tl.load(scores_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        score = tl.where(score == score, score, float("-inf"))
        score = tl.where(score == 0.0, 0.0, score)
        bits = score.to(tl.int32, bitcast=True)
        bits = bits.to(tl.int64) & 0xFFFFFFFF
        ordered = tl.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits | 0x80000000)
        prio = 0xFFFFFFFF - ordered
    else:
        prio = _hash32(offs.to(tl.int64) ^ seed_mix)
    tl.store(key_ptr + offs, (e << 32) | prio, mask=mask)


@triton.jit(do_not_specialize=["n", "C"])
def _select_kernel(keys_ptr, order_ptr, sel_ptr, n, C, BLOCK: tl.constexpr):
    """Sorted keys group the routes by expert: position i is among its expert's first C exactly
    when i < C or the key C places earlier belongs to another expert. sel = 0 kept, C dropped."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    e = tl.load(keys_ptr + i, mask=mask, other=0) >> 32
    e_before = tl.load(keys_ptr + i - C, mask=mask & (i >= C), other=-1) >> 32
    kept = (i < C) | (e_before != e)
    tl.store(sel_ptr + tl.load(order_ptr + i, mask=mask, other=0), tl.where(kept, 0, C), mask=mask)


_BLOCK = 1024


def _priority_selection(ids_R, scores_R, E, C, drop_policy, seed):
    """sel [R]: 0 for routes among the first C of their expert by priority, else C."""
    R = ids_R.numel()
    keys = torch.empty(R, dtype=torch.int64, device=ids_R.device)
    grid = (max(1, triton.cdiv(R, _BLOCK)), )
    _priority_key_kernel[grid](ids_R, scores_R, keys, R, E, hash32_int(seed), BLOCK=_BLOCK,
                               BY_SCORE=drop_policy == "probs")
    keys_sorted, order = torch.sort(keys, stable=True)
    sel = torch.empty(R, dtype=torch.int32, device=ids_R.device)
    _select_kernel[grid](keys_sorted, order, sel, R, C, BLOCK=_BLOCK)
    return sel


def assign_slots(expert_ids_SK: torch.Tensor, scores_SK: torch.Tensor, num_experts: int,
                 capacity=None, drop_policy: str = "position", seed: int = 0) -> Slots:
    S, k = expert_ids_SK.shape
    E = num_experts
    ids = expert_ids_SK.contiguous().view(-1)
    if capacity is None:
        slots, counts = _ranks(ids, None, E, 0, S, k, False, DROPLESS)
        return Slots(slots.view(S, k), counts, S * k, None)
    if drop_policy == "position":
        # First choices of every token before any second choice: rank in choice-major order.
        sel, _ = _ranks(ids, None, E, capacity, S, k, True, SELECT)
    else:
        sel = _priority_selection(ids, scores_SK.contiguous().view(-1), E, capacity, drop_policy, seed)
    slots, kept_counts = _ranks(ids, sel, E, capacity, S, k, False, CAPACITY)
    return Slots(slots.view(S, k), kept_counts, E * capacity, capacity)
