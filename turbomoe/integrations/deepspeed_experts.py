"""Local experts of the DeepSpeed drop-in: any user module, with a grouped-GEMM fast path.

Stock `deepspeed.moe.experts.Experts` runs its local experts one after another. When every local
expert is a plain MLP of one shape -- `nn.Sequential(Linear, activation, Linear)`, `SwiGLUExpert`
or Megatron's `ParallelMLP` (megatron_mlp.py) -- and nothing hooks into them, `grouped_mlp` runs
all of them at once: the capacity buffer [.., E_local, C, M] goes through batched matmuls (a grouped
GEMM for equal-size groups) on the per-expert weights seen as one [E_local, N, K] tensor. The
parameters stay in their per-expert modules, so the state dict
(deepspeed_moe.experts.deepspeed_experts.{i}...) and DeepSpeed's per-expert checkpoint files do not
change; they are packed into one buffer (as ZeRO packs them), so that the stacked weight is a view,
not a copy made every step. The dropless layer on one rank hands expert-contiguous rows [R, M]
instead: grouped GEMMs over counts on the device (RowGroups).
"""
import weakref
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..autograd.swiglu import swiglu
from ..nn.experts import autocast_dtype
from ..nn.recompute import Remake
from .expert_stack import EqualGroups, RowGroups, pack_expert_params, stack_expert_tensors  # noqa: F401 (re-exported)
from .megatron_mlp import grouped_parallel_mlp, parallel_mlp_signature, same_known_activation

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
        # an in-place activation would overwrite the stacked GEMM's output, a view its backward keeps
        if (type(act) in _ELEMENTWISE and not getattr(act, "inplace", False) and type(fc1) is nn.Linear
                and type(fc2) is nn.Linear):
            return ("mlp", repr(act), _linear_signature(fc1), _linear_signature(fc2))
    return parallel_mlp_signature(expert)


def fast_path_kind(experts: List[nn.Module]) -> Optional[str]:
    """'swiglu', 'mlp' or 'megatron' when all experts are the same known MLP, else None (run them
    one by one)."""
    signatures = {_expert_signature(e) for e in experts}
    if len(signatures) != 1:
        return None
    sig = signatures.pop()
    return None if sig is None else sig[0]


# Counts the modules assigned as a submodule anywhere (torch's global registration hook), so that the
# walk and the structure check below, made once, are made again after an expert was swapped or wrapped
# (PEFT puts a LoRA module in its Linear's place): they would miss its hooks, or run its old weights.
_assignments = 0


def _count_assignment(parent: nn.Module, name: str, module: Optional[nn.Module]) -> None:
    # Not while dynamo traces: a model that makes a module in its forward (transformers' decoder
    # slices its ModuleList every call) would change the global each call, a guard that failed every
    # time and recompiled to the limit. Compiled code walks the tree at trace time (_hooked).
    if torch.compiler.is_compiling():
        return
    global _assignments
    _assignments += 1


nn.modules.module.register_module_module_registration_hook(_count_assignment)


def module_assignments() -> int:
    """How many modules have been assigned as a submodule so far: a structure checked at one count
    still holds while the count stays."""
    return _assignments


# module -> (module_assignments(), its descendants) when listed: walking the tree (modules()) every
# forward cost ~0.2 ms of host time at 64 experts.
_DESCENDANTS: "weakref.WeakKeyDictionary[nn.Module, Tuple[int, Tuple[nn.Module, ...]]]" = weakref.WeakKeyDictionary()


def _hooked(module: nn.Module) -> bool:
    if torch.compiler.is_compiling():
        # The tree walked at trace time; never the cache: dynamo guarded on the weak dictionary's keys by
        # position, and a module of another model collected meanwhile broke the guard (IndexError).
        descendants = tuple(module.modules())[1:]
    else:
        listed = _DESCENDANTS.get(module)
        if listed is None or listed[0] != _assignments:  # (without module itself: it must not hold its weak key alive)
            listed = _DESCENDANTS[module] = (_assignments, tuple(module.modules())[1:])
        descendants = listed[1]
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
               for m in (module, ) + descendants)


def _stack(blocks: List[List[torch.Tensor]], dtype: Optional[torch.dtype]) -> torch.Tensor:
    """stack_expert_tensors, cast to dtype (torch.autocast's) where one is given."""
    w = stack_expert_tensors(blocks)
    return w if dtype is None else w.to(dtype)


def _grouped_linear(x: torch.Tensor, linears: List[nn.Linear], groups, dtype: Optional[torch.dtype],
                    add_bias: bool = True) -> torch.Tensor:
    """Expert e's Linear on expert e's rows of x [.., K] -> [.., N], one grouped GEMM (without the bias
    where add_bias is False: the caller adds it in its own pass)."""
    blocks = [[lin.weight] for lin in linears]
    y = groups.matmul(x, _stack(blocks, dtype), blocks)
    if not add_bias or linears[0].bias is None:
        return y
    return groups.add_bias(y, _stack([[lin.bias] for lin in linears], dtype))


def grouped_mlp(kind: str, experts: nn.ModuleList, x: torch.Tensor, groups,
                remake: Optional[Remake] = None, row_scale_R: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Expert e's MLP on expert e's rows of x, all local experts at once: [.., M] -> [.., M].

    groups: EqualGroups for x [.., E_local, C, M], RowGroups for expert-contiguous x [R, M]. remake: the
    activation is remade from the first GEMM's output in backward instead of kept (swiglu and mlp kinds),
    and x, where remake remakes it, is freed after the first GEMM (not to be read after the call).
    row_scale_R: each row of x [R, M] weighed inside the activation (see scales_rows).
    """
    if row_scale_R is not None and not scales_rows(kind, experts):
        raise ValueError("a row scale needs bias-free SwiGLU experts")
    if kind == "megatron":
        return grouped_parallel_mlp(list(experts), x, groups)
    dtype = autocast_dtype(x)  # under torch.autocast, the casts its nn.Linear experts would make
    if dtype is not None:
        x = x.to(dtype)
    if kind == "swiglu":
        # [gate | up] per expert: one GEMM for both, then turbomoe's fused SwiGLU.
        blocks = [[e.w1.weight, e.w3.weight] for e in experts]
        h = groups.matmul(x, _stack(blocks, dtype), blocks)

        def act(h):  # not view(.., -1): rows may be 0
            return swiglu(h.reshape(-1, h.shape[-1]), row_scale_R).view(*h.shape[:-1], h.shape[-1] // 2)
        second = [e.w2 for e in experts]
    else:
        fc1s, fused = [e[0] for e in experts], _bias_act_of(experts[0])
        h = _grouped_linear(x, fc1s, groups, dtype, add_bias=fused is None)
        if fused is None:
            # Its forward, not its call: fast_path_applies found no hooks of its own, global module hooks
            # skip the grouped Linears already, and a remade activation would run them again in backward.
            act: Callable = experts[0][1].forward
        else:  # the bias and GELU in one pass each way (fp32, rounded once), as the Megatron path's
            b1 = _stack([[lin.bias] for lin in fc1s], dtype)

            def act(h):
                return groups.add_bias(h, b1, fused)
        second = [e[2] for e in experts]
    if remake is not None:  # the rows, remade in backward, need not outlive the first GEMM
        remake.release(x)
    a = act(h)
    if remake is not None:
        remake.add(a, lambda: act(h), (h, ))  # h is kept by the activation's own backward
    return _grouped_linear(a, second, groups, dtype)


def _bias_act_of(expert: nn.Sequential) -> Optional[str]:
    """bias_act's act for a (Linear with bias, nn.GELU, Linear) expert, else None."""
    fc1, act = expert[0], expert[1]
    if fc1.bias is None or type(act) is not nn.GELU:
        return None
    return "gelu_tanh" if act.approximate == "tanh" else "gelu"


def scales_rows(kind: Optional[str], experts: nn.ModuleList) -> bool:
    """Whether grouped_mlp can weigh the rows by the routing scores inside the activation (SwiGLU,
    no bias after it: y_r = (s_r a_r) W2 = s_r (a_r W2)), so that the combine sums with weight 1
    and the experts' output is not kept for the scores' gradient."""
    return kind == "swiglu" and experts[0].w2.bias is None


def fast_path_applies(experts_module: nn.Module, kind: Optional[str], x: torch.Tensor) -> bool:
    """The grouped path runs when the experts are a known MLP (Megatron's: still one known activation),
    nothing hooks into them (it would bypass the hooks) and the input x has the weights' dtype, or
    torch.autocast is on (grouped_mlp then casts as autocast would; not Megatron's ParallelMLP experts,
    which run as they are)."""
    if kind is None:
        return False
    weight = next(experts_module.deepspeed_experts[0].parameters(), None)
    if weight is None or _hooked(experts_module):
        return False
    if kind == "megatron" and not same_known_activation(experts_module.deepspeed_experts):
        return False
    if autocast_dtype(x) is not None:
        return kind != "megatron"
    return weight.dtype == x.dtype


def run_experts(experts_module: nn.Module, kind: Optional[str], x_GECM: torch.Tensor,
                fused_grad_accumulation: bool = False) -> torch.Tensor:
    """x [ep, E_local, C, M] (rows from each ep rank, for each local expert) -> same shape.

    The grouped path where it applies (on the rows where the all-to-all left them), else the stock
    module (experts one by one).
    """
    if not fast_path_applies(experts_module, kind, x_GECM):
        return experts_module(x_GECM)
    return grouped_mlp(kind, experts_module.deepspeed_experts, x_GECM, EqualGroups(fused_grad_accumulation))
