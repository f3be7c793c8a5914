"""turbomoe as an experts implementation of transformers 5.x's MoE models (Qwen3-MoE, Mixtral, ...).

    import turbomoe.integrations.transformers as tt
    tt.register()                                   # idempotent
    model.set_experts_implementation("turbomoe")    # or from_pretrained(..., experts_implementation="turbomoe")

transformers' experts modules (Qwen3MoeExperts, MixtralExperts, ...) hold 3-D weights, gate_up_proj
[E, 2F, H] and down_proj [E, H, F] (or their transposes, flagged is_transposed), and are called with
the router's choices: x [S, H], top_k_index [S, k], top_k_weights [S, k]. This one runs them on
turbomoe's dropless path, as turbomoe's own MoE layer does:
  assign_slots -> scatter_tokens [S*k, H] expert-contiguous -> grouped GEMM (counts on the device,
  no host sync on CUDA) -> SwiGLU (times the routing weight, for bias-free [gate | up] silu experts)
  -> grouped GEMM -> gather_tokens (fp32 sums; weighted by the routing weights in other layouts)
with hand-written backward passes for every op, including the gradient of the routing weights.
"""
import torch

from .. import ops
from ..autograd.bias_act import bias_act
from ..autograd.grouped_gemm import grouped_mm, row_groups, row_offsets
from ..autograd.swiglu import swiglu

NAME = "turbomoe"


def _grouped_linear(x_RK: torch.Tensor, w: torch.Tensor, bias, counts_E: torch.Tensor, transposed: bool):
    """Expert e's rows of x times its weight: w [E, N, K] as nn.Linear stores it, or [E, K, N] transposed."""
    w_EKN = w if transposed else w.transpose(1, 2)
    offs_E = row_offsets(counts_E)
    y_RN = grouped_mm(x_RK, w_EKN, counts_E, offs_G=offs_E)
    if bias is None:
        return y_RN
    return bias_act(y_RN, bias, row_groups(offs_E, x_RK.shape[0]))


def _plain_swiglu(experts) -> bool:
    """The default [gate | up] layout with silu: turbomoe's fused SwiGLU computes the gate."""
    from transformers.activations import SiLUActivation
    if not (_flag(experts, "has_gate") and _flag(experts, "is_concatenated")):
        return False
    act = getattr(experts, "act_fn", None)
    # Lfm2-MoE holds the function itself, not a module
    silu = isinstance(act, (SiLUActivation, torch.nn.SiLU)) or act is torch.nn.functional.silu
    return silu and getattr(type(experts)._apply_gate, "__name__", None) == "_default_apply_gate"


def _activation(experts, h_R2F: torch.Tensor) -> torch.Tensor:
    """The module's own gate (interleaved layouts, clamped or other activations) or activation."""
    return experts._apply_gate(h_R2F) if _flag(experts, "has_gate") else experts.act_fn(h_R2F)


_FLAGS = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
          "has_post_expert_norm": False, "_is_expert_parallel": False}


def _flag(experts, name: str) -> bool:
    """use_experts_implementation's layout flags; releases before one was added had its default."""
    return getattr(experts, name, _FLAGS[name])


def turbomoe_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts-function signature: x [S, H], ids [S, k], weights [S, k] -> [S, H]."""
    if _flag(self, "_is_expert_parallel"):
        raise NotImplementedError("experts_implementation 'turbomoe' does not run transformers' expert "
                                  "parallelism; use turbomoe's own MoE layers (turbomoe.models) for that")
    if _flag(self, "has_post_expert_norm"):
        raise NotImplementedError(f"{type(self).__name__} normalises each expert's output; experts_implementation "
                                  f"'turbomoe' does not")
    if not isinstance(top_k_index, torch.Tensor) or top_k_index.dim() != 2:
        # checked before k: a 1-D index's last dim is the token count, not k
        raise ValueError(f"top_k_index must be a 2-D [S, k] tensor of expert ids, got "
                         f"{tuple(top_k_index.shape) if isinstance(top_k_index, torch.Tensor) else type(top_k_index)}")
    if top_k_index.shape[-1] > ops.MAX_K:
        raise NotImplementedError(f"{type(self).__name__} routes {top_k_index.shape[-1]} experts a token; "
                                  f"experts_implementation 'turbomoe' takes at most {ops.MAX_K} (its slot tables)")
    E = self.num_experts
    gated, biased, transposed = _flag(self, "has_gate"), _flag(self, "has_bias"), _flag(self, "is_transposed")
    up = self.gate_up_proj if gated else self.up_proj
    s = ops.assign_slots(top_k_index, top_k_weights, E)  # dropless: rows [0, S*k), expert-contiguous
    # In the weights' dtype, as transformers' grouped_mm: under autocast a bf16 projection (NemotronH's
    # latent MoE) meets fp32 weights, which F.linear's autocast takes and the grouped GEMM does not.
    cast = isinstance(hidden_states, torch.Tensor) and hidden_states.is_floating_point()  # else ops' error
    x_RH = ops.scatter_tokens(hidden_states.to(up.dtype) if cast else hidden_states, s)
    up_bias = (self.gate_up_proj_bias if gated else self.up_proj_bias) if biased else None
    h = _grouped_linear(x_RH, up, up_bias, s.kept_counts, transposed)
    plain = _plain_swiglu(self)
    # Bias-free SwiGLU experts take the routing weights inside the SwiGLU kernel (before down_proj,
    # which is linear): the gather sums with weight 1 and keeps no expert output for their gradient.
    scale_R = ops.row_scores(s, top_k_weights) if plain and not biased else None
    a_RF = swiglu(h, scale_R) if plain else _activation(self, h)
    y_RH = _grouped_linear(a_RF, self.down_proj, self.down_proj_bias if biased else None, s.kept_counts, transposed)
    return ops.gather_tokens(y_RH, s, top_k_weights if scale_R is None else None).to(hidden_states.dtype)


def register() -> str:
    """Add "turbomoe" to transformers' experts registry (again is a no-op); returns the name."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    if ALL_EXPERTS_FUNCTIONS.get(NAME) is not turbomoe_experts_forward:
        ALL_EXPERTS_FUNCTIONS.register(NAME, turbomoe_experts_forward)
    return NAME


__all__ = ["register", "turbomoe_experts_forward", "NAME"]
