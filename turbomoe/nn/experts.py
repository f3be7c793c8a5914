"""GroupedExperts: E expert MLPs with stacked weights, run as grouped GEMMs over expert-contiguous rows."""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as nn_module

from .. import ops
from ..autograd.bias_act import bias_act
from ..autograd.grouped_gemm import check_gmm_backend, forced_gmm_backend, grouped_mm, row_groups, row_offsets
from ..autograd.swiglu import swiglu
from .recompute import Remake

ACTIVATIONS = ("swiglu", "gelu")


def autocast_dtype(t: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype torch.autocast gives a linear layer on t's device, or None outside its regions and for
    an fp64 t (autocast casts no fp64 tensor): the experts' GEMMs then take their input and weights in
    it, as nn.Linear's would."""
    device = t.device.type
    if t.dtype == torch.float64:  # autocast leaves fp64 as it is: nn.Linear on fp64 stays fp64
        return None
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


class GroupedExperts(nn.Module):
    """x [R, M] (rows of expert e contiguous, counts [E] int32 on the device) -> y [R, M].

    swiglu: y = (silu(x W1g) * x W1u) W2 with w1 [E, M, 2F] = [gate | up], w2 [E, F, M]
    gelu:   y = gelu(x w1) w2          with w1 [E, M, F],                 w2 [E, F, M]
    Optional biases b1 [E, 2F or F], b2 [E, M]. Saved for backward: x, the first GEMM's output
    and the activation, all O(R * (M + F)); given a `Remake` (turbomoe.nn.recompute), the activation
    is remade from the first GEMM's output in backward instead of kept, and x, where the Remake
    remakes it, is freed after the first GEMM unless a forward hook could see it (the caller must
    not read x after the call). A row scale s [R] (swiglu, no b2) weighs each row inside the
    activation, y_r = (s_r a_r) W2 = s_r (a_r W2), and takes its gradient there (from the activation's
    output gradient and h), with no use of y.
    fused_grad_accumulation: w1's and w2's gradients of a backward after the first (their .grad
    kept, micro-batches accumulating) are added into .grad inside the weight-gradient GEMMs
    (grouped_mm's grad_into_w: not where a hook on the weight itself or create_graph needs autograd's
    gradient; post-accumulate hooks run and read the sum).
    """

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, activation: str = "swiglu",
                 bias: bool = False, gmm_backend: Optional[str] = None, device=None, dtype=None,
                 fused_grad_accumulation: bool = False):
        super().__init__()
        ops.check_bool("fused_grad_accumulation", fused_grad_accumulation)
        ops.check_bool("bias", bias)
        ops.check_dtype("dtype", dtype)
        self.fused_grad_accumulation = fused_grad_accumulation
        for name, value in (("num_experts", num_experts), ("hidden_size", hidden_size),
                            ("ffn_hidden_size", ffn_hidden_size)):
            ops.check_int(name, value, 1)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        check_gmm_backend(gmm_backend)
        self.num_experts, self.hidden_size, self.ffn_hidden_size = num_experts, hidden_size, ffn_hidden_size
        self.activation, self.gmm_backend = activation, gmm_backend
        n1 = 2 * ffn_hidden_size if activation == "swiglu" else ffn_hidden_size
        kw = dict(device=device, dtype=dtype)
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_size, n1, **kw))
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size, **kw))
        self.b1 = nn.Parameter(torch.empty(num_experts, n1, **kw)) if bias else None
        self.b2 = nn.Parameter(torch.empty(num_experts, hidden_size, **kw)) if bias else None
        self.reset_parameters()

    def reset_parameters(self):
        """The weights drawn as at construction (nn.Linear's scale: uniform in +-1/sqrt(fan_in)), the biases
        zero (after `to_empty` from the meta device)."""
        nn.init.uniform_(self.w1, -self.hidden_size ** -0.5, self.hidden_size ** -0.5)
        nn.init.uniform_(self.w2, -self.ffn_hidden_size ** -0.5, self.ffn_hidden_size ** -0.5)
        for b in (self.b1, self.b2):
            if b is not None:
                nn.init.zeros_(b)

    def forward(self, x_RM: torch.Tensor, counts_E: torch.Tensor, remake: Optional[Remake] = None,
                row_scale_R: Optional[torch.Tensor] = None) -> torch.Tensor:
        if x_RM.dim() != 2 or x_RM.shape[1] != self.hidden_size:
            raise ValueError(f"x must be [R, {self.hidden_size}], got {tuple(x_RM.shape)}")
        w1, w2, b1, b2 = self.w1, self.w2, self.b1, self.b2
        dtype = autocast_dtype(x_RM)
        if dtype is not None:  # the casts autocast would make (differentiable: the gradients reach the weights)
            x_RM = x_RM.to(dtype)
            w1, w2, b1, b2 = (None if t is None else t.to(dtype) for t in (w1, w2, b1, b2))
        if x_RM.dtype != w1.dtype:
            raise TypeError(f"x is {x_RM.dtype} but the expert weights are {w1.dtype}")
        if row_scale_R is not None and not self.scales_rows:
            raise ValueError("a row scale needs swiglu experts without a second bias (the scale must commute "
                             "with the second GEMM)")
        offs_E = row_offsets(counts_E)  # once for all four GEMM launches
        groups_R = row_groups(offs_E, x_RM.shape[0]) if b1 is not None else None
        fused = self.fused_grad_accumulation
        h = grouped_mm(x_RM, w1, counts_E, self.gmm_backend, offs_E, grad_into_w=fused)
        if remake is not None and not self._hooked():  # rows remade in backward need not outlive this GEMM
            remake.release(x_RM)
        bias1 = None
        if groups_R is not None:
            if self.activation == "gelu":  # added in GELU's own pass
                bias1 = (b1, groups_R)
            else:
                h = bias_act(h, b1, groups_R, kernels=self._kernels)
        a = self._act(h, row_scale_R, bias1)
        if remake is not None:
            # h is kept by the activation's own backward; b1 (GELU's bias) is read again
            remake.add(a, lambda: self._act(h, row_scale_R, bias1), (h, ) if bias1 is None else (h, bias1[0]))
        y = grouped_mm(a, w2, counts_E, self.gmm_backend, offs_E, grad_into_w=fused)
        if groups_R is not None:
            y = bias_act(y, b2, groups_R, kernels=self._kernels)
        return y

    def _hooked(self) -> bool:
        """Whether a forward hook (this module's or a global one) sees x and may keep it: x's memory is
        then not freed under it (a read of a freed storage is not checked: it may crash)."""
        return bool(self._forward_pre_hooks or self._forward_hooks or nn_module._global_forward_pre_hooks
                    or nn_module._global_forward_hooks)

    @property
    def _kernels(self) -> bool:
        """The activation's and biases' kernels, unless the GEMMs are forced to the reference's
        (gmm_backend or TURBOMOE_GMM_BACKEND: then the whole experts block is plain PyTorch,
        differentiable twice)."""
        return forced_gmm_backend(self.gmm_backend) != "reference"

    @property
    def scales_rows(self) -> bool:
        """Whether forward takes a row scale."""
        return self.activation == "swiglu" and self.b2 is None

    def _act(self, h: torch.Tensor, row_scale_R: Optional[torch.Tensor] = None, bias1=None) -> torch.Tensor:
        """bias1: (b1, groups_R), GELU's bias, added in the same pass."""
        if bias1 is not None:
            return bias_act(h, *bias1, act="gelu", kernels=self._kernels)
        return swiglu(h, row_scale_R, self._kernels) if self.activation == "swiglu" else F.gelu(h)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"ffn_hidden_size={self.ffn_hidden_size}, activation={self.activation}, bias={self.b1 is not None}")
