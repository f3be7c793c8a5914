"""A drop-in for `deepspeed.moe.layer.MoE` whose gate, dispatch and combine run on turbomoe's ops.

    from turbomoe.integrations.deepspeed import MoE      # same constructor and forward as stock
    import turbomoe.integrations.deepspeed as tds; tds.patch()   # or: make stock's MoE this one

The layer keeps stock's modules (`deepspeed_moe.gate.wg`, `deepspeed_moe.experts.deepspeed_experts.{i}`,
`mlp` and `coefficient` for residual MoE), so parameter names, DeepSpeed's MoE parameter groups, ZeRO
and per-expert checkpoint files are those of stock; only `deepspeed_moe.forward` differs:

    x [S, M] -> logits [S, E] -> ids, scores [S, k] -> slots [S, k]
      -> scatter_tokens -> buffer [E * C, M] = [ep, E_local, C, M]  --all-to-all-->  local experts
      -> all-to-all back -> gather_tokens(buffer, slots, combine weights) -> out [S, M]

Dropless (drop_tokens=False) with ep_size > 1 sizes the buffers by C = the largest expert count
over the expert-parallel group, as stock does: one host read per forward. With ep_size = 1 and
grouped experts it uses turbomoe's dropless layout instead, [S * k, M] expert-contiguous rows and
grouped GEMMs with the counts on the device: no host sync at all. With bias-free SwiGLU experts on
one rank (ep_size 1, no tensor parallelism), dropless or with a capacity, the combine weights are
applied in the experts' activation and the gather sums with weight 1, so the experts' output is not
kept for the weights' gradient.
"""
import contextlib
import operator
import os
import warnings
from typing import Optional

import torch
from torch import nn
import deepspeed.moe.layer as ds_layer
from deepspeed.moe.mappings import drop_tokens, gather_tokens
from deepspeed.moe.sharded_moe import (FIRST_ALLTOALL_TIMER, MOE_TIMER, SECOND_ALLTOALL_TIMER, TOPK_GATE_TIMER,
                                       MOELayer, _AllToAll)
from deepspeed.utils import groups
from deepspeed.utils.bwc import bwc_tensor_model_parallel_world_size

from .. import ops, reference
from ..nn.experts import autocast_dtype
from ..nn.recompute import remaking
from .deepspeed_experts import (EqualGroups, RowGroups, SwiGLUExpert, fast_path_applies, fast_path_kind,
                                grouped_mlp, module_assignments, pack_expert_params, run_experts, scales_rows)
from .deepspeed_gating import drop_policy, expert_capacity, route, router_logits

__all__ = ["MoE", "TurboMOELayer", "SwiGLUExpert", "patch", "unpatch", "is_patched"]

StockMoE = ds_layer.MoE


@contextlib.contextmanager
def _timed(owner: nn.Module, timer: str, attr: str):
    """Stock's wall-clock breakdown: when the engine sets owner.wall_clock_breakdown, time the
    block with owner's (synchronizing) timer and store the milliseconds in owner.<attr>."""
    if not owner.wall_clock_breakdown:
        yield
        return
    owner.timers(timer).start()
    yield
    owner.timers(timer).stop()
    setattr(owner, attr, owner.timers(timer).elapsed(reset=False))


def _fast_path_of(experts: nn.Module) -> Optional[str]:
    """fast_path_kind of stock's Experts (its deepspeed_experts); None for any other module in its
    place (a benchmark's identity, a user's own), which then runs as it is."""
    inner = getattr(experts, "deepspeed_experts", None)
    return None if inner is None else fast_path_kind(list(inner))


class TurboMOELayer(MOELayer):
    """Stock's MOELayer (same gate and experts submodules) with a forward on turbomoe's ops."""

    def __init__(self, gate: nn.Module, experts: nn.Module, ep_group_name: str, ep_size: int,
                 num_local_experts: int, norm_topk_prob: Optional[bool] = None, recompute: bool = False,
                 fused_grad_accumulation: bool = False) -> None:
        super().__init__(gate, experts, ep_group_name, ep_size, num_local_experts, use_tutel=False)
        self.recompute = recompute
        self.fused_grad_accumulation = fused_grad_accumulation
        # None: stock's combine weights (renormalised over the kept routes for k >= 2, raw for k = 1).
        self.norm_topk_prob = gate.k >= 2 if norm_topk_prob is None else norm_topk_prob
        self.expert_fast_path = _fast_path_of(experts)
        self._experts_checked_at = module_assignments()
        if self.expert_fast_path is not None:
            pack_expert_params(experts.deepspeed_experts)

    def _apply(self, fn, recurse=True):
        # .to() / .cuda() / .half() give every parameter new storage: pack the experts again (where
        # they did: share_memory() and a move that changes nothing keep theirs, still packed).
        super()._apply(fn, recurse)
        if self.expert_fast_path is not None:
            pack_expert_params(self.experts.deepspeed_experts)
        return self

    def forward(self, hidden_states: torch.Tensor, used_token: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not torch.compiler.is_compiling() and self._experts_checked_at != module_assignments():
            # a module assigned since (an expert swapped, a Linear wrapped): the experts checked again
            self.expert_fast_path = _fast_path_of(self.experts)
            self._experts_checked_at = module_assignments()
        with _timed(self, MOE_TIMER, "time_moe"):
            M = hidden_states.shape[-1]
            # Views only where the shape changes: each is an autograd node, host time in every backward.
            x_SM = hidden_states if hidden_states.dim() == 2 else hidden_states.reshape(-1, M)
            E = self.gate.wg.weight.shape[0]
            # Grouped experts on one rank, no tensor parallelism: nothing to exchange. Dropless, they
            # take expert-contiguous rows and grouped GEMMs over counts on the device (no capacity,
            # no padding, no host sync); with a capacity, the [E, C, M] buffer.
            local = (self.ep_size == 1 and bwc_tensor_model_parallel_world_size(groups.mpu) == 1
                     and fast_path_applies(self.experts, self.expert_fast_path, x_SM))
            rows_layout = local and not self.gate.drop_tokens
            with _timed(self.gate, TOPK_GATE_TIMER, "gate_time"):
                s, scores_SK, x_SM = self._route_and_assign(x_SM, used_token, rows_layout)
            dtype = autocast_dtype(x_SM)
            if dtype is not None:  # torch.autocast: the tokens move in its dtype, as through stock's einsums
                x_SM = x_SM.to(dtype)
            buf_RM = ops.scatter_tokens(x_SM, s)
            # Stock's combine weights: for k >= 2 the kept routes' scores renormalised to sum 1.
            row_scale_R = None
            if local and scales_rows(self.expert_fast_path, self.experts.deepspeed_experts):
                # Applied inside the experts' activation instead (MoELayer's order): y is not kept.
                row_scale_R = ops.row_scores(s, scores_SK, renormalize=self.norm_topk_prob)
            if rows_layout:
                # The rows again from x_SM (the router's GEMM keeps it).
                with remaking(self.recompute, buf_RM, lambda: ops.scatter_tokens(x_SM, s), (x_SM, )) as remake:
                    y_RM = grouped_mlp(self.expert_fast_path, self.experts.deepspeed_experts, buf_RM,
                                       RowGroups(s.kept_counts, s.num_rows, self.fused_grad_accumulation), remake,
                                       row_scale_R)
            elif row_scale_R is not None:
                y_RM = grouped_mlp(self.expert_fast_path, self.experts.deepspeed_experts, buf_RM.view(E, s.capacity, M),
                                   EqualGroups(self.fused_grad_accumulation), None,
                                   row_scale_R).reshape(E * s.capacity, M)
            else:
                y_RM = self._exchange_and_run_experts(buf_RM, s.capacity)
            if row_scale_R is not None:
                out_SM = ops.gather_tokens(y_RM, s, None)
            elif self.norm_topk_prob and reference.compute_dtype(y_RM.dtype) != scores_SK.dtype:
                # fp64 experts: the gather would renormalise in fp64, clamping the kept sum at fp64's
                # eps; stock's fp32 gates clamp it at fp32's (a lone second route of p < 1.2e-7 weighs
                # p / eps, not 1): renormalise the fp32 scores here, as the row-scale path does.
                out_SM = ops.gather_tokens(y_RM, s, reference.renormalize_kept(scores_SK, s.slots))
            else:
                out_SM = ops.gather_tokens(y_RM, s, scores_SK, renormalize=self.norm_topk_prob)
        return out_SM if hidden_states.dim() == 2 else out_SM.reshape(hidden_states.shape)

    def _route_and_assign(self, x_SM: torch.Tensor, used_token: Optional[torch.Tensor], rows_layout: bool):
        """Sets l_aux and exp_counts; returns the slots, the routes' scores [S, k] and x for the dispatch
        (router_logits': its gradient added in the router's backward)."""
        gate = self.gate
        logits_SE, x_SM = router_logits(gate, x_SM)
        routes = route(gate, logits_SE, used_token)
        self.l_aux = routes.l_aux
        # stock: routes per expert before capacity, int64; top-1 multiplies its mask by used_token, so
        # a float used_token gives float counts
        counts_dtype = torch.int64
        if gate.k == 1 and used_token is not None:
            counts_dtype = torch.promote_types(used_token.dtype, torch.int64)
        self.exp_counts = routes.counts.to(counts_dtype).detach()
        C = None if rows_layout else expert_capacity(gate, x_SM.shape[0], routes.counts, self.ep_group)
        policy = drop_policy(gate)
        # What an over-full expert keeps the largest of: top-1's RTS draws, else the router's scores
        ids_SK = routes.expert_ids
        rank_SK = routes.scores if routes.priority is None else routes.priority
        # With tensor parallelism the row within C decides which TP rank runs a route (drop_tokens
        # splits the C dim), so place top-2 routes where stock does: all first choices, then all
        # second choices. assign_slots places kept routes in token order; routed as [k * S, 1] in
        # choice-major order, its "position" policy keeps the same routes in stock's order.
        choice_major = gate.k == 2 and C is not None and bwc_tensor_model_parallel_world_size(groups.mpu) > 1
        if choice_major:
            ids_SK, rank_SK = ids_SK.t().reshape(-1, 1), rank_SK.t().reshape(-1, 1)
        s = ops.assign_slots(ids_SK, rank_SK, routes.counts.shape[0], capacity=C, drop_policy=policy)
        if choice_major:
            s = s._replace(slots=s.slots.view(gate.k, -1).t().contiguous())
        return s, routes.scores, x_SM

    def _exchange_and_run_experts(self, buf_RM: torch.Tensor, C: int) -> torch.Tensor:
        """The buffer [E * C, M] on every rank -> each rank's experts on their rows from all ranks ->
        [E * C, M].

        The same all-to-all and tensor-parallel token dropping as stock's MOELayer.forward, on the
        buffer seen once as [ep, E_local, C, M] (the all-to-all splits its first dim among the ranks;
        the tensor-parallel share is cut along C, dim 2), so no other view is made on the way.
        """
        M = buf_RM.shape[1]
        tp = bwc_tensor_model_parallel_world_size(groups.mpu)
        expert_tp = groups._get_expert_model_parallel_world_size() > 1
        x_GECM = buf_RM.view(self.ep_size, self.num_local_experts, C, M)
        if tp > 1:
            # Non-expert tensor parallelism duplicates tokens on tp ranks: exchange a 1/tp share.
            x_GECM = drop_tokens(x_GECM, dim=2)
        with _timed(self, FIRST_ALLTOALL_TIMER, "time_falltoall"):
            x_GECM = _AllToAll.apply(self.ep_group, x_GECM) if self.ep_size > 1 else x_GECM.contiguous()
        if tp > 1 and expert_tp:
            x_GECM = gather_tokens(x_GECM, dim=2)
        y_GECM = run_experts(self.experts, self.expert_fast_path, x_GECM, self.fused_grad_accumulation)
        if tp > 1 and expert_tp:
            y_GECM = drop_tokens(y_GECM, dim=2)
        with _timed(self, SECOND_ALLTOALL_TIMER, "time_salltoall"):
            y_GECM = _AllToAll.apply(self.ep_group, y_GECM) if self.ep_size > 1 else y_GECM.contiguous()
        if tp > 1:
            y_GECM = gather_tokens(y_GECM, dim=2)
        return y_GECM.view(self.ep_size * self.num_local_experts * C, M)


class MoE(StockMoE):
    """`deepspeed.moe.layer.MoE` with turbomoe's gating, dispatch and combine (see module doc).

    Same constructor, defaults and forward(hidden_states, used_token=None) -> (output, l_aux,
    exp_counts). k may be 1 .. 8. use_tutel is accepted and ignored: turbomoe's dispatch replaces
    Tutel's. One optional argument beyond stock's: norm_topk_prob (Hugging Face's name), whether
    the combine weights are the kept routes' probabilities renormalised to sum 1; None keeps
    stock's choice (yes for k >= 2, no for k = 1). And recompute (as MoELayer's): on the dropless
    grouped path at ep_size 1, the expert rows and the activation are remade in backward instead of
    kept (turbomoe.nn.recompute). And fused_grad_accumulation (as MoELayer's; None: the environment's
    TURBOMOE_FUSED_GRAD_ACCUMULATION=1, for code that builds the layer unchanged): with grouped experts,
    micro-batches after the first add the experts' weight gradients into their .grad inside the
    weight-gradient GEMMs (no gradient tensor, no add pass; rounded once, so other bits than autograd's
    add), where nothing hooks the weights themselves and autograd would add in place.
    """

    def __init__(self,
                 hidden_size: int,
                 expert: nn.Module,
                 num_experts: int = 1,
                 ep_size: int = 1,
                 k: int = 1,
                 capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0,
                 min_capacity: int = 4,
                 use_residual: bool = False,
                 noisy_gate_policy: Optional[str] = None,
                 drop_tokens: bool = True,
                 use_rts: bool = True,
                 use_tutel: bool = False,
                 enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True,
                 norm_topk_prob: Optional[bool] = None,
                 recompute: bool = False,
                 fused_grad_accumulation: Optional[bool] = None) -> None:
        try:
            k_int = operator.index(k)  # numpy's ints too, as stock takes them
        except TypeError:
            k_int = 0
        # stock's top-2 runs with one expert too (both routes to it); top-k (k >= 3) needs k experts
        if isinstance(k, bool) or not 1 <= k_int <= max(num_experts, 2):
            raise ValueError(f"k must be an int in [1, max(num_experts {num_experts}, 2)], got {k!r}")
        k = k_int
        ops.check_bool("recompute", recompute)
        if fused_grad_accumulation is None:
            flag = os.environ.get("TURBOMOE_FUSED_GRAD_ACCUMULATION", "0")
            if flag not in ("0", "1"):
                raise ValueError(f"TURBOMOE_FUSED_GRAD_ACCUMULATION must be 0 or 1, got {flag!r}")
            fused_grad_accumulation = flag == "1"
        ops.check_bool("fused_grad_accumulation", fused_grad_accumulation)
        if norm_topk_prob is not None:
            ops.check_bool("norm_topk_prob", norm_topk_prob)
        if noisy_gate_policy not in (None, "None", "Jitter", "RSample"):
            raise ValueError("noisy_gate_policy must be None, 'None', 'Jitter' or 'RSample', "
                             f"got {noisy_gate_policy!r}")
        super().__init__(hidden_size, expert, num_experts, ep_size, k, capacity_factor, eval_capacity_factor,
                         min_capacity, use_residual, noisy_gate_policy, drop_tokens, use_rts, False,
                         enable_expert_tensor_parallelism, top2_2nd_expert_sampling)
        if k > ops.MAX_K:  # turbomoe's row kernels take at most MAX_K routes a token: stock's layer runs
            if norm_topk_prob is not None or recompute or fused_grad_accumulation:
                raise ValueError(f"norm_topk_prob, recompute and fused_grad_accumulation need k <= {ops.MAX_K} "
                                 f"(turbomoe's layer), got k = {k}")
            warnings.warn(f"k = {k} > {ops.MAX_K}: this MoE layer runs DeepSpeed's own MOELayer, not turbomoe's")
            return
        stock = self.deepspeed_moe
        self.deepspeed_moe = TurboMOELayer(stock.gate, stock.experts, stock.ep_group_name, ep_size,
                                           self.num_local_experts, norm_topk_prob, recompute, fused_grad_accumulation)


def _new_turbomoe(cls, *args, **kwargs):
    # Python then runs __init__ of the returned object's class, turbomoe's, with the same arguments.
    return nn.Module.__new__(MoE if cls is StockMoE else cls)


_new_turbomoe.turbomoe_patch = True  # is_patched() knows it by this mark: a reload of this module makes a new function


def _new_stock(cls, *args, **kwargs):
    # unpatch() installs this rather than deleting __new__: once a class has set __new__, the
    # inherited object.__new__ would refuse the constructor's arguments.
    return nn.Module.__new__(cls)


def is_patched() -> bool:
    return getattr(StockMoE.__dict__.get("__new__"), "turbomoe_patch", False)


def patch() -> None:
    """Make code that constructs `deepspeed.moe.layer.MoE` get turbomoe's layer.

    Stock's class gets a __new__ that builds turbomoe's subclass, so every reference to it works,
    however and whenever it was imported (Megatron-DeepSpeed's `from deepspeed.moe.layer import
    MoE`), and isinstance checks (the engine's) still hold. Call it before building the model.
    Subclasses of stock's MoE are left alone (they may override its behaviour).
    """
    StockMoE.__new__ = _new_turbomoe


def unpatch() -> None:
    """Undo `patch`."""
    if is_patched():
        StockMoE.__new__ = _new_stock
