"""The specification of every turbomoe op, in plain PyTorch.

This module is the test oracle and the CPU path. It favours clarity over speed: it may build
[S, E] one-hot tensors, which the kernels never do. Everything here is differentiable through
torch autograd, which is how the hand-written backward passes are checked.

The four tables (S tokens, E experts, k choices per token):
  expert_ids [S, k] int32  experts each token chose, best first; -1 for a token with no route
  scores     [S, k] fp32   router score of each choice (renormalised over the k where asked)
  counts     [E]    int32  routes per expert (before capacity; after it for kept counts)
  slots      [S, k] int32  row of each route in the expert buffer; -1 when dropped
"""
import math
import os
import struct
from typing import NamedTuple, Optional

import torch

SCORE_FUNCS = ("softmax", "sigmoid")
DROP_POLICIES = ("rts", "position", "probs")


class GatingOutput(NamedTuple):
    expert_ids: torch.Tensor  # [S, k] int32, -1 for rows with non-finite logits
    scores: torch.Tensor  # [S, k] fp32 (fp64 for fp64 logits)
    counts: torch.Tensor  # [E] int32, routes per expert
    aux_loss: torch.Tensor  # scalar, DeepSpeed's load-balancing loss
    z_loss: torch.Tensor  # scalar, mean over tokens of logsumexp(logits)^2


class Slots(NamedTuple):
    slots: torch.Tensor  # [S, k] int32, -1 when dropped or unrouted
    kept_counts: torch.Tensor  # [E] int32, routes kept per expert
    num_rows: int  # rows of the expert buffer: E * C, or S * k when dropless
    capacity: Optional[int]  # C, or None when dropless


def debug_checks(t: torch.Tensor) -> bool:
    """Whether the ops' checks that read tensor values run: always for CPU tensors (no device to wait
    for), on a GPU only in debug mode (TURBOMOE_DEBUG=1), since reading a value there is a host sync."""
    return t.device.type == "cpu" or os.environ.get("TURBOMOE_DEBUG") == "1"


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Routing math runs in fp32, or fp64 when the caller works in fp64 (gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def as_contiguous(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """t in dtype and contiguous; t itself when it already is (the kernel launchers' hot path: a
    no-op .to() still costs a dispatcher call)."""
    if t is None or (t.dtype == dtype and t.is_contiguous()):
        return t
    return t.to(dtype).contiguous()


def capacity(num_tokens: int, num_experts: int, k: int, capacity_factor: float, min_capacity: int = 0) -> int:
    """DeepSpeed's expert capacity formula: ceil(S / E * capacity_factor * k), at least min_capacity,
    in fp64 (S may be symbolic under torch.compile). DeepSpeed itself rounds in fp32, which can give
    one more or one less where the product lies within fp32's rounding of an integer:
    deepspeed_capacity."""
    return max(math.ceil(num_tokens / num_experts * capacity_factor * k), min_capacity)


def deepspeed_capacity(num_tokens: int, num_experts: int, k: int, capacity_factor: float,
                       min_capacity: int = 0) -> int:
    """capacity as DeepSpeed's _capacity rounds it: (S / E) * torch.tensor(capacity_factor * k) in
    fp32 (both factors rounded to fp32, their product rounded once), so that the drop-in keeps the
    tokens stock keeps (S = 25, E = 2, factor 1.2: 16 where fp64 gives 15). Concrete ints only."""
    product = _fp32(_fp32(num_tokens / num_experts) * _fp32(capacity_factor * k))  # exact in fp64, then rounded
    return max(math.ceil(product), min_capacity)


def _fp32(value: float) -> float:
    """value rounded to the nearest fp32 (ties to even), as torch.tensor(value) stores it."""
    return struct.unpack("f", struct.pack("f", value))[0]


def nan_ranks_last(values: torch.Tensor) -> torch.Tensor:
    """values with NaN as -inf (infinities kept): the rule by which every backend ranks a NaN."""
    return torch.nan_to_num(values, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))


def aux_loss_coefficient(num_experts: int, k: int) -> float:
    """DeepSpeed's l_aux = coef * sum_e me_e * ce_e (sharded_moe top1/top2/topk gating).

    k = 1 and k = 2 count only first choices in ce and use coef = E; general k counts every choice
    and uses coef = E / k.
    """
    return num_experts / aux_loss_divisor(k)


def aux_loss_divisor(k: int) -> int:
    """aux_loss_coefficient = E / aux_loss_divisor(k) (the kernels form it so in fp64)."""
    return 1 if k <= 2 else k


def renormalize_chosen(r_SK: torch.Tensor, logits_SK: torch.Tensor, score_func: str) -> torch.Tensor:
    """The chosen probabilities r over their sum D (D > 0, else 1: as in the kernels), with the
    kernels' gradient: through the chosen logits as a softmax over log r, d/dl_i = s_i (g_i - sum_j
    s_j g_j) (times 1 - r_i for sigmoid). Autograd through r / D instead forms g s / D, which
    overflows in fp32 when a selection bias steers the choice to experts of subnormal probability."""
    total = r_SK.detach().sum(dim=1, keepdim=True)
    value = r_SK.detach() / torch.where(total > 0, total, 1.0)
    log_r = logits_SK if score_func == "softmax" else torch.nn.functional.logsigmoid(logits_SK)
    stable = torch.softmax(log_r, dim=1)  # = value up to rounding; only its gradient is used
    return torch.where(total > 0, value + (stable - stable.detach()), r_SK)  # D = 0: r / 1


def topk_gating(logits_SE: torch.Tensor,
                k: int,
                score_func: str = "softmax",
                renormalize: bool = False,
                selection_bias_E: Optional[torch.Tensor] = None) -> GatingOutput:
    """Router scores, top-k choices, counts, aux loss and z-loss.

    probs = softmax(logits) or sigmoid(logits), in fp32. The k experts with the largest
    probs (+ selection_bias, which steers the choice but not the score) are chosen, best first,
    ties to the lower expert id; a NaN selection value ranks as -inf. Rows whose logits are not all
    finite route nowhere (ids -1, scores 0) and add nothing to the losses or counts. The losses are
    means over max(S, 1) tokens: 0 when S = 0.
    """
    S, E = logits_SE.shape
    acc = compute_dtype(logits_SE.dtype)
    logits = logits_SE.to(acc)
    finite_S = torch.isfinite(logits).all(dim=1)
    logits = torch.where(finite_S[:, None], logits, torch.zeros_like(logits))
    probs = torch.softmax(logits, dim=1) if score_func == "softmax" else torch.sigmoid(logits)
    probs = probs * finite_S[:, None]

    select = probs if selection_bias_E is None else probs + selection_bias_E.to(acc)
    # A NaN selection value (a NaN bias) ranks as -inf: such an expert is chosen only after every
    # expert with a number. +0.0 and -0.0 are equal.
    select = nan_ranks_last(select)
    # Stable descending sort: among equal values the lower expert id comes first.
    ids = torch.sort(select.detach(), dim=1, descending=True, stable=True).indices[:, :k]
    scores = probs.gather(1, ids)
    if renormalize:
        scores = renormalize_chosen(scores, logits.gather(1, ids), score_func)
    ids = torch.where(finite_S[:, None], ids, torch.full_like(ids, -1))
    scores = scores * finite_S[:, None]

    onehot_SKE = torch.nn.functional.one_hot(ids.clamp_min(0), E) * (ids >= 0)[..., None]
    counts = onehot_SKE.sum(dim=(0, 1))
    counted = onehot_SKE[:, :1] if k <= 2 else onehot_SKE
    n = max(S, 1)  # S = 0: the means of nothing are 0 (aux and z losses 0, with zero gradient)
    ce = counted.sum(dim=(0, 1)).to(acc) / n
    me = probs.sum(dim=0) / n
    aux = aux_loss_coefficient(E, k) * (me * ce).sum()
    lse = torch.logsumexp(logits, dim=1) * finite_S
    z = (lse * lse).sum() / n
    return GatingOutput(ids.to(torch.int32), scores, counts.to(torch.int32), aux, z)


def gumbel_noise(rand_SE: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise from fp32 uniforms in [0, 1) (the output of torch.rand), rounded op by op
    as torch.distributions.Gumbel(0, 1).rsample turns its own torch.rand draw into noise: so the
    same uniforms give the same noise as DeepSpeed's gumbel_rsample."""
    finfo = torch.finfo(torch.float32)
    # Python scalars, not the distribution's 0-dim device tensors: those are host-to-device copies, which a
    # CUDA graph cannot capture. Both forms round to the same fp32 values (tiny vanishes beside 1 - eps).
    low, high = finfo.tiny, 1 - finfo.eps
    u = low + rand_SE * (high - low)
    return -(-u.log()).log()


def count_routes(ids_SK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """counts [E] int32 of the routed entries of ids (-1 skipped); scatter_add, so no host sync."""
    ids = ids_SK.reshape(-1).long()
    routed = (ids >= 0).to(torch.int32)
    return torch.zeros(num_experts, dtype=torch.int32, device=ids.device).scatter_add_(0, ids.clamp_min(0), routed)


def score_of_other_expert(first_scores_S1: torch.Tensor, logits_SE: torch.Tensor, first_S1: torch.Tensor,
                          other_S1: torch.Tensor) -> torch.Tensor:
    """softmax(logits)[other] = p_first * exp(l_other - l_first) [S, 1], differentiable in logits
    and p_first, without the softmax; 0 where other is -1. l_other <= l_first when first is the
    argmax, so the exp cannot overflow; rows that route nowhere may hold inf, and their inf - inf
    stays out of exp and its gradient."""
    first, other = first_S1.long(), other_S1.long()
    routed = other >= 0
    diff = torch.where(routed, logits_SE.gather(1, other.clamp_min(0)) - logits_SE.gather(1, first.clamp_min(0)), 0.0)
    return torch.where(routed, first_scores_S1 * torch.exp(diff), 0.0)


def second_expert(logits_SE: torch.Tensor, first_ids_S1: torch.Tensor, first_scores_S1: torch.Tensor,
                  counts_E: torch.Tensor, rand_SE: Optional[torch.Tensor]):
    """Top-2 gating's second expert as DeepSpeed picks it: the argmax of logits + Gumbel noise
    (top2_2nd_expert_sampling), or of the logits alone (rand None), over the experts other than the
    first choice (ties to the lower id), and its router probability p2 = p1 * exp(l2 - l1),
    differentiable in logits and p1.

    logits [S, E] fp32 or fp64; first_ids [S, 1] (-1: no route, then no second either);
    first_scores [S, 1] = p1; counts [E] of the first choices; rand [S, E] fp32 uniforms or None.
    Returns ids [S, 2] int32, scores [S, 2] (p1, p2) and counts [E] int32 with the second choices.
    With E = 1 the second is the first again (the others are all -inf), as stock's top-2 has it.
    """
    first = first_ids_S1.long()
    noisy = logits_SE.detach() if rand_SE is None else logits_SE.detach() + gumbel_noise(rand_SE).to(logits_SE.dtype)
    noisy = noisy.scatter(1, first.clamp_min(0), float("-inf"))
    second = torch.where(first >= 0, noisy.argmax(1, keepdim=True), first)
    p2 = score_of_other_expert(first_scores_S1, logits_SE, first, second)
    counts = counts_E.to(torch.int32) + count_routes(second, logits_SE.shape[1])
    return torch.cat([first, second], 1).to(torch.int32), torch.cat([first_scores_S1, p2], 1), counts


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), split in 16-bit halves so int64 never overflows."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & 0xFFFFFFFF


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (lowbias32); int64 in, int64 in [0, 2**32) out."""
    x = x & 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def hash32_int(x: int) -> int:
    """hash32 of one Python int (exact: Python ints do not overflow), to mix a seed on the host."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def rts_priority(num_routes: int, seed: int, device=None) -> torch.Tensor:
    """Random priority of route r = s * k + j for random token selection: a bijection of r, so
    no two routes tie, and the same seed gives the same priorities on every backend."""
    r = torch.arange(num_routes, dtype=torch.int64, device=device)
    return hash32(r ^ hash32_int(seed))


def assign_slots(expert_ids_SK: torch.Tensor,
                 scores_SK: torch.Tensor,
                 num_experts: int,
                 capacity: Optional[int] = None,
                 drop_policy: str = "position",
                 seed: int = 0) -> Slots:
    """Rows of the expert buffer for every route.

    Dropless (capacity None): rows [0, S*k); expert e owns rows offset_e .. offset_e + count_e,
    and its routes are placed in token order (route r = s * k + j).

    Capacity C: expert e owns rows e*C .. e*C + C. When more than C routes reach e, C of them are
    kept, chosen by the drop policy:
      position  first come, first choices of every token before any second choice (DeepSpeed top-2)
      rts       a uniformly random subset, seeded (DeepSpeed's random token selection)
      probs     the highest scores (ties to the earlier route; a NaN score ranks as -inf, -0.0 as +0.0)
    Kept routes are placed in token order.
    """
    S, k = expert_ids_SK.shape
    E = num_experts
    ids = expert_ids_SK.long().reshape(-1)  # route r = s * k + j
    routed = (ids >= 0) & (ids < E)  # any other id routes nowhere
    ids = torch.where(routed, ids, -1)
    onehot_RE = torch.nn.functional.one_hot(ids.clamp_min(0), E) * routed[:, None]
    if capacity is None:
        kept = routed
        counts = onehot_RE.sum(0)
        offset_E = torch.cumsum(counts, 0) - counts
        base = offset_E
        num_rows = S * k
    else:
        if drop_policy == "position":
            # Rank in choice-major order: (j, s).
            choice_major = onehot_RE.view(S, k, E).transpose(0, 1).reshape(S * k, E)
            rank_cm = (torch.cumsum(choice_major, 0) - 1) * choice_major
            rank = rank_cm.sum(1).view(k, S).t().reshape(-1)
        else:
            if drop_policy == "rts":
                prio = rts_priority(S * k, seed, ids.device)  # smaller is kept first
            else:  # probs: higher score first; a NaN score ranks as -inf (dropped first), -0.0 == +0.0
                prio = -nan_ranks_last(scores_SK.detach().reshape(-1).float())
            # Rank of each route among the routes of its expert, by priority then route index.
            order = torch.sort(prio, stable=True).indices
            sorted_onehot = onehot_RE[order]
            rank_sorted = ((torch.cumsum(sorted_onehot, 0) - 1) * sorted_onehot).sum(1)
            rank = torch.empty_like(rank_sorted)
            rank[order] = rank_sorted
        kept = routed & (rank < capacity)
        base = torch.arange(E, device=ids.device) * capacity
        num_rows = E * capacity
    kept_onehot = onehot_RE * kept[:, None]
    position = ((torch.cumsum(kept_onehot, 0) - 1) * kept_onehot).sum(1)
    kept_counts = kept_onehot.sum(0)
    slots = torch.where(kept, base[ids.clamp_min(0)] + position, torch.full_like(ids, -1))
    return Slots(slots.view(S, k).to(torch.int32), kept_counts.to(torch.int32), num_rows, capacity)


BF16_TERMS = 3  # bf16 terms of an fp32 value: 8 significant bits each, the same exponent range


def bf16_terms(t32: torch.Tensor) -> torch.Tensor:
    """[..., BF16_TERMS, N] bf16 of an fp32 [..., N], whose fp32 sum over the new dimension is t, the
    leading bits first: each term is the round-to-nearest-even bf16 of what the earlier ones leave.
    Exact for |t| from ~2^-110 (where the last term would fall below bf16's smallest normal) to bf16's
    largest finite value (~3.39e38; above, the first term rounds to inf); a non-finite value gives
    non-finite terms."""
    out = torch.empty((*t32.shape[:-1], BF16_TERMS, t32.shape[-1]), dtype=torch.bfloat16, device=t32.device)
    out[..., 0, :] = t32
    r = t32 - out[..., 0, :]  # exact: a value minus its own rounding
    for i in range(1, BF16_TERMS):
        out[..., i, :] = r
        if i + 1 < BF16_TERMS:
            r.sub_(out[..., i, :])
    return out


def _mm_exact(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b of bf16 operands with fp32 sums, rounded once to out_dtype: on CUDA on the tensor cores
    (cuBLAS), elsewhere on fp32 copies (the same exact products)."""
    if not a.is_cuda:
        return torch.mm(a.float(), b.float()).to(out_dtype)
    return torch.mm(a, b) if out_dtype == a.dtype else torch.mm(a, b, out_dtype=torch.float32).to(out_dtype)


def _split_weight(w_EM: torch.Tensor) -> torch.Tensor:
    """w as the split's GEMMs read it: a bf16 w (or an fp32 w's terms [E, BF16_TERMS, M], split by the
    caller) as it is, an fp32 w as its terms."""
    return w_EM if w_EM.dtype == torch.bfloat16 else bf16_terms(w_EM)


def split_logits(x_SM: torch.Tensor, w_EM: torch.Tensor) -> torch.Tensor:
    """fp32 router logits x [S, M] @ w [E, M]^T of bf16 x and a bf16 or fp32 w on bf16 products: an
    fp32 w as its bf16 terms, so every product is exact in fp32 and sums in fp32, as in an fp32 GEMM.
    w may also be an fp32 w's bf16_terms [E, BF16_TERMS, M], made once by the caller."""
    w = _split_weight(w_EM)
    if w.dim() == 2:
        return _mm_exact(x_SM, w.t(), torch.float32)
    E, _, M = w.shape
    return _mm_exact(x_SM, w.reshape(E * BF16_TERMS, M).t(), torch.float32).view(x_SM.shape[0], E, BF16_TERMS).sum(-1)


# Term i of g with term j of an fp32 w where i + j <= 2: the products left out (g1 w2, g2 w1, g2 w2)
# are below 2^-24 of the leading one, under fp32's own rounding of a product.
_G_TERMS, _W_TERMS = [0, 0, 1, 0, 1, 2], [0, 1, 0, 2, 1, 0]


def split_grads(g_SE: torch.Tensor, x_SM: torch.Tensor, w_EM: torch.Tensor, need_x: bool = True, need_w: bool = True,
                terms=bf16_terms, gx_add: Optional[torch.Tensor] = None):
    """The gradients of split_logits for an fp32 g [S, E]: (g @ w in bf16, + gx_add [S, M] where given
    (x's other gradient, added in fp32 before the one rounding), g^T @ x in w's dtype: fp32 where w is
    an fp32 w's terms), None where not needed, from g's bf16 terms (made by `terms`: this function or
    one with its bits) and w's where fp32, on bf16 products with fp32 sums."""
    S, E = g_SE.shape
    g_STE = terms(g_SE.float())
    w = _split_weight(w_EM)
    gx = gw = None
    if need_x:
        if w.dim() == 2:
            a, b = g_STE.reshape(S, BF16_TERMS * E), w.repeat(BF16_TERMS, 1)
        else:
            a = torch.cat([g_STE[:, i] for i in _G_TERMS], dim=1)  # [S, 6 E]
            b = torch.cat([w[:, j] for j in _W_TERMS])  # [6 E, M]
        if gx_add is None:
            gx = _mm_exact(a, b, x_SM.dtype)
        else:
            gx = (_mm_exact(a, b, torch.float32) + gx_add.float()).to(x_SM.dtype)
    if need_w:
        gw = _mm_exact(g_STE.reshape(S, BF16_TERMS * E).t(), x_SM, torch.float32)
        gw = gw.view(BF16_TERMS, E, x_SM.shape[1]).sum(0).to(torch.float32 if w_EM.dim() == 3 else w_EM.dtype)
    return gx, gw


def routed_slots(slots_SK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The bare-slots rule of every backend: an entry outside [0, num_rows) routes nowhere (as an
    expert id outside [0, E) does), whatever its width; it becomes -1. Distinct rows are the
    caller's precondition (ops checks it where that costs no host sync)."""
    slots = slots_SK.long()
    return torch.where((slots >= 0) & (slots < num_rows), slots, -1)


def zero_width_dscores(scores_SK: Optional[torch.Tensor], slots_SK: torch.Tensor, num_rows: int,
                       renormalize: bool, dtype: torch.dtype) -> torch.Tensor:
    """gather's score gradient where the rows have no columns (no products): 0, except with renormalize
    on the kept routes of a token whose kept scores sum to NaN or Inf: NaN, as the formula's
    0 * (p / sum) terms give (autograd.gather's backward: the kernels have nothing to launch there)."""
    if not renormalize:
        return torch.zeros(slots_SK.shape, dtype=dtype, device=slots_SK.device)
    kept = routed_slots(slots_SK, num_rows) >= 0
    p = torch.where(kept, scores_SK.to(dtype), 0.0)
    return torch.where(kept, 0.0 * p.sum(dim=1, keepdim=True), 0.0)


def scatter_tokens(x_SM: torch.Tensor, slots_SK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Expert buffer [num_rows, M]: row slots[s, j] holds x[s]; rows no route reaches are zero.
    Its gradient sums each token's k rows in fp32 and rounds once (fp64 for fp64)."""
    S, k = slots_SK.shape
    flat = routed_slots(slots_SK, num_rows).reshape(-1)
    keep = flat >= 0
    src = torch.arange(S, device=x_SM.device).repeat_interleave(k)[keep]
    buf = x_SM.new_zeros(num_rows, x_SM.shape[1])
    # Where a backward will run, rows picked from x in the compute dtype (exact both ways): the pick's
    # backward is that sum, which in fp16 / bf16 would round after every add. Without one (inference's
    # reference mode) no upcast copy of x.
    grad = torch.is_grad_enabled() and x_SM.requires_grad
    rows = (x_SM.to(compute_dtype(x_SM.dtype)) if grad else x_SM)[src].to(x_SM.dtype)
    return buf.index_copy(0, flat[keep], rows)


def renormalize_kept(scores_SK: torch.Tensor, slots_SK: torch.Tensor) -> torch.Tensor:
    """Each token's scores over the sum of its kept ones (slot >= 0), dropped routes 0; the sum is
    clamped below at the dtype's eps, so a token with no kept route weighs nothing. DeepSpeed's
    top-k combine weights after capacity."""
    kept = torch.where(slots_SK >= 0, scores_SK, 0.0)
    return kept / kept.sum(dim=1, keepdim=True).clamp_min(torch.finfo(kept.dtype).eps)


def gather_tokens(y_RM: torch.Tensor, slots_SK: torch.Tensor, scores_SK: Optional[torch.Tensor],
                  renormalize: bool = False) -> torch.Tensor:
    """out[s] = sum over kept routes j of w[s, j] * y[slots[s, j]], accumulated in fp32, with
    w = scores (1 where None), or renormalize_kept(scores, slots) when renormalize."""
    acc = compute_dtype(y_RM.dtype)
    slots_SK = routed_slots(slots_SK, y_RM.shape[0])
    keep = (slots_SK >= 0)
    w_SK = torch.ones(slots_SK.shape, dtype=acc, device=y_RM.device) if scores_SK is None else scores_SK.to(acc)
    if renormalize:
        w_SK = renormalize_kept(w_SK, slots_SK)
    # A zero row after the buffer stands for "nowhere" (-1), so an empty buffer needs no special case.
    y_pad = torch.cat([y_RM.to(acc), y_RM.new_zeros(1, y_RM.shape[1], dtype=acc)])
    rows = y_pad[torch.where(keep, slots_SK, y_RM.shape[0])]  # [S, k, M]
    weighted = torch.where(keep[..., None], rows * w_SK[..., None], 0.0)
    return weighted.sum(dim=1).to(y_RM.dtype)


class ShuffledRoutes(NamedTuple):
    """index_shuffling's tables: the routing and its expert-contiguous permutation. With a shared
    expert every token has one route more, column k, to expert E with score 1."""
    expert_ids: torch.Tensor  # [T, k (+1)] int32, best first; -1 for a token with non-finite logits
    scores: torch.Tensor  # [T, k (+1)] fp32 (fp64 for fp64 logits)
    counts: torch.Tensor  # [E (+1)] int32, routes per expert
    slots: torch.Tensor  # [T, k (+1)] int32, row of each route in expert-contiguous order; -1 if unrouted
    row_routes: torch.Tensor  # [T * (k (+1))] int32, the route each row holds; -1 past sum(counts)


def row_routes(slots_SK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The inverse of slots: [num_rows] int32, the route s * k + j that owns each row, or -1."""
    flat = slots_SK.reshape(-1).long()
    keep = flat >= 0
    routes = torch.full((num_rows, ), -1, dtype=torch.int32, device=slots_SK.device)
    routes[flat[keep]] = torch.arange(flat.numel(), dtype=torch.int32, device=slots_SK.device)[keep]
    return routes


def index_shuffling(logits_TE: torch.Tensor, k: int, score_func: str = "softmax", renormalize: bool = False,
                    shared_expert: bool = False) -> ShuffledRoutes:
    """Serving's routing step: top-k routing (as topk_gating: ties to the lower id, non-finite rows
    route nowhere), per-expert counts, and the permutation of the routes into expert-contiguous rows
    (dropless assign_slots: expert e owns rows from the sum of the counts before it, its routes in
    token order), with its inverse row_routes. shared_expert: every token (routed or not) also takes
    expert E with score 1, so the shared expert's rows come last and run in the same grouped GEMMs."""
    T, E = logits_TE.shape
    g = topk_gating(logits_TE, k, score_func, renormalize)
    ids, scores = g.expert_ids, g.scores.detach()
    if shared_expert:
        ids = torch.cat([ids, torch.full((T, 1), E, dtype=ids.dtype, device=ids.device)], 1)
        scores = torch.cat([scores, torch.ones(T, 1, dtype=scores.dtype, device=scores.device)], 1)
    s = assign_slots(ids, scores, E + shared_expert)
    return ShuffledRoutes(ids, scores, s.kept_counts, s.slots, row_routes(s.slots, s.num_rows))
