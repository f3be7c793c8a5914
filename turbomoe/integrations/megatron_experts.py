"""Megatron-core experts on turbomoe's grouped GEMM, with the parameters of Megatron's GroupedMLP.

`TurboGroupedMLP(num_local_experts, config, pg_collection)` is called as Megatron calls its experts,
`experts(tokens [R, H], tokens_per_expert [El] (int32, on the device), probs [R]) -> (out [R, H], None)`,
and applies the probs as Megatron's experts do: after the activation, before fc2 (probs None: not at
all, for a caller that weighs the output rows itself). With a plain SwiGLU (silu, no clamp, no offset;
or Megatron's fused one, bias_activation_fusion, which ignores the clamp) they scale the activation
inside turbomoe's SwiGLU kernel, whose backward forms their gradient (one pass, rounded once), unless
megatron_rounding asks for Megatron's own (its fused weighted SwiGLU, or the activation times the
probs) or activation_func_fp8_input_store (with the fusion) its fp8-stored input. Its parameters are
GroupedMLP's, weight1 [H, El * 2F] (gated: [gate | up] per expert; else El * F) and weight2 [El * F, H],
which are turbomoe's w1 [El, H, 2F] and w2 [El, F, H] in memory, so the GEMMs read them as views.
It is a GroupedMLP subclass for GroupedMLP's sharded_state_dict (the same distributed-checkpoint
keys and shapes as stock's SequentialMLP and GroupedMLP: checkpoints move both ways); its
constructor replaces GroupedMLP's, which requires the grouped_gemm package.
With `config.gradient_accumulation_fusion` and a `main_grad` on the weights (Megatron's
DistributedDataParallel gives every parameter one: the fp32 gradient buffer), the weight gradients are
added to main_grad inside turbomoe's weight-gradient GEMM, as Megatron's and Transformer Engine's
linears do, instead of a bf16 gradient that DDP's hook then adds (no bf16 gradient written and read
back, none rounded to bf16): in the cutlass backend's kernel (bf16 on Hopper), else in the Triton
kernel where experts average at most FUSED_WGRAD_MAX_ROWS rows, else the backend's gradient and an
add (turbomoe.autograd.grouped_gemm.mm_wgrad).
With Megatron's moe_act recompute (recompute_granularity "selective", "moe_act" in recompute_modules)
the activation's output is freed after fc2 and recomputed in backward, as GroupedMLP does it.
Expert tensor parallelism is not supported (expert_tensor_parallel_size must be 1).
"""
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu, _initialize_affine_weight_gpu
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import GroupedMLP
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from torch.nn.parameter import Parameter

from ..autograd.grouped_gemm import grouped_mm, row_offsets
from ..autograd.swiglu import swiglu
from .megatron_config import check_no_expert_bias


class TurboGroupedMLP(GroupedMLP):

    def __init__(self, num_local_experts: int, config, pg_collection=None, gmm_backend: Optional[str] = None,
                 megatron_rounding: bool = False):
        MegatronModule.__init__(self, config=config)  # not GroupedMLP's: it asserts grouped_gemm is installed
        self.megatron_rounding = megatron_rounding
        pg_collection = pg_collection or get_default_pg_collection()
        if pg_collection.expt_tp.size() != 1:
            raise ValueError("turbomoe's Megatron experts need expert_tensor_parallel_size = 1, got "
                             f"{pg_collection.expt_tp.size()}")
        check_no_expert_bias(config)
        self.num_local_experts, self.gmm_backend = num_local_experts, gmm_backend
        self.ep_group, self.tp_group, self.dp_group = pg_collection.ep, pg_collection.expt_tp, pg_collection.expt_dp
        self.expert_parallel = config.expert_model_parallel_size > 1
        self.activation_recompute = (config.recompute_granularity == "selective"
                                     and "moe_act" in config.recompute_modules)
        H, Fe = config.hidden_size, config.moe_ffn_hidden_size
        fc1_size = Fe * num_local_experts * (2 if config.gated_linear_unit else 1)
        fc2_size = Fe * num_local_experts
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight1 = Parameter(torch.empty(H, fc1_size, device=device, dtype=config.params_dtype))
        self.weight2 = Parameter(torch.empty(fc2_size, H, device=device, dtype=config.params_dtype))
        if config.perform_initialization:
            if config.use_cpu_initialization:
                _initialize_affine_weight_cpu(self.weight1, H, fc1_size, fc1_size, partition_dim=1,
                                              init_method=config.init_method, params_dtype=config.params_dtype,
                                              rank=0, world_size=1)
                _initialize_affine_weight_cpu(self.weight2, fc2_size, H, fc2_size, partition_dim=0,
                                              init_method=config.output_layer_init_method,
                                              params_dtype=config.params_dtype, rank=0, world_size=1)
            else:
                _initialize_affine_weight_gpu(self.weight1, config.init_method, partition_dim=1, is_expert=True)
                _initialize_affine_weight_gpu(self.weight2, config.output_layer_init_method, partition_dim=0,
                                              is_expert=True)
        # Expert weights are reduced over the expert-data-parallel group, not the data-parallel one.
        setattr(self.weight1, "allreduce", not self.expert_parallel)
        setattr(self.weight2, "allreduce", not self.expert_parallel)
        self.register_load_state_dict_post_hook(_ignore_extra_states)

    def forward(self, tokens_RH: torch.Tensor, tokens_per_expert: torch.Tensor, probs_R: torch.Tensor):
        El, H = self.num_local_experts, self.config.hidden_size
        counts_E = tokens_per_expert.to(device=tokens_RH.device, dtype=torch.int32)
        if self.config.moe_apply_probs_on_input and probs_R is not None:
            tokens_RH = (probs_R.unsqueeze(-1) * tokens_RH).to(tokens_RH.dtype)
            probs_R = torch.ones_like(probs_R)
        offs_E = row_offsets(counts_E)  # once for the four GEMMs
        w1_EHN, w2_EFH = self.weight1.view(El, H, -1), self.weight2.view(El, -1, H)
        h_RN = grouped_mm(tokens_RH, w1_EHN, counts_E, self.gmm_backend, offs_E,
                          self._fused_main_grad(self.weight1, w1_EHN))
        if self.activation_recompute:
            # config.fp8 is None without fp8: the class takes any other value, False too, for fp8 on
            recompute = tensor_parallel.CheckpointWithoutOutput(fp8=self.config.fp8)
            a_RF = recompute.checkpoint(self._activation_with_probs, h_RN, probs_R)
        else:
            a_RF = self._activation_with_probs(h_RN, probs_R)
        out_RH = grouped_mm(a_RF, w2_EFH, counts_E, self.gmm_backend, offs_E,
                            self._fused_main_grad(self.weight2, w2_EFH))
        if self.activation_recompute:  # a_RF's memory freed; refilled before fc2's backward reads it
            recompute.discard_output_and_register_recompute(out_RH)
        return out_RH, None

    def _fused_main_grad(self, weight: Parameter, w_GKN: torch.Tensor) -> Optional[torch.Tensor]:
        """weight.main_grad viewed as w_GKN (the GEMM's view of weight) where the weight gradient goes
        there directly: config.gradient_accumulation_fusion, a gradient to compute, and the weight in Megatron's DDP (a
        main_grad and the grad_added_to_main_grad flag its hook reads; not zero_out_wgrad, where the
        hook adds the weight's gradient itself); else None. The weight is then marked as Megatron's
        linears mark it, so that DDP's hook does not add the placeholder gradient."""
        if not (self.config.gradient_accumulation_fusion and torch.is_grad_enabled() and weight.requires_grad
                and getattr(weight, "main_grad", None) is not None and hasattr(weight, "grad_added_to_main_grad")
                and not getattr(weight, "zero_out_wgrad", False)):
            return None
        weight.grad_added_to_main_grad = True  # DDP clears it when it zeroes the buffer, every step
        return weight.main_grad.view_as(w_GKN)

    @property
    def plain_swiglu(self) -> bool:
        """Megatron's experts compute silu(gate) * up exactly (turbomoe's SwiGLU kernel computes it): no
        clamp and no offset, or its fused SwiGLU (bias_activation_fusion; the config refuses an offset
        there), which ignores activation_func_clamp_value."""
        cfg = self.config
        return (cfg.gated_linear_unit and cfg.activation_func is F.silu and cfg.glu_linear_offset == 0
                and (cfg.activation_func_clamp_value is None or cfg.bias_activation_fusion))

    @property
    def fp8_input_store(self) -> bool:
        """Megatron's fused weighted SwiGLU keeps its input in fp8 for backward (a SwiGLU-only option):
        its gradients come from that rounded input, so the experts run it, the probs included."""
        return self.config.activation_func_fp8_input_store and self.config.bias_activation_fusion

    @property
    def probs_in_kernel(self) -> bool:
        """Whether the probs scale the activation inside turbomoe's SwiGLU kernel."""
        return self.plain_swiglu and not (self.megatron_rounding or self.fp8_input_store)

    @property
    def takes_probs(self) -> bool:
        """Whether the experts apply the probs whatever the layer asks (else it may weigh their rows in the
        gather): in turbomoe's SwiGLU kernel, or in Megatron's fused one storing its input in fp8."""
        return self.probs_in_kernel or self.fp8_input_store

    def _activation_with_probs(self, h_RN: torch.Tensor, probs_R: Optional[torch.Tensor]) -> torch.Tensor:
        """act(h) * probs in h's dtype, as Megatron's MLP does it for experts (per_token_scale)."""
        cfg = self.config
        silu_glu = cfg.gated_linear_unit and cfg.activation_func is F.silu
        if self.probs_in_kernel:  # turbomoe's kernel, the probs included where given
            return swiglu(h_RN, probs_R)
        if silu_glu and cfg.bias_activation_fusion and probs_R is not None:
            return weighted_bias_swiglu_impl(h_RN, None, probs_R.unsqueeze(-1), cfg.activation_func_fp8_input_store)
        if self.plain_swiglu:
            a_RF = swiglu(h_RN)  # turbomoe's kernel
        elif cfg.gated_linear_unit:
            gate, up = torch.chunk(h_RN, 2, dim=-1)
            if cfg.activation_func_clamp_value is not None:
                gate = gate.clamp(max=cfg.activation_func_clamp_value)
                up = up.clamp(min=-cfg.activation_func_clamp_value, max=cfg.activation_func_clamp_value)
            a_RF = cfg.activation_func(gate) * (up + cfg.glu_linear_offset)
        else:
            a_RF = cfg.activation_func(h_RN)
        return a_RF if probs_R is None else (a_RF * probs_R.unsqueeze(-1)).to(h_RN.dtype)


def _ignore_extra_states(module, incompatible_keys):
    """GroupedMLP's hook: the fake _extra_state keys (kept for SequentialMLP compatibility) are not ours."""
    for key in [k for k in incompatible_keys.unexpected_keys if "_extra_state" in k]:
        incompatible_keys.unexpected_keys.remove(key)
