"""Megatron's `ParallelMLP` experts (Megatron-DeepSpeed) on grouped GEMMs, all local experts at once.

Megatron-DeepSpeed (megatron/model/transformer.py) hands `deepspeed.moe.layer.MoE` the expert
`ParallelMLP(config, moe=True, enable_expert_tensor_parallelism=...)`, whose forward is

    h, b1 = dense_h_to_4h(x)      ColumnParallelLinear, skip_bias_add: W1 [N/tp, M], b1 [N/tp]
    h = bias_gelu(h, b1)          if bias_gelu_fusion (tanh GELU of h + b1), else activation_func(h + b1)
    y, b2 = dense_4h_to_h(h)      RowParallelLinear: W2 [M, F/tp]; sum over the tp ranks; + b2 [M]
    return y, b2                  (b2 is None unless skip_bias_add; stock's Experts keeps y only)

N = F, or 2F for SwiGLU. tp, the slicing of the linears, is 1 unless the experts are tensor-parallel
(enable_expert_tensor_parallelism): then the column linear's input gradient and the row linear's
output are summed over the tensor-parallel group. `grouped_parallel_mlp` computes the same for all
local experts with one grouped GEMM per linear, the bias adds on the stacked tensors and one
all-reduce for all experts (stock: one per expert). The parameters stay where they are.

The experts are recognised by structure, not by importing Megatron (`parallel_mlp_signature`):
the classes' names and forwards and the attributes that decide what their forward does. The
linears of megatron-core (`megatron.core.tensor_parallel`, the package Megatron-DeepSpeed's copy
descends from) share that contract and are recognised too. Anything else (sequence parallelism,
gradient-accumulation fusion into main_grad, gathered outputs, an unknown activation, FPDT
chunking, megatron-core's explicit expert communication) is not understood: the experts then run
one by one, as stock runs them.
"""
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..autograd import Function
from .expert_stack import stack_expert_tensors

# Megatron-DeepSpeed's activations (megatron/model/utils.py, ParallelMLP.__init__): all act on the
# last dim of each row, so they apply to the stacked [E, C, N] hidden states as to each expert's.
# (Its --onnx-safe erf_gelu is a torch.jit.script function, which DeepSpeed's deep copy of the expert
# for every local expert cannot copy: MoE experts never hold it.)
_ACTIVATIONS = ("openai_gelu", "ParallelMLP.__init__.<locals>.swiglu", "ParallelMLP.__init__.<locals>.squared_relu")
# Those whose bias add and activation run as one pass each way (bias_act): the fused bias-GELU and
# openai_gelu are both GELU's tanh form, F.gelu its erf form.
_BIAS_ACT = {"bias_gelu": "gelu_tanh", "openai_gelu": "gelu_tanh", "gelu": "gelu"}


def _is(module: nn.Module, name: str) -> bool:
    """module's class is called name and runs that class's own forward (not a subclass's, nor one
    set on the instance: a wrapper's, whose math is its own)."""
    return (type(module).__name__ == name and type(module).forward.__qualname__ == f"{name}.forward"
            and "forward" not in vars(module))


def _plain(lin: nn.Module) -> bool:
    """No sequence parallelism, no fused gradient accumulation, no expert communication left to
    the caller (megatron-core), no deferred weight gradients: the linear is x @ W^T (+ b) and its
    tensor-parallel sum. A missing attribute counts against it."""
    cfg = getattr(lin, "config", None)
    return (isinstance(getattr(lin, "weight", None), torch.Tensor) and lin.weight.dim() == 2
            and getattr(lin, "sequence_parallel", True) is False
            and getattr(lin, "gradient_accumulation_fusion", True) is False
            and not getattr(lin, "explicit_expert_comm", False) and not getattr(lin, "disable_grad_reduce", False)
            and not getattr(cfg, "defer_embedding_wgrad_compute", False)
            and getattr(cfg, "_cpu_offloading_context", None) is None
            and isinstance(getattr(lin, "input_size", None), int) and isinstance(getattr(lin, "output_size", None), int)
            and isinstance(getattr(lin, "skip_bias_add", None), bool))


def _parallel_signature(lin: nn.Module, cls: str, flag: str, value: bool, sliced: int):
    """(weight rows, weight columns, has bias, skip_bias_add, tp) of a plain Megatron parallel linear
    of class cls with `flag` set to `value` (the setting that keeps its forward local), its weight
    [out, in] sliced over tp ranks along dim `sliced` (0: a column-parallel linear's outputs, 1: a
    row-parallel linear's inputs), the other dim whole; None for anything else."""
    if not (_is(lin, cls) and _plain(lin) and getattr(lin, flag, not value) is value):
        return None
    full = (lin.output_size, lin.input_size)
    shape = tuple(lin.weight.shape)
    if shape[1 - sliced] != full[1 - sliced] or full[sliced] % shape[sliced]:
        return None
    return (*shape, getattr(lin, "bias", None) is not None, lin.skip_bias_add, full[sliced] // shape[sliced])


def _activation_key(act) -> Optional[str]:
    if act is F.gelu:
        return "gelu"
    name = getattr(act, "__qualname__", None)
    return name if name in _ACTIVATIONS else None


def same_known_activation(experts: List[nn.Module]) -> bool:
    """The experts still share one activation the grouped path knows (or the fused bias-GELU).
    activation_func is a plain attribute: setting it after the layer checked the experts' structure
    (which module assignments alone make it check again) changes nothing the check saw. A few us a
    forward at 64 experts, against ~24 us an expert for the whole check."""
    act = getattr(experts[0], "activation_func", None)
    return ((bool(getattr(experts[0], "bias_gelu_fusion", False)) or _activation_key(act) is not None)
            and all(getattr(e, "activation_func", None) is act for e in experts))


def parallel_mlp_signature(expert: nn.Module):
    """A hashable description of a ParallelMLP expert the grouped path understands, else None."""
    if not _is(expert, "ParallelMLP") or getattr(expert, "ds_sequence_parallel_fpdt", False):
        return None
    fc1, fc2 = getattr(expert, "dense_h_to_4h", None), getattr(expert, "dense_4h_to_h", None)
    col = _parallel_signature(fc1, "ColumnParallelLinear", "gather_output", False, 0) if fc1 is not None else None
    row = _parallel_signature(fc2, "RowParallelLinear", "input_is_parallel", True, 1) if fc2 is not None else None
    fused = bool(getattr(expert, "bias_gelu_fusion", False))
    act = None if fused else _activation_key(getattr(expert, "activation_func", None))
    if col is None or row is None or (act is None and not fused) or col[4] != row[4]:
        return None
    if fused and not (col[2] and col[3]):  # the fused op takes the column linear's returned bias
        return None
    return ("megatron", "bias_gelu" if fused else act, col, row)


def _tp_group(lin: nn.Module, tp: int):
    """The group the linear sums over: its own (megatron-core keeps tp_group), else the model's
    tensor-parallel group as Megatron-DeepSpeed's parallel_state holds it, which DeepSpeed's
    groups.mpu is (deepspeed.initialize(mpu=...))."""
    group = getattr(lin, "tp_group", None)
    if group is None:
        from deepspeed.utils import groups
        from deepspeed.utils.bwc import bwc_tensor_model_parallel_group
        group = bwc_tensor_model_parallel_group(groups.mpu) if groups.mpu is not None else None
    if group is None or dist.get_world_size(group) != tp:
        raise RuntimeError(f"turbomoe: ParallelMLP expert linears split {tp} ways, but their tensor-parallel "
                           f"group is {'unknown' if group is None else dist.get_world_size(group)}")
    return group


class _CopyToGroup(Function):
    """Forward: identity. Backward: the gradient summed over the group (each rank's slice of the
    column linear contributes to the input's gradient), as a _ReduceFromGroup: a Function, so that
    torch.func runs its collective on plain tensors and create_graph records it."""

    @staticmethod
    def forward(x, group):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return _ReduceFromGroup.apply(grad, ctx.group), None


class _ReduceFromGroup(Function):
    """Forward: the row linear's partial sums added over the group. Backward: identity."""

    @staticmethod
    def forward(y, group):
        y = y.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def grouped_parallel_mlp(experts: List[nn.Module], x: torch.Tensor, groups) -> torch.Tensor:
    """Expert e's ParallelMLP output (stock keeps out[0]) on expert e's rows of x [.., M] -> [.., M].

    groups: EqualGroups for x [.., E_local, C, M], RowGroups for expert-contiguous x [R, M].
    The experts must share one `parallel_mlp_signature`.
    """
    _, act_key, col, row = parallel_mlp_signature(experts[0])
    fc1s = [e.dense_h_to_4h for e in experts]
    fc2s = [e.dense_4h_to_h for e in experts]
    tp = col[4]
    group = _tp_group(fc1s[0], tp) if tp > 1 else None
    if group is not None:
        x = _CopyToGroup.apply(x, group)
    h = groups.matmul(x, stack_expert_tensors([[lin.weight] for lin in fc1s]))
    fused = _BIAS_ACT.get(act_key) if col[2] else None  # the activation in the bias's pass
    if col[2]:  # added inside the linear or returned for the activation to add: the same sum
        h = groups.add_bias(h, stack_expert_tensors([[lin.bias] for lin in fc1s]), fused or "none")
    if fused is None:
        h = experts[0].activation_func(h)
    y = groups.matmul(h, stack_expert_tensors([[lin.weight] for lin in fc2s]))
    if group is not None:
        y = _ReduceFromGroup.apply(y, group)
    if row[2] and not row[3]:  # a skip_bias_add bias is returned beside y, and stock drops it
        y = groups.add_bias(y, stack_expert_tensors([[lin.bias] for lin in fc2s]))
    return y
