"""turbomoe in megatron-core (0.16) GPT models: router, dispatcher and experts in a module spec.

    from turbomoe.integrations.megatron import get_turbomoe_gpt_decoder_block_spec
    spec = get_turbomoe_gpt_decoder_block_spec(config, use_transformer_engine=False)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=..., max_sequence_length=...)

or turn any existing spec's MoE layers into turbomoe's: `use_turbomoe(spec)`, or build the MoE
module spec alone: `get_turbomoe_moe_spec(config)`.
The pieces (each its own module; megatron_config.check_config says which settings are covered):
  TurboTopKRouter   (megatron_router)      TopKRouter on turbomoe.ops.topk_gating and assign_slots
  TurboTokenDispatcher (megatron_dispatcher) scatter / gather, Megatron's all-to-all over ep ranks
  TurboGroupedMLP   (megatron_experts)     turbomoe's grouped GEMM, GroupedMLP's parameters
  TurboMoELayer     (here)                 MoELayer with the dispatcher installed; it keeps
                                           MoELayer's forward (shared experts, recompute); the
                                           probs scale the experts' SwiGLU in turbomoe's kernel
                                           (other activations: in the gather kernel;
                                           probs_before_fc2=True: Megatron's own rounding)
The layer does not sync with the host when ep_size == 1 (dropless or with a capacity), nor with a
capacity below the local token count at any ep_size; dropless with ep_size > 1 (a capacity that
reaches the token count drops nothing and runs dropless) reads the all-to-all split sizes once.
turbomoe's dispatcher replaces the one config.moe_token_dispatcher_type names (allgather or alltoall:
MoELayer builds it first). Configs the
integration does not cover raise ValueError from check_config, naming the field.
"""
import copy
import functools
from typing import Optional

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from .. import ops
from .megatron_config import check_config
from .megatron_dispatcher import TurboTokenDispatcher
from .megatron_experts import TurboGroupedMLP
from .megatron_router import DROP_POLICIES, TurboTopKRouter


class TurboMoELayer(MoELayer):
    """megatron-core's MoELayer with turbomoe's router, dispatcher and experts (see the module doc).

    MoELayer.forward runs as stock's, with route -> preprocess -> dispatch -> experts -> combine ->
    postprocess carrying turbomoe's tables instead of [T, E] maps.
    """

    def __init__(self, config, submodules: Optional[MoESubmodules] = None, layer_number: Optional[int] = None,
                 pg_collection=None, backend: Optional[str] = None, probs_before_fc2: bool = False):
        check_config(config)
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         pg_collection=pg_collection)
        if not isinstance(self.router, TurboTopKRouter):
            raise TypeError(f"TurboMoELayer needs a TurboTopKRouter, got {type(self.router).__name__}")
        # The experts take the probs: in turbomoe's SwiGLU kernel or Megatron's fp8-storing one (takes_probs),
        # before fc2 with Megatron's rounding (probs_before_fc2), or on their input (moe_apply_probs_on_input);
        # else the gather kernel does.
        in_combine = not (getattr(self.experts, "takes_probs", False) or probs_before_fc2
                          or config.moe_apply_probs_on_input)
        self.token_dispatcher = TurboTokenDispatcher(self.num_local_experts, config.num_moe_experts, self.ep_group,
                                                     backend, probs_in_combine=in_combine)
        self._hidden_shape = None

    def route(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        return self.router(hidden_states, padding_mask, sparse=True), None

    def preprocess(self, hidden_states: torch.Tensor, routing, routing_map=None):
        self._hidden_shape = hidden_states.shape
        return hidden_states.reshape(-1, hidden_states.shape[-1]), routing

    def dispatch(self, x_TH: torch.Tensor, routing):
        tokens_RH, counts_E, probs_R = self.token_dispatcher.dispatch(x_TH, routing)
        return tokens_RH, (counts_E, probs_R)

    def routed_experts_compute(self, tokens_RH: torch.Tensor, counts_and_probs):
        counts_E, probs_R = counts_and_probs
        return self.experts(tokens_RH, counts_E, probs_R)

    def combine(self, y_RH: torch.Tensor) -> torch.Tensor:
        return self.token_dispatcher.combine(y_RH)

    def postprocess(self, out_TH: torch.Tensor, shared_expert_output: Optional[torch.Tensor]):
        out = out_TH.view(self._hidden_shape)
        return out if shared_expert_output is None else out + shared_expert_output


def get_turbomoe_moe_spec(config=None, *, shared_experts: Optional[ModuleSpec] = None,
                          drop_policy: Optional[str] = None, backend: Optional[str] = None,
                          gmm_backend: Optional[str] = None, probs_before_fc2: bool = False) -> ModuleSpec:
    """ModuleSpec of turbomoe's MoE layer (the `mlp` of an MoE TransformerLayer).

    config: checked now if given (else when the layer is built). shared_experts: the shared
    expert's spec (default: Megatron's local SharedExpertMLP; pass the TE one from a TE layer
    spec, or use use_turbomoe, which keeps the spec's own). drop_policy: None follows
    config.moe_token_drop_policy; "rts" is turbomoe's random token selection. backend /
    gmm_backend: turbomoe's op and grouped-GEMM backends (None: the fastest that applies).
    probs_before_fc2: False (default): with SwiGLU experts the probs scale the activation inside
    turbomoe's SwiGLU kernel (before fc2, as Megatron applies them; rounded once, and the experts'
    output is not kept for the probs' gradient), with other activations they weigh each expert output
    row inside turbomoe's gather kernel (the same in exact arithmetic, as fc2 has no bias). True:
    Megatron's own rounding, its fused weighted SwiGLU or the activation times the probs (an [R, F]
    multiply each way: 1.23-1.40x the layer's time at the benchmark shapes on an H100,
    notes/megatron_core.md).
    """
    if config is not None:
        check_config(config)
    ops.check_bool("probs_before_fc2", probs_before_fc2)
    if drop_policy is not None and drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy must be None or one of {DROP_POLICIES}, got {drop_policy!r}")
    if shared_experts is None:
        from megatron.core.models.backends import LocalSpecProvider
        local = LocalSpecProvider()
        shared_experts = ModuleSpec(module=SharedExpertMLP, submodules=MLPSubmodules(
            linear_fc1=local.column_parallel_linear(), linear_fc2=local.row_parallel_linear()))
    router = functools.partial(TurboTopKRouter, drop_policy=drop_policy, backend=backend)
    experts = ModuleSpec(module=TurboGroupedMLP, params={"gmm_backend": gmm_backend,
                                                         "megatron_rounding": probs_before_fc2})
    return ModuleSpec(module=TurboMoELayer, params={"backend": backend, "probs_before_fc2": probs_before_fc2},
                      submodules=MoESubmodules(experts=experts, shared_experts=shared_experts, router=router),
                      metainfo={"fuse_pre_mlp_layernorm": False})


def _is_moe_spec(spec) -> bool:
    return isinstance(spec, ModuleSpec) and isinstance(spec.module, type) and issubclass(spec.module, MoELayer)


def use_turbomoe(spec, **kwargs):
    """A copy of a layer spec (ModuleSpec; it must hold an MoE layer) or a block spec
    (TransformerBlockSubmodules, or a list of layer specs) whose MoE layers are turbomoe's; each keeps
    its shared-expert spec. kwargs: those of get_turbomoe_moe_spec."""
    spec = copy.deepcopy(spec)
    one_layer = isinstance(spec, ModuleSpec)
    layers = [spec] if one_layer else spec if isinstance(spec, list) else spec.layer_specs
    swapped = 0
    for layer in layers:
        sub = layer.submodules
        if sub is not None and _is_moe_spec(getattr(sub, "mlp", None)):
            sub.mlp = get_turbomoe_moe_spec(shared_experts=sub.mlp.submodules.shared_experts, **kwargs)
            swapped += 1
    if one_layer and not swapped:  # a block may hold only dense layers in a pipeline stage
        raise ValueError("the layer spec has no MoE layer (an mlp whose module is a MoELayer) to replace")
    return spec


def get_turbomoe_gpt_decoder_block_spec(config, use_transformer_engine: bool, normalization: Optional[str] = None,
                                        qk_l2_norm: Optional[bool] = False, vp_stage: Optional[int] = None,
                                        pp_rank: Optional[int] = None, **kwargs):
    """megatron's get_gpt_decoder_block_spec (same arguments) with turbomoe's MoE layers; kwargs: those
    of get_turbomoe_moe_spec. Dense layers (config.moe_layer_freq) and everything else stay stock's."""
    check_config(config)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine, normalization, qk_l2_norm, vp_stage, pp_rank)
    return use_turbomoe(block, **kwargs)
