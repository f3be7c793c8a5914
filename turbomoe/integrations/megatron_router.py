"""Megatron-core router on turbomoe's gating: TopKRouter's semantics, the tables turbomoe's dispatch reads.

`TurboTopKRouter` subclasses megatron-core's `TopKRouter` (0.16): same parameters, buffers and
config fields; `route(x)` returns a `Routing` (expert ids, probs, slots: O(T*k), no [T, E] tensor)
for turbomoe's dispatcher (TurboMoELayer gets it as `router(x, sparse=True)`, so that hooks on the
router run), and `forward(x)` the dense `(probs, routing_map)` of the stock interface, so it also serves
stock MoELayers. Mapping of Megatron's routing onto `turbomoe.ops`:
  softmax, not pre-softmax   softmax over the top-k logits  = topk_gating(softmax, renormalize=True)
  softmax, pre-softmax       top-k of the softmax            = topk_gating(softmax, renormalize=False)
  sigmoid (+ expert bias)    top-k of sigmoid (+ bias, choice only), over their sum when k > 1
                             = topk_gating(sigmoid, renormalize=k > 1, selection_bias=expert_bias)
  probs are cast to the logits' dtype and scaled by moe_router_topk_scaling_factor, as stock does.
  capacity (moe_expert_capacity_factor): Megatron's get_capacity(T * k, E, factor), no drops when
  it reaches T; drop policies map onto assign_slots: "probs" keeps the highest probs, "position"
  the earliest tokens (assign_slots' probs policy on equal priorities keeps the earlier routes),
  "rts" (turbomoe's extra policy) a seeded uniformly random subset, drawn anew each training step
  from torch's CPU generator (so recomputation drops the same routes).
  aux_loss / seq_aux_loss / global_aux_loss: TopKRouter's own methods on Megatron's aux scores; the
  plain aux_loss (softmax, no expert bias, no tensor/context-parallel reduction) takes turbomoe's
  fused one where the formulas agree (k != 2), and at k = 2 the softmax's sums times the op's
  route counts (no [T, E] top-k map). z-loss: turbomoe's (mean logsumexp^2). Both ride on
  Megatron's MoEAuxLossAutoScaler and its aux-loss tracker. The expert bias counts kept routes
  into local_tokens_per_expert; finalize_model_grads updates it with Megatron's rule.
Logits go through turbomoe's fp32_logits (fp32 router dtype) or F.linear: Megatron's
router_gating_linear raises NameError without Transformer Engine.
"""
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.moe_utils import (MoEAuxLossAutoScaler, apply_random_logits,
                                                     compute_routing_scores_for_aux_loss, get_capacity,
                                                     get_default_pg_collection, save_to_aux_losses_tracker)
from megatron.core.transformer.moe.router import TopKRouter

from .. import ops
from ..autograd.router import fp32_logits
from .megatron_config import check_config

DROP_POLICIES = ("probs", "position", "rts")
_ROUTER_DTYPES = {None: None, "fp32": torch.float32, "fp64": torch.float64}


class Routing(NamedTuple):
    expert_ids: torch.Tensor  # [T, k] int32
    probs: torch.Tensor  # [T, k] combine weights in the logits' dtype (unused where dropped), aux losses attached
    slots: ops.Slots  # rows of the routes in the local expert buffer (-1: dropped)


def routing_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: Optional[float]) -> Optional[int]:
    """Megatron's expert capacity for T local tokens, or None where nothing can drop (dropless, or
    a capacity of at least T: no expert can receive more than T routes)."""
    if capacity_factor is None:
        return None
    C = get_capacity(num_tokens=num_tokens * topk, num_experts=num_experts, capacity_factor=capacity_factor)
    return None if C >= num_tokens else C


def topk_routing(logits_TE: torch.Tensor, topk: int, score_function: str = "softmax", use_pre_softmax: bool = False,
                 scaling_factor: Optional[float] = None, expert_bias_E: Optional[torch.Tensor] = None,
                 backend: Optional[str] = None):
    """megatron's topk_routing_with_score_function on turbomoe's gating, sparse.

    -> (GatingOutput of turbomoe: ids [T, k] int32, fp32 scores, counts, aux, z; probs [T, k] in the
    logits' dtype, scaled): probs[t, j] is stock's routing_probs[t, ids[t, j]].
    """
    if score_function == "softmax":
        g = ops.topk_gating(logits_TE, topk, "softmax", renormalize=not use_pre_softmax, backend=backend)
    elif score_function == "sigmoid":
        g = ops.topk_gating(logits_TE, topk, "sigmoid", renormalize=topk > 1, selection_bias_E=expert_bias_E,
                            backend=backend)
    else:
        raise ValueError(f"moe_router_score_function must be 'softmax' or 'sigmoid', got {score_function!r}")
    probs_TK = g.scores.to(logits_TE.dtype)
    if scaling_factor:
        probs_TK = probs_TK * scaling_factor
    return g, probs_TK


def drop_slots(expert_ids_TK: torch.Tensor, probs_TK: torch.Tensor, num_experts: int, capacity: Optional[int],
               drop_policy: str, seed: int = 0, backend: Optional[str] = None,
               seed_draw: Optional[torch.Tensor] = None) -> ops.Slots:
    """Megatron's apply_router_token_dropping as turbomoe slots (rows of the kept routes); seed_draw:
    see ops.assign_slots."""
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop policy must be one of {DROP_POLICIES}, got {drop_policy!r}")
    priority_TK = probs_TK
    if capacity is not None and drop_policy == "position":
        # Equal priorities: assign_slots' probs policy keeps the earlier routes (token order), which is
        # Megatron's position policy; turbomoe's own "position" puts all first choices first.
        priority_TK = torch.zeros_like(probs_TK, dtype=torch.float32)
    policy = "rts" if drop_policy == "rts" else "probs"
    return ops.assign_slots(expert_ids_TK, priority_TK, num_experts, capacity=capacity, drop_policy=policy,
                            seed=seed, backend=backend, seed_draw=seed_draw)


def dense_routing(routing: Routing, num_experts: int):
    """(probs [T, E], routing_map [T, E] bool) of the stock router interface, kept routes only."""
    T = routing.expert_ids.shape[0]
    kept_TK = routing.slots.slots >= 0
    ids = routing.expert_ids.long().clamp_min(0)
    probs_TE = routing.probs.new_zeros(T, num_experts).scatter(1, ids, routing.probs * kept_TK)
    map_TE = torch.zeros(T, num_experts, dtype=torch.bool, device=ids.device).scatter(1, ids, kept_TK)
    return probs_TE, map_TE


class TurboTopKRouter(TopKRouter):
    """megatron-core's TopKRouter on turbomoe's gating; see the module doc.

    drop_policy: None takes config.moe_token_drop_policy ("probs" or "position"); "rts" selects
    turbomoe's random token selection. backend: turbomoe's op backend (None: the fastest).
    """

    def __init__(self, config, pg_collection=None, drop_policy: Optional[str] = None, backend: Optional[str] = None):
        check_config(config)
        super().__init__(config=config, pg_collection=pg_collection or get_default_pg_collection())
        self.drop_policy = drop_policy or config.moe_token_drop_policy
        if self.drop_policy not in DROP_POLICIES:
            raise ValueError(f"drop_policy (or config.moe_token_drop_policy) must be one of {DROP_POLICIES}, "
                             f"got {self.drop_policy!r}")
        self.backend, self.seed = backend, 0

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        """Logits [..., E] in the router dtype (config.moe_router_dtype, else the input's)."""
        if self.weight.device != input.device:  # as stock, which builds the weight on the CPU
            self.weight.data = self.weight.data.to(input.device)
            if self.bias is not None:
                self.bias.data = self.bias.data.to(input.device)
        dtype = _ROUTER_DTYPES[self.config.moe_router_dtype] or input.dtype
        x = input.reshape(-1, input.shape[-1])
        if dtype == torch.float32:
            logits = fp32_logits(x, self.weight)  # fp32 products and sums, no fp32 copy of x kept
        else:
            logits = F.linear(x.to(dtype), self.weight.to(dtype))
        if self.bias is not None:
            logits = logits + self.bias.to(dtype)
        return logits.view(*input.shape[:-1], self.num_experts)

    def route(self, input: torch.Tensor, padding_mask: Optional[torch.Tensor] = None) -> Routing:
        """hidden states [s, b, H] (or [T, H]) -> Routing of the T = s*b tokens."""
        if padding_mask is not None:
            raise NotImplementedError("turbomoe's Megatron router does not take a padding_mask yet")
        self._maintain_float32_expert_bias()
        logits = self.gating(self.apply_input_jitter(input))
        if self.config.moe_router_force_load_balancing:
            logits = apply_random_logits(logits)
        seq_length, bsz = logits.shape[0], (logits.shape[1] if logits.dim() == 3 else 1)
        logits_TE = logits.reshape(-1, self.num_experts)
        T, E = logits_TE.shape
        g, probs_TK = topk_routing(logits_TE, self.topk, self.score_function, self.config.moe_router_pre_softmax,
                                   self.config.moe_router_topk_scaling_factor,
                                   self.expert_bias if self.score_function == "sigmoid" else None, self.backend)
        C = routing_capacity(T, E, self.topk, self.config.moe_expert_capacity_factor)
        # rts in training: a fresh selection each step that Megatron's recompute replays (ops.rts_draw).
        draw = ops.rts_draw() if self.training and self.drop_policy == "rts" and C is not None else None
        slots = drop_slots(g.expert_ids, probs_TK, E, C, self.drop_policy, self.seed, self.backend, draw)
        if self.training and torch.is_grad_enabled() and T > 0:  # no tokens, no losses (stock divides by T)
            probs_TK = self._attach_z_loss(probs_TK, g.z_loss, T)
            if self.is_aux_loss_enabled():
                probs_TK = self._attach_aux_losses(probs_TK, logits_TE, g, seq_length, bsz)
        if self.enable_expert_bias and torch.is_grad_enabled():  # stock's condition (not under recompute)
            with torch.no_grad():
                self.local_tokens_per_expert += slots.kept_counts
        return Routing(g.expert_ids, probs_TK, slots)

    def forward(self, input: torch.Tensor, padding_mask: Optional[torch.Tensor] = None, sparse: bool = False):
        """Stock interface: (probs [T, E], routing_map [T, E]) after drops; sparse=True: the Routing
        (TurboMoELayer's call, through Module.__call__ as stock's layer calls its router, so that hooks
        on the router run: Megatron DDP's wait for the router weight's overlapped all-gather, for one)."""
        routing = self.route(input, padding_mask)
        return routing if sparse else dense_routing(routing, self.num_experts)

    def _attach_z_loss(self, probs_TK, z_loss, num_tokens: int):
        """TopKRouter.apply_z_loss with turbomoe's z (its gradient reaches the logits through the
        gating kernel's backward), attached to the probs rather than the logits: same gradient."""
        if self.config.moe_z_loss_coeff is None:
            return probs_TK
        coeff = self.config.moe_z_loss_coeff / self.tp_cp_group.size()
        z = z_loss * coeff
        probs_TK = MoEAuxLossAutoScaler.apply(probs_TK, z * num_tokens if self.calculate_per_token_loss else z)
        num_layers = self.config.num_layers + (self.config.mtp_num_layers or 0)
        save_to_aux_losses_tracker("z_loss", z / coeff, self.layer_number, num_layers)
        return probs_TK

    def _own_aux_applies(self) -> bool:
        """Megatron's switch loss, E / (k T^2) * sum_e (sum_t softmax_te) * routes_e, from turbomoe's
        gating: for softmax scores over the local tokens (no tp/cp reduction) with unbiased choices, the
        routes are the op's top-k (its counts)."""
        return (self.routing_type == "aux_loss" and self.score_function == "softmax"
                and self.tp_cp_group.size() == 1 and not self.enable_expert_bias)

    def _attach_aux_losses(self, probs_TK, logits_TE, g, seq_length: int, bsz: int):
        if self._own_aux_applies():
            coeff = self.get_aux_loss_coeff("aux_loss")
            T, E = logits_TE.shape
            if self.topk == 2:  # the op's own loss counts first choices only there (DeepSpeed's)
                probs_E = torch.softmax(logits_TE, dim=-1, dtype=torch.float32).sum(0)
                aux = (probs_E * g.counts).sum() * (E * coeff / (self.topk * T * T))
            else:  # the op's own loss is Megatron's
                aux = g.aux_loss * coeff
            return self.attach_and_log_load_balancing_loss(probs_TK, coeff, aux, "load_balancing_loss",
                                                           self.tp_cp_group, valid_token_count=T)
        # Megatron's own scores and top-k map for the aux losses ([T, E], as stock builds them).
        map_TE, scores_TE = compute_routing_scores_for_aux_loss(logits_TE, self.topk, self.score_function)
        probs_TK = self._apply_aux_loss(probs_TK, scores_TE, map_TE)
        probs_TK = self._apply_seq_aux_loss(probs_TK, scores_TE, map_TE, seq_length, bsz)
        return self._apply_global_aux_loss(probs_TK, scores_TE, map_TE)
