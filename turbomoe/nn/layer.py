"""MoELayer: router -> assign_slots -> scatter -> grouped-GEMM experts -> gather (+ shared expert)."""
from typing import Optional, Tuple

import torch
from torch import nn

from .. import ops
from ..autograd import plain_call
from .experts import GroupedExperts, autocast_dtype
from .recompute import remaking, replaying
from .router import TopKRouter


class MoELayer(nn.Module):
    """A Mixture-of-Experts MLP block.

    MoELayer(hidden_size, ffn_hidden_size, num_experts, k, ...)
    forward(x [..., M]) -> (out [..., M], aux_loss scalar fp32)

    Dropless by default (capacity_factor=None): every route is computed, the expert buffer is
    [S*k, M], expert-contiguous, and nothing of shape [S, E, C] or [E, C, M] is built. With a
    capacity_factor, expert e keeps at most C = ceil(S / E * capacity_factor * k) routes (at least
    min_capacity), chosen by drop_policy ("position", "rts", "probs"); dropped routes add nothing.
    shared_ffn_hidden_size > 0 adds an always-on shared expert of that width.
    After each forward, `expert_load` [E] int32 (detached, on the device) holds the routes each
    expert computed (an activation checkpoint's replay in backward leaves it as it is): log it, or
    feed it to `router.update_expert_bias` (expert_bias=True) once the backward is done.
    backend picks the gating ops' backend (see turbomoe.ops), gmm_backend the grouped GEMM's
    (see turbomoe.autograd.grouped_gemm); None picks the fastest that applies.
    With SwiGLU experts and no bias, the scores multiply each expert row's activation before the
    second GEMM (turbomoe.autograd.swiglu) and the gather sums with weight 1, so the experts' output
    is not kept for the scores' gradient.
    recompute=True keeps less for backward: the expert rows and the activation are remade from what
    the router and the activation keep anyway (turbomoe.nn.recompute; eager, and not inside another
    saved-tensor policy such as activation checkpointing, which recomputes the whole layer already).
    The rows' memory is then freed right after the first GEMM, unless a forward hook on `experts` (or
    a global one) could keep them.
    fused_grad_accumulation=True: over micro-batches, the experts' weight gradients are added into
    their .grad inside the weight-gradient GEMMs (see GroupedExperts for what hooks then see).
    router_dtype: the dtype of the router's logits (TopKRouter's; None: the tokens' dtype).
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, k: int, *,
                 score_func: str = "softmax", renormalize: bool = False, activation: str = "swiglu",
                 bias: bool = False, capacity_factor: Optional[float] = None, min_capacity: int = 0,
                 drop_policy: str = "position", aux_loss_coef: float = 0.01, z_loss_coef: float = 0.0,
                 expert_bias: bool = False, shared_ffn_hidden_size: int = 0, backend: Optional[str] = None,
                 gmm_backend: Optional[str] = None, seed: int = 0, recompute: bool = False,
                 fused_grad_accumulation: bool = False, router_dtype: Optional[torch.dtype] = None, device=None,
                 dtype=None):
        super().__init__()
        # The sizes, k and renormalize are checked by the router and the experts.
        ops.check_int("min_capacity", min_capacity, 0)
        ops.check_int("shared_ffn_hidden_size", shared_ffn_hidden_size, 0)
        for name, value in (("bias", bias), ("expert_bias", expert_bias), ("recompute", recompute)):
            ops.check_bool(name, value)
        if capacity_factor is not None:  # None: dropless
            ops.check_number("capacity_factor", capacity_factor, 0, strict=True)
        if drop_policy not in ops.DROP_POLICIES:
            raise ValueError(f"drop_policy must be one of {ops.DROP_POLICIES}, got {drop_policy!r}")
        ops.check_seed(seed)
        self.hidden_size, self.num_experts, self.k = hidden_size, num_experts, k
        self.capacity_factor, self.min_capacity, self.drop_policy = capacity_factor, min_capacity, drop_policy
        self.backend, self.seed, self.recompute = backend, seed, recompute
        kw = dict(device=device, dtype=dtype)
        self.router = TopKRouter(hidden_size, num_experts, k, score_func, renormalize, aux_loss_coef,
                                 z_loss_coef, expert_bias, router_dtype, backend=backend, **kw)
        kw_experts = dict(kw, fused_grad_accumulation=fused_grad_accumulation)
        self.experts = GroupedExperts(num_experts, hidden_size, ffn_hidden_size, activation, bias, gmm_backend, **kw_experts)
        self.shared_expert = (GroupedExperts(1, hidden_size, shared_ffn_hidden_size, activation, bias, gmm_backend,
                                             **kw_experts)
                              if shared_ffn_hidden_size else None)
        self.register_buffer("expert_load", torch.zeros(num_experts, dtype=torch.int32, device=device),
                             persistent=False)

    def reset_parameters(self):
        """The whole layer as at construction: the router's and experts' weights drawn in the same order (the
        same values under the same seed), biases and expert_load zero. For a layer made on the meta device
        and materialized with `to_empty` (FSDP2's way), or to start again."""
        for module in (self.router, self.experts, self.shared_expert):
            if module is not None:
                module.reset_parameters()
        self.expert_load.zero_()

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
        if x.dim() == 0 or x.shape[-1] != self.hidden_size:  # [M] is one token, as nn.Linear takes it
            raise ValueError(f"x must be [..., {self.hidden_size}], got {tuple(x.shape)}")
        dtype = autocast_dtype(x)
        if x.dtype != self.experts.w1.dtype and dtype is None:
            raise TypeError(f"x is {x.dtype} but the layer's parameters are {self.experts.w1.dtype}")
        x_SM = x.reshape(-1, self.hidden_size)
        S, E = x_SM.shape[0], self.num_experts
        g, aux_loss = self.router(x_SM)
        if dtype is not None:  # torch.autocast: the tokens move in its dtype from here, as through nn.Linear experts
            x_SM = x_SM.to(dtype)
        C = None if self.capacity_factor is None else ops.capacity(S, E, self.k, self.capacity_factor,
                                                                   self.min_capacity)
        s = ops.assign_slots(g.expert_ids, g.scores, E, capacity=C, drop_policy=self.drop_policy, seed=self.seed,
                             backend=self.backend, seed_draw=self._rts_draw(C))
        # Passing the Slots (not the bare table) lets the kernels find empty rows from the kept counts.
        buf_RM = ops.scatter_tokens(x_SM, s, backend=self.backend)
        counts_E = ops.buffer_counts(s)
        # The rows again from x_SM, which the router keeps.
        # SwiGLU experts weigh their rows by the scores before the second GEMM (SonicMoE's order): the
        # scores' gradient then comes from the activation's backward, and y [R, M] is not kept for it.
        row_scale_R = ops.row_scores(s, g.scores, self.backend) if self.experts.scales_rows else None
        with remaking(self.recompute, buf_RM, lambda: ops.scatter_tokens(x_SM, s, backend=self.backend),
                      (x_SM, )) as remake:
            y_RM = self.experts(buf_RM, counts_E, remake, row_scale_R)
            shared_SM = (None if self.shared_expert is None else
                         self.shared_expert(x_SM, torch.full((1,), S, dtype=torch.int32, device=x.device), remake))
        out_SM = ops.gather_tokens(y_RM, s, None if row_scale_R is not None else g.scores, backend=self.backend)
        if shared_SM is not None:
            out_SM = out_SM + shared_SM
        # Copied into the buffer: a detached alias shares kept_counts' version counter, so an in-place
        # all-reduce of the load between forward and backward failed the backward (kept_counts is saved
        # for it); and assigning a new tensor is a side effect that dynamo refuses inside
        # torch.utils.checkpoint in a compiled region. A buffer made under inference_mode cannot be
        # written outside it: then a normal tensor replaces it once (eager: dynamo cannot trace the test).
        if replaying():  # the forward's counts stay: a later micro-batch's forward may have written them
            return out_SM.view(x.shape), aux_loss
        if (not torch.compiler.is_compiling() and self.expert_load.is_inference()
                and not torch.is_inference_mode_enabled()):
            self.expert_load = torch.empty_like(s.kept_counts)
        plain_call("MoELayer.expert_load", self.expert_load.copy_, s.kept_counts)  # (a torch.func transform's too)
        return out_SM.view(x.shape), aux_loss

    def _rts_draw(self, capacity: Optional[int]) -> Optional[torch.Tensor]:
        """What makes this forward's random token selection: nothing in eval (`seed` alone), and in
        training a draw from torch's CPU generator that assign_slots mixes into `seed` (seed ^ draw),
        a fresh selection each step. A tensor, not an int, so torch.compile traces it. That generator is
        the state activation checkpointing saves and restores (torch.utils.checkpoint, Megatron's and
        DeepSpeed's recomputation), so a recomputed forward drops the same routes and the gradients
        are those of the forward; it lives on the host, so the draw is no device sync. To resume the
        same stream, restore `seed` (in the state dict) and torch's RNG state (torch.set_rng_state)."""
        if not (self.training and self.drop_policy == "rts" and capacity is not None):
            return None
        return ops.rts_draw()

    def get_extra_state(self):
        return {"seed": self.seed}

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if prefix + "_extra_state" in missing_keys:  # saved before the seed was: keep this layer's own
            missing_keys.remove(prefix + "_extra_state")

    def set_extra_state(self, state):
        if not isinstance(state, dict) or "seed" not in state:
            raise TypeError(f"MoELayer's extra state must be {{'seed': int}}, got {state!r}")
        ops.check_seed(state["seed"])
        self.seed = state["seed"]
