"""Local experts of the DeepSpeed drop-in: any user module, with a grouped-GEMM fast path.

Stock `deepspeed.moe.experts.Experts` runs its local experts one after another. When every local
expert is a plain MLP of one shape -- `nn.Sequential(Linear, activation, Linear)` or
`SwiGLUExpert` -- and nothing hooks into them, `grouped_mlp` runs all of them at once: the capacity
buffer [E_local, C, M] goes through batched matmuls (a grouped GEMM for equal-size groups) on the
per-expert weights seen as one [E_local, N, K] tensor. The parameters stay in their per-expert
modules, so the state dict (deepspeed_moe.experts.deepspeed_experts.{i}...) and DeepSpeed's
per-expert checkpoint files do not change; they are packed into one buffer (as ZeRO packs them),
so that the stacked weight is a view, not a copy made every step. The dropless layer on one rank
hands expert-contiguous rows [R, M] instead: grouped GEMMs over counts on the device (RowGroups).
"""
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..autograd.grouped_gemm import add_group_bias, grouped_mm, row_groups, row_offsets
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


# module -> its descendants, listed on first use: walking the tree (modules()) every forward cost
# ~0.2 ms of host time at 64 experts. The fast path's structure check (fast_path_kind) is made
# once too; experts swapped in later are not seen by either.
_DESCENDANTS: "weakref.WeakKeyDictionary[nn.Module, Tuple[nn.Module, ...]]" = weakref.WeakKeyDictionary()


def _hooked(module: nn.Module) -> bool:
    descendants = _DESCENDANTS.get(module)
    if descendants is None:  # without module itself: the value must not hold its weak key alive
        descendants = _DESCENDANTS[module] = tuple(module.modules())[1:]
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in (module, ) + descendants)


class _AliasStack(torch.autograd.Function):
    """Per-expert blocks of tensors that lie at a fixed stride in one storage, seen as one
    [E, rows, *rest] tensor without a copy; the backward splits the gradient back per tensor."""

    @staticmethod
    def forward(ctx, shape, stride, block_rows, *tensors):
        ctx.block_rows = block_rows
        first = tensors[0]
        return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), shape, stride)

    @staticmethod
    def backward(ctx, grad):
        rows = ctx.block_rows
        if len(set(rows)) == 1:  # blocks of equal rows ([w1; w3], or one tensor): one unbind, not E splits
            pieces = grad.reshape(-1, rows[0], *grad.shape[2:]).unbind(0)
        else:
            pieces = [p for block in grad.unbind(0) for p in block.split(rows, 0)]
        return (None, None, None, *pieces)


def _alias_stride(blocks: List[List[torch.Tensor]]) -> Optional[int]:
    """Element stride between expert blocks when the blocks can be aliased as one tensor, else None.

    Needs: one storage, dtype and trailing shape; each tensor contiguous; the tensors of a block
    back to back; blocks at a constant stride. Parameters packed by `pack_expert_params` and
    DeepSpeed ZeRO-1/2's flat buffers (parameters in module order) are laid out this way.
    """
    first = blocks[0][0]
    storage, rest = first.untyped_storage().data_ptr(), first.shape[1:]
    starts = []
    for block in blocks:
        offset = block[0].storage_offset()
        starts.append(offset)
        for t in block:
            if (t.dtype != first.dtype or t.shape[1:] != rest or not t.is_contiguous()
                    or t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset):
                return None
            offset += t.numel()
    block_numel = offset - starts[-1]
    stride = starts[1] - starts[0] if len(starts) > 1 else block_numel
    if stride < block_numel or any(b - a != stride for a, b in zip(starts, starts[1:])):
        return None
    return stride


# (address, shape, dtype, contiguity) of every tensor -> _alias_stride's answer: the check reads
# each tensor's storage, ~0.1 ms of host time per call at 64 experts; the key costs half of that.
# The same key gives the same answer: live storages do not overlap.
_ALIAS_STRIDES: Dict[tuple, Optional[int]] = {}


def _alias_stride_cached(blocks: List[List[torch.Tensor]]) -> Optional[int]:
    key = (len(blocks[0]), ) + tuple((t.data_ptr(), t.shape, t.dtype, t.is_contiguous()) for b in blocks for t in b)
    if key not in _ALIAS_STRIDES:
        if len(_ALIAS_STRIDES) >= 256:  # parameters moved many times: forget the old layouts
            _ALIAS_STRIDES.clear()
        _ALIAS_STRIDES[key] = _alias_stride(blocks)
    return _ALIAS_STRIDES[key]


def stack_expert_tensors(blocks: List[List[torch.Tensor]]) -> torch.Tensor:
    """[E, rows, *rest]: expert e's tensors concatenated along dim 0, stacked over experts.

    Aliases the parameters' storage when it can (no copy) eagerly; otherwise, and under torch.compile,
    copies them (torch.stack).
    """
    block_rows = [t.shape[0] for t in blocks[0]]
    first = blocks[0][0]
    shape = (len(blocks), sum(block_rows)) + tuple(first.shape[1:])
    # While compiling, a copy: the alias check reads storage addresses, which the compiler cannot trace.
    stride = None if torch.compiler.is_compiling() else _alias_stride_cached(blocks)
    if stride is None:  # the tensors of a block have equal rows ([w1; w3]), so stacking them all works
        return torch.stack([t for block in blocks for t in block]).view(shape)
    inner = torch.empty(shape[1:], device="meta").stride()
    return _AliasStack.apply(shape, (stride, ) + inner, block_rows, *[t for block in blocks for t in block])


def pack_expert_params(experts: nn.ModuleList) -> None:
    """Move the local experts' parameters into one flat buffer, in module order (as ZeRO does), so
    that `stack_expert_tensors` can alias them. Names, values and the state dict do not change."""
    params = [p for e in experts for p in e.parameters()]
    if not params or len({(p.dtype, p.device) for p in params}) != 1:
        return
    flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    offset = 0
    with torch.no_grad():
        for p in params:
            view = flat[offset:offset + p.numel()].view_as(p)
            view.copy_(p)
            p.data = view
            offset += p.numel()


class _BatchedLinear(torch.autograd.Function):
    """y [E, C, N] = x [E, C, K] @ w [E, N, K]^T, one batched GEMM each way.

    Its backward computes dw in w's own [E, N, K] layout: autograd's bmm would return it transposed,
    and every expert parameter's gradient would then be copied to make it contiguous.
    """

    @staticmethod
    def forward(ctx, x_ECK, w_ENK):
        ctx.save_for_backward(x_ECK, w_ENK)
        return torch.bmm(x_ECK, w_ENK.transpose(1, 2))

    @staticmethod
    def backward(ctx, dy_ECN):
        x_ECK, w_ENK = ctx.saved_tensors
        dx = torch.bmm(dy_ECN, w_ENK) if ctx.needs_input_grad[0] else None
        dw = torch.bmm(dy_ECN.transpose(1, 2), x_ECK) if ctx.needs_input_grad[1] else None
        return dx, dw


class EqualGroups:
    """Expert e owns x[e] of x [E, C, K] (the capacity buffer): batched GEMMs."""

    def matmul(self, x_ECK: torch.Tensor, w_ENK: torch.Tensor) -> torch.Tensor:
        return _BatchedLinear.apply(x_ECK, w_ENK)

    def add_bias(self, y_ECN: torch.Tensor, b_EN: torch.Tensor) -> torch.Tensor:
        # A separate add: baddbmm with a broadcast bias takes a slow path on the CPU.
        return y_ECN + b_EN.unsqueeze(1)


class RowGroups:
    """Expert e owns counts[e] consecutive rows of x [R, K] (the dropless layout): grouped GEMMs
    with the counts on the device, so no host sync."""

    def __init__(self, counts_E: torch.Tensor, num_rows: int):
        self.counts_E = counts_E
        self.num_rows = num_rows

    def matmul(self, x_RK: torch.Tensor, w_ENK: torch.Tensor) -> torch.Tensor:
        return grouped_mm(x_RK, w_ENK.transpose(1, 2), self.counts_E)

    def add_bias(self, y_RN: torch.Tensor, b_EN: torch.Tensor) -> torch.Tensor:
        # Rows past sum(counts) (unrouted tokens) get no bias gradient from add_group_bias.
        return add_group_bias(y_RN, b_EN, row_groups(row_offsets(self.counts_E), self.num_rows))


def _grouped_linear(x: torch.Tensor, linears: List[nn.Linear], groups) -> torch.Tensor:
    """Expert e's Linear on expert e's rows of x [.., K] -> [.., N], one grouped GEMM."""
    y = groups.matmul(x, stack_expert_tensors([[lin.weight] for lin in linears]))
    if linears[0].bias is None:
        return y
    return groups.add_bias(y, stack_expert_tensors([[lin.bias] for lin in linears]))


def grouped_mlp(kind: str, experts: nn.ModuleList, x: torch.Tensor, groups) -> torch.Tensor:
    """Expert e's MLP on expert e's rows of x, all local experts at once: [.., M] -> [.., M].

    groups: EqualGroups for x [E_local, C, M], RowGroups for expert-contiguous x [R, M].
    """
    if kind == "swiglu":
        # [gate | up] per expert: one GEMM for both, then turbomoe's fused SwiGLU.
        h = groups.matmul(x, stack_expert_tensors([[e.w1.weight, e.w3.weight] for e in experts]))
        a = swiglu(h.reshape(-1, h.shape[-1])).view(*h.shape[:-1], h.shape[-1] // 2)  # not -1: rows may be 0
        return _grouped_linear(a, [e.w2 for e in experts], groups)
    act: Callable = experts[0][1]
    return _grouped_linear(act(_grouped_linear(x, [e[0] for e in experts], groups)), [e[2] for e in experts], groups)


def fast_path_applies(experts_module: nn.Module, kind: Optional[str], dtype: torch.dtype) -> bool:
    """The grouped path runs when the experts are a known MLP, nothing hooks into them (it would
    bypass the hooks) and the input has the weights' dtype (no autocast)."""
    if kind is None:
        return False
    weight = next(experts_module.deepspeed_experts[0].parameters(), None)
    return weight is not None and weight.dtype == dtype and not _hooked(experts_module)


def run_experts(experts_module: nn.Module, kind: Optional[str], x_GECM: torch.Tensor) -> torch.Tensor:
    """x [ep, E_local, C, M] (rows from each ep rank, for each local expert) -> same shape.

    The grouped path where it applies, else the stock module (experts one by one).
    """
    if not fast_path_applies(experts_module, kind, x_GECM.dtype):
        return experts_module(x_GECM)
    G, E, C, M = x_GECM.shape
    x_ECM = x_GECM.transpose(0, 1).reshape(E, G * C, M)
    y_ECM = grouped_mlp(kind, experts_module.deepspeed_experts, x_ECM, EqualGroups())
    return y_ECM.reshape(E, G, C, y_ECM.shape[-1]).transpose(0, 1)  # not -1: C may be 0
