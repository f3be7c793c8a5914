"""DeepSpeed's gate semantics (sharded_moe top1/top2/topk gating) on turbomoe's ops.

`route` turns the tokens and a stock `TopKGate` (which holds the router weight and the config)
into the four tables; `expert_capacity` and `drop_policy` pick C and the drop rule the way stock
does. What stock computes as [S, E] / [S, E, C] masks is here O(S * k), except the draws that stock
makes per (token, expert) -- the Gumbel noise of top-2 sampling and of RSample, the uniforms of top-1's
random token selection -- which keep their [S, E] shape so that the same seed gives the same routes
(and kept tokens) as stock, and leaves torch's generators where stock leaves them.
"""
from typing import NamedTuple, Optional, Tuple

import torch
from deepspeed import comm as dist
from deepspeed.comm import pg_utils
from deepspeed.moe.sharded_moe import TopKGate, gumbel_rsample, multiplicative_jitter
from deepspeed.utils import groups
from deepspeed.utils.bwc import bwc_tensor_model_parallel_world_size

from .. import ops
from ..autograd.router import fp32_logits, fp32_logits_and_x
from ..reference import count_routes, score_of_other_expert


class Routes(NamedTuple):
    expert_ids: torch.Tensor  # [S, k] int32, -1 for no route
    scores: torch.Tensor  # [S, k] fp32 router probability of each route (not renormalised)
    counts: torch.Tensor  # [E] int32 routes per expert before capacity (stock's exp_counts)
    l_aux: torch.Tensor  # scalar, stock's load-balancing loss
    priority: Optional[torch.Tensor] = None  # [S, k] an over-full expert keeps its largest; None: scores


def router_logits(gate: TopKGate, x_SM: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(logits [S, E] in fp32 as stock's (an fp32 GEMM of x and the router weight), with its input
    jitter in training (noisy_gate_policy='Jitter'); x for the dispatch: where the router read x
    itself, x passed through its node, which adds the dispatch's gradient into its own kernel)."""
    if gate.noisy_gate_policy == "Jitter" and gate.training:
        return fp32_logits(multiplicative_jitter(x_SM.float(), device=x_SM.device), gate.wg.weight), x_SM
    return fp32_logits_and_x(x_SM, gate.wg.weight)


def route(gate: TopKGate, logits_SE: torch.Tensor, used_token_S: Optional[torch.Tensor] = None) -> Routes:
    """Stock's expert choice, router scores, exp_counts and l_aux.

    k = 2 with top2_2nd_expert_sampling draws the second expert from softmax(logits) minus the first
    (Gumbel-max over the logits, as stock); without, it is the best other logit (ops.second_by_logits).
    k = 1 honours used_token (nonzero = used; unused tokens route nowhere) and, in training, RSample
    (first expert by Gumbel-max). Stock ignores used_token for k >= 2, and so does this.
    """
    S, E = logits_SE.shape
    k = gate.k
    if k == 1 and S < gate.min_capacity:  # stock's top-1 asserts this
        raise ValueError(f"top-1 gating needs at least min_capacity ({gate.min_capacity}) tokens, got {S}; "
                         "set min_capacity=0 or use a larger batch")
    sample_second = k == 2 and gate.top2_2nd_expert_sampling
    rsample = k == 1 and gate.training and gate.noisy_gate_policy == "RSample"
    masked = k == 1 and used_token_S is not None
    if rsample:  # drawn before anything else, as stock does
        noisy_SE = logits_SE.detach() + gumbel_rsample(logits_SE.shape, device=logits_SE.device)

    g = ops.topk_gating(logits_SE, 1 if k == 2 else k)
    if sample_second and E > 1:  # draws its noise from torch.rand(S, E), as stock's gumbel_rsample
        g = ops.sample_second_expert(logits_SE, g)
    elif k == 2:
        if sample_second:  # one expert: the second route is the first's again, but stock draws its noise all the same
            torch.rand(S, E, device=logits_SE.device)
        g = ops.second_by_logits(logits_SE, g)
    # l_aux stays the op's: for k <= 2 stock counts only first choices, with coefficient E.
    ids, scores, counts, l_aux = g.expert_ids, g.scores, g.counts, g.aux_loss
    if rsample:
        chosen = torch.where(ids >= 0, noisy_SE.argmax(1, keepdim=True).to(ids.dtype), ids)
        scores = score_of_other_expert(scores, logits_SE, ids, chosen)
        ids = chosen
    if masked:
        if used_token_S.numel() != S:
            raise ValueError(f"used_token must hold one entry per token ({S}), got shape {tuple(used_token_S.shape)}")
        ids = torch.where(used_token_S.reshape(S, 1) != 0, ids, torch.full_like(ids, -1))
    if rsample or masked:
        counts = count_routes(ids, E)
        # Stock's l_aux averages the router probability over all S tokens but counts the noisy or
        # masked routes, which the op's l_aux (its own choices) cannot express: rebuild it here.
        # max(S, 1): S = 0 gives l_aux 0, as the op's (stock's mean over no tokens is NaN)
        me_E = torch.softmax(logits_SE, dim=1).sum(0) / max(S, 1)
        l_aux = E * (me_E * counts.to(me_E.dtype) / max(S, 1)).sum()
    priority = None
    if k == 1 and gate.use_rts:
        # Stock's random token selection: uniforms [S, E] (its Uniform(0, 1).rsample is torch.rand) drawn
        # after RSample's noise on every forward, eval and dropless too, so that the generator moves as
        # stock's (dropout after the layer, the next RSample); an over-full expert keeps the routes of
        # the largest draws, so the same seed keeps the same tokens as stock.
        u_SE = torch.rand(S, E, device=logits_SE.device)
        priority = u_SE.gather(1, ids.long().clamp_min(0))
    return Routes(ids, scores, counts, l_aux, priority)


def drop_policy(gate: TopKGate) -> str:
    """Stock's choice of the routes an over-full expert keeps: random for top-1 with RTS (those of the
    largest uniforms drawn, Routes.priority), else first come; first choices before second choices for
    top-2; highest probability for top-k (k >= 3)."""
    if gate.k == 1:
        return "probs" if gate.use_rts else "position"
    return "position" if gate.k == 2 else "probs"


def expert_capacity(gate: TopKGate, num_tokens: int, counts_E: torch.Tensor, ep_group) -> int:
    """C: stock's formula when dropping; else the largest count over the expert-parallel group,
    padded to a multiple of the tensor-parallel size.

    The dropless branch holds the layer's one host sync: the buffers (and the all-to-all) need C
    as a Python int, and it is known only after routing. Stock reads it too (and top-1 syncs three
    more times comparing and selecting with tensor capacities); here it is one int read.
    """
    E = counts_E.shape[0]
    if gate.drop_tokens:
        # Whatever stock's torch.tensor() takes: numpy and tensor scalars, a float min_capacity
        # (truncated, as stock's .to(int64)), a factor <= 0 (C = min_capacity).
        factor = float(gate.capacity_factor if gate.training else gate.eval_capacity_factor)
        min_capacity = max(int(gate.min_capacity), 0)  # a negative one never binds: stock's C >= 0 here
        if factor <= 0:  # stock's ceil of a product <= 0 is <= 0
            return min_capacity
        return ops.capacity(num_tokens, E, gate.k, factor, min_capacity, fp32=True)
    cap = counts_E.max().to(torch.int64)
    if pg_utils.is_parallel(ep_group):
        dist.all_reduce(cap, op=dist.ReduceOp.MAX, group=ep_group)
    tp = bwc_tensor_model_parallel_world_size(mpu=groups.mpu)
    if tp > 1:
        # Tensor-parallel non-experts split the capacity dim among the tp ranks (drop_tokens in
        # MOELayer), with or without expert tensor parallelism: pad C to a multiple of tp. Stock
        # pads only without expert tensor parallelism; with it, an odd count fails drop_tokens'
        # divisibility assert. Where stock runs, C is already a multiple of tp and nothing changes.
        cap = (cap + tp - 1) // tp * tp
    return int(cap)

