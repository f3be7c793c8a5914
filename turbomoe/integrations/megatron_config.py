"""Which megatron-core TransformerConfig settings turbomoe's Megatron-core MoE layer covers."""
import torch.nn.functional as F

from ..ops import MAX_K

_UNSUPPORTED = (  # (config field, value that is supported, why)
    ("moe_router_fusion", False, "Transformer Engine's fused router (turbomoe's gating is fused already)"),
    ("moe_enable_routing_replay", False, "routing replay"),
    ("moe_pad_expert_input_to_capacity", False, "padding to capacity (turbomoe's capacity buffer is padded)"),
    ("moe_latent_size", None, "latent projections"),
    ("moe_shared_expert_overlap", False, "shared-expert overlap (needs Megatron's alltoall dispatcher)"),
    # Megatron's fine-grained schedule detaches the layer's probs as one tensor; turbomoe's are tables.
    ("overlap_moe_expert_parallel_comm", False, "expert-parallel communication overlap"),
    ("fp8", None, "fp8 experts"),
    ("fp4", None, "fp4 experts"),
)


def check_no_expert_bias(config):
    """turbomoe's Megatron experts (TurboGroupedMLP) have no biases, as Megatron's GroupedMLP."""
    if config.add_bias_linear:
        raise ValueError("turbomoe's Megatron experts have no bias (as GroupedMLP): set config.add_bias_linear=False")


def check_config(config):
    """ValueError naming the first field of config that turbomoe's Megatron layer does not cover."""
    if config.moe_token_dispatcher_type not in ("allgather", "alltoall"):
        raise ValueError("turbomoe's Megatron-core MoE layer replaces the token dispatcher; MoELayer still builds "
                         "stock's first: config.moe_token_dispatcher_type must be 'allgather' or 'alltoall', got "
                         f"{config.moe_token_dispatcher_type!r}")
    # Megatron's top-k groups only where moe_router_group_topk is truthy (moe_router_num_groups alone, or a
    # group top-k of 0, is plain top-k)
    if getattr(config, "moe_router_group_topk", None):
        raise ValueError("turbomoe's Megatron-core MoE layer does not support group-limited routing: "
                         f"config.moe_router_group_topk = {config.moe_router_group_topk!r} (needs None or 0)")
    for field, ok, what in _UNSUPPORTED:
        value = getattr(config, field, ok)
        if value != ok:
            raise ValueError(f"turbomoe's Megatron-core MoE layer does not support {what}: "
                             f"config.{field} = {value!r} (needs {ok!r})")
    # Partial graphs capture MoELayer.route / preprocess alone and replay their tensors; turbomoe's
    # route returns tables (Routing), and its layer would run whole inside the router's graph.
    if getattr(config, "cuda_graph_impl", "none") != "none":
        scope = config.cuda_graph_scope
        names = {getattr(s, "name", s) for s in (scope if isinstance(scope, (list, tuple)) else [scope])}
        if names & {"moe_router", "moe_preprocess"}:
            raise ValueError("turbomoe's Megatron-core MoE layer does not support partial CUDA graphs of the MoE "
                             f"layer: config.cuda_graph_scope = {scope!r} holds moe_router / moe_preprocess")
    if config.moe_apply_probs_on_input and config.moe_router_topk != 1:
        raise ValueError("config.moe_apply_probs_on_input needs moe_router_topk = 1 (as Megatron's experts assert), "
                         f"got {config.moe_router_topk}")
    types = config.moe_router_load_balancing_type
    for t in (types if isinstance(types, list) else [types]):
        if t not in ("aux_loss", "seq_aux_loss", "global_aux_loss", "none"):
            raise ValueError(f"config.moe_router_load_balancing_type: {t!r} is not supported by turbomoe's router "
                             "(aux_loss, seq_aux_loss, global_aux_loss, none)")
    E, k = config.num_moe_experts, config.moe_router_topk
    if E is None or not 1 <= k <= min(E, MAX_K):
        raise ValueError(f"config.moe_router_topk must be in [1, min(num_moe_experts, {MAX_K})], got {k} with "
                         f"num_moe_experts={E}")
    # Stock's experts then run Transformer Engine's activation op (its GELU is the tanh form, non-gated silu maps
    # to its ReLU; no clamp, offset or exact input); turbomoe's compute activation_func: the same for SwiGLU alone.
    if config.use_te_activation_func and not (
            config.gated_linear_unit and config.activation_func is F.silu and config.glu_linear_offset == 0
            and config.activation_func_clamp_value is None and not config.activation_func_fp8_input_store):
        raise ValueError("turbomoe's Megatron experts compute config.activation_func, not Transformer Engine's "
                         "activation ops: config.use_te_activation_func=True is supported with the plain SwiGLU "
                         "alone (gated silu, no clamp, offset or fp8 input store)")
    check_no_expert_bias(config)
    if (config.expert_tensor_parallel_size or 1) != 1:
        raise ValueError("turbomoe's Megatron-core MoE layer needs config.expert_tensor_parallel_size = 1, got "
                         f"{config.expert_tensor_parallel_size}")
