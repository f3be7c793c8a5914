"""Local experts of the DeepSpeed drop-in: any user module, with a grouped-GEMM fast path.

Stock `deepspeed.moe.experts.Experts` runs its local experts one after another. When every local
expert is a plain MLP of one shape -- `nn.Sequential(Linear, activation, Linear)` or
`SwiGLUExpert` -- and nothing hooks into them, `grouped_mlp` runs all of them at once: the capacity
buffer [E_local, C, M] goes through batched matmuls (a grouped GEMM for equal-size groups) on the
per-expert weights stacked at call time. The parameters stay in their per-expert modules, so the
state dict (deepspeed_moe.experts.deepspeed_experts.{i}...) and DeepSpeed's per-expert
checkpoint files do not change.
"""
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..autograd.swiglu import swiglu

# Element-wise activations the fast path may apply on the stacked hidden states.
_ELEMENTWISE = (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Identity)


class SwiGLUExpert(nn.Module):
    """y = w2(silu(w1 x) * w3 x), bias-free (the Llama / Mixtral expert). x [.., M] -> [.., M]."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int):
        super().__init__()
        self.w1 = nn.Linear(hidden_size, ffn_hidden_size, bias=False)  # gate
        self.w3 = nn.Linear(hidden_size, ffn_hidden_size, bias=False)  # up
        self.w2 = nn.Linear(ffn_hidden_size, hidden_size, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _linear_signature(lin: nn.Module):
    return (type(lin) is nn.Linear, tuple(lin.weight.shape), lin.bias is not None)


def _expert_signature(expert: nn.Module):
    """A hashable description of an expert the fast path understands, else None."""
    if type(expert) is SwiGLUExpert:
        return ("swiglu", ) + tuple(_linear_signature(m) for m in (expert.w1, expert.w3, expert.w2))
    if type(expert) is nn.Sequential and len(expert) == 3:
        fc1, act, fc2 = expert
        if type(act) in _ELEMENTWISE and type(fc1) is nn.Linear and type(fc2) is nn.Linear:
            return ("mlp", repr(act), _linear_signature(fc1), _linear_signature(fc2))
    return None


def fast_path_kind(experts: List[nn.Module]) -> Optional[str]:
    """'swiglu' or 'mlp' when all experts are the same known MLP, else None (run them one by one)."""
    signatures = {_expert_signature(e) for e in experts}
    if len(signatures) != 1:
        return None
    sig = signatures.pop()
    return None if sig is None else sig[0]


def _hooked(module: nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in module.modules())


def _grouped_linear(x_ECK: torch.Tensor, linears: List[nn.Linear]) -> torch.Tensor:
    """[E, C, K] @ stacked W[E, N, K]^T (+ bias [E, N]) -> [E, C, N], one batched GEMM."""
    y_ECN = torch.bmm(x_ECK, torch.stack([lin.weight for lin in linears]).transpose(1, 2))
    if linears[0].bias is None:
        return y_ECN
    # A separate add: baddbmm with a broadcast bias takes a slow path on the CPU.
    return y_ECN + torch.stack([lin.bias for lin in linears]).unsqueeze(1)


def grouped_mlp(kind: str, experts: nn.ModuleList, x_ECM: torch.Tensor) -> torch.Tensor:
    """Run expert e on x[e] for all local experts at once: x [E_local, C, M] -> [E_local, C, M]."""
    if kind == "swiglu":
        E, C, _ = x_ECM.shape
        # [w1_0; w3_0; w1_1; ...] stacks to [E, 2F, M] = [gate | up] per expert in one copy.
        w_E2FM = torch.stack([w for e in experts for w in (e.w1.weight, e.w3.weight)]).view(E, -1, x_ECM.shape[2])
        h_R2F = torch.bmm(x_ECM, w_E2FM.transpose(1, 2)).view(E * C, -1)
        return _grouped_linear(swiglu(h_R2F).view(E, C, -1), [e.w2 for e in experts])
    act: Callable = experts[0][1]
    hidden = act(_grouped_linear(x_ECM, [e[0] for e in experts]))
    return _grouped_linear(hidden, [e[2] for e in experts])


def run_experts(experts_module: nn.Module, kind: Optional[str], x_GECM: torch.Tensor) -> torch.Tensor:
    """x [ep, E_local, C, M] (rows from each ep rank, for each local expert) -> same shape.

    Falls back to the stock module (experts one by one) when the experts are not a known MLP,
    when hooks are registered on them, or when the input dtype is not the weights' dtype.
    """
    local = experts_module.deepspeed_experts
    weight = next(local[0].parameters(), None)
    if kind is None or _hooked(experts_module) or weight is None or weight.dtype != x_GECM.dtype:
        return experts_module(x_GECM)
    G, E, C, M = x_GECM.shape
    x_ECM = x_GECM.transpose(0, 1).reshape(E, G * C, M)
    y_ECM = grouped_mlp(kind, local, x_ECM)
    return y_ECM.reshape(E, G, C, -1).transpose(0, 1)
