"""TopKRouter: hidden states [S, M] -> the gating tables (ids, scores, counts) and the router loss."""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..autograd.router import fp32_logits
from ..reference import GatingOutput
from .recompute import replaying


class TopKRouter(nn.Module):
    """Linear router with softmax or sigmoid scores and top-k selection.

    router loss = aux_loss_coef * DeepSpeed's load-balancing loss + z_loss_coef * z-loss.
    expert_bias=True adds a buffer `expert_bias` [E] (fp32) that steers the choice but not the score
    (auxiliary-loss-free balancing); move it toward balance with `update_expert_bias`.
    Logits are computed in router_dtype, by default the input's dtype (Megatron-core's default; the
    gating math is fp32 either way); router_dtype=torch.float32 computes them with fp32 products and
    sums (autograd.router.fp32_logits: no fp32 copy of x kept for backward).
    """

    def __init__(self, hidden_size: int, num_experts: int, k: int, score_func: str = "softmax",
                 renormalize: bool = False, aux_loss_coef: float = 0.01, z_loss_coef: float = 0.0,
                 expert_bias: bool = False, router_dtype: Optional[torch.dtype] = None,
                 backend: Optional[str] = None, device=None, dtype=None):
        super().__init__()
        ops.check_int("hidden_size", hidden_size, 1)
        ops.check_int("num_experts", num_experts, 1)
        ops.check_bool("renormalize", renormalize)
        ops.check_bool("expert_bias", expert_bias)
        ops.check_dtype("dtype", dtype)
        # Checked here: a bad one (the string "float32") failed at the first forward, as a device string.
        if router_dtype is not None and not (isinstance(router_dtype, torch.dtype) and router_dtype.is_floating_point):
            raise TypeError(f"router_dtype must be None or a floating-point torch.dtype, got {router_dtype!r}")
        ops.check_number("aux_loss_coef", aux_loss_coef, 0)
        ops.check_number("z_loss_coef", z_loss_coef, 0)
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= min(num_experts, ops.MAX_K):
            raise ValueError(f"k must be an int in [1, min(num_experts, {ops.MAX_K})], got k={k!r} "
                             f"with num_experts={num_experts}")
        if score_func not in ops.SCORE_FUNCS:
            raise ValueError(f"score_func must be one of {ops.SCORE_FUNCS}, got {score_func!r}")
        ops.check_backend(backend)
        self.hidden_size, self.num_experts, self.k = hidden_size, num_experts, k
        self.score_func, self.renormalize = score_func, renormalize
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.router_dtype, self.backend = router_dtype, backend
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=dtype))
        if expert_bias:
            self.register_buffer("expert_bias", torch.empty(num_experts, device=device, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.reset_parameters()

    def reset_parameters(self):
        """The weight drawn as at construction, the expert bias zero (after `to_empty` from the meta device)."""
        nn.init.normal_(self.weight, std=self.hidden_size ** -0.5)
        if self.expert_bias is not None:
            nn.init.zeros_(self.expert_bias)

    def _apply(self, fn, recurse=True):
        """.to(), .half() and the like keep expert_bias fp32: in bf16 a 1e-3 update step is below the
        spacing from |bias| 0.25, so balancing would stop (Megatron keeps its bias fp32 the same way).
        The fp32 values are kept as they were, not recast from fn's 16-bit rounding of them."""
        bias_E = self.expert_bias
        super()._apply(fn, recurse)
        if bias_E is not None and self.expert_bias.dtype != torch.float32:
            # fn moved it (device) and cast it: take the device, keep the old fp32 bits
            self.expert_bias = bias_E.to(device=self.expert_bias.device, dtype=torch.float32)
        return self

    def forward(self, x_SM: torch.Tensor) -> Tuple[GatingOutput, torch.Tensor]:
        """x [S, M] -> (GatingOutput: expert_ids [S, k], scores [S, k] fp32, counts [E], ...; loss)."""
        if not isinstance(x_SM, torch.Tensor) or x_SM.dim() != 2 or x_SM.shape[1] != self.hidden_size:
            raise ValueError(f"x must be [S, {self.hidden_size}], got {tuple(getattr(x_SM, 'shape', ()))}")
        if not x_SM.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor, got {x_SM.dtype}")
        dtype = self.router_dtype or x_SM.dtype
        if dtype == torch.float32 and ops.forced_backend(self.backend) == "reference":
            # plain ops: differentiable twice
            with torch.autocast(x_SM.device.type, enabled=False):  # fp32 logits under autocast too
                logits_SE = F.linear(x_SM.float(), self.weight.float())
        elif dtype == torch.float32:
            logits_SE = fp32_logits(x_SM, self.weight)
        else:
            logits_SE = F.linear(x_SM.to(dtype), self.weight.to(dtype))
        if self.expert_bias is not None and not torch.compiler.is_compiling():
            self._check_bias_unchanged()
        g = ops.topk_gating(logits_SE, self.k, self.score_func, self.renormalize, self.expert_bias,
                            backend=self.backend)
        loss = self.aux_loss_coef * g.aux_loss
        if self.z_loss_coef:  # skipped at 0: two launches fewer each way
            loss = loss + self.z_loss_coef * g.z_loss
        return g, loss

    def _check_bias_unchanged(self):
        """An activation checkpoint's replay routes with the bias as it is at backward: changed since the
        forward, it would pick other experts and give the gradients of another step, silently. Compared
        with the last forward's: an update between two micro-batches' forwards goes unseen."""
        version = self.expert_bias._version
        if not replaying():
            self._bias_version = version
        elif version != getattr(self, "_bias_version", version):
            raise RuntimeError("expert_bias changed between this router's forward and its backward, which "
                               "recomputes the forward (activation checkpointing): call update_expert_bias "
                               "after the backward")

    @torch.no_grad()
    def update_expert_bias(self, load_E: torch.Tensor, rate: float = 1e-3):
        """bias_e += rate * sign(mean load - load_e): under-loaded experts get picked more (DeepSeek-V3).
        On the device, no host sync. Call it after the backward: an activation checkpoint's replay of
        the forward must route as the forward did."""
        if self.expert_bias is None:
            raise RuntimeError("this router was built with expert_bias=False")
        # A load of another shape would broadcast: [1] or a scalar left the bias as it was, silently.
        if not isinstance(load_E, torch.Tensor) or tuple(load_E.shape) != (self.num_experts, ):
            raise ValueError(f"load must be a tensor of shape [{self.num_experts}] (tokens per expert), got "
                             f"{tuple(load_E.shape) if isinstance(load_E, torch.Tensor) else type(load_E).__name__}")
        ops.check_number("rate", rate, 0)  # a NaN rate would make every bias NaN
        load = load_E.to(torch.float32)
        self.expert_bias.add_(rate * torch.sign(load.mean() - load))

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, k={self.k}, "
                f"score_func={self.score_func}, renormalize={self.renormalize}, "
                f"expert_bias={self.expert_bias is not None}")
