"""A stand-in for Megatron-DeepSpeed's ParallelMLP expert, for the CPU tests (Megatron-DeepSpeed
cannot be installed in CI; scripts/gpu_megatron_deepspeed.sh runs the real one on the GPU).

The linears are megatron-core's real `tensor_parallel.ColumnParallelLinear` / `RowParallelLinear`
(the package Megatron-DeepSpeed's megatron/core was copied from; same (output, bias) returns,
skip_bias_add, input_is_parallel and tensor-parallel sums), built on the CPU with an explicit
tensor-parallel group: a group of one rank stands for Megatron-DeepSpeed's experts without expert
tensor parallelism (moe=True: not sliced, no communication), the model's TP group for
enable_expert_tensor_parallelism (sliced, input gradient and output summed over the group).
`ParallelMLP` below composes them as Megatron-DeepSpeed's megatron/model/transformer.py does:
column linear (skip_bias_add), bias + activation (or the fused bias-GELU, tanh GELU), row linear,
return (output, bias).
"""
import copy

import torch
import torch.nn.functional as F
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from torch import nn


def tanh_gelu_of_sum(y, bias):
    """Megatron's bias_gelu_impl: GELU (tanh approximation) of y + bias, written out."""
    x = y + bias
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


class ParallelMLP(nn.Module):
    """h, b = dense_h_to_4h(x); h = act(h + b); return dense_4h_to_h(h). act: 'bias_gelu' (fused),
    'gelu', 'swiglu' (ffn doubled for [gate | up]) or 'squared_relu'."""

    def __init__(self, hidden, ffn, act="bias_gelu", add_bias=True, tp_group=None, dtype=torch.float64,
                 sequence_parallel=False):
        super().__init__()
        cfg = ModelParallelConfig(use_cpu_initialization=True, params_dtype=dtype, gradient_accumulation_fusion=False,
                                  sequence_parallel=sequence_parallel)
        init = lambda w: nn.init.normal_(w, std=hidden**-0.5)  # noqa: E731
        self.add_bias = add_bias
        self.dense_h_to_4h = ColumnParallelLinear(hidden, 2 * ffn if act == "swiglu" else ffn, config=cfg,
                                                  init_method=init, bias=add_bias, gather_output=False,
                                                  skip_bias_add=True, tp_group=tp_group)
        self.bias_gelu_fusion = act == "bias_gelu"
        self.activation_func = None

        def swiglu(x):
            a, b = torch.chunk(x, 2, dim=-1)
            return F.silu(a) * b

        def squared_relu(x):
            return F.relu(x).square()

        if act == "swiglu":
            self.activation_func = swiglu
        elif act == "squared_relu":
            self.activation_func = squared_relu
        elif act == "gelu":
            self.activation_func = F.gelu
        self.dense_4h_to_h = RowParallelLinear(ffn, hidden, config=cfg, init_method=init, bias=add_bias,
                                               input_is_parallel=True, skip_bias_add=False, tp_group=tp_group)
        with torch.no_grad():  # Megatron zeroes the biases at init; random ones test their gradients
            for p in self.parameters():
                if p.dim() == 1:
                    p.normal_(std=0.1)

    def __deepcopy__(self, memo):
        """DeepSpeed's Experts deep-copies the expert per local expert. megatron-core's linears hold
        their process group, which cannot be copied: the copies share it (Megatron-DeepSpeed's
        linears read the one global tensor-parallel group instead)."""
        for lin in (self.dense_h_to_4h, self.dense_4h_to_h):
            memo[id(lin.tp_group)] = lin.tp_group
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def forward(self, hidden_states):
        # Stock MOELayer hands each expert a 4-D chunk [ep, 1, C, M]. Megatron-DeepSpeed's copy of
        # the linears' backward flattens any leading dims; megatron-core's takes at most 3: flatten here.
        lead = hidden_states.shape[:-1]
        h, bias = self.dense_h_to_4h(hidden_states.reshape(-1, hidden_states.shape[-1]))
        if self.bias_gelu_fusion:
            h = tanh_gelu_of_sum(h, bias)
        else:
            if bias is not None:
                h = h + bias
            h = self.activation_func(h)
        out, out_bias = self.dense_4h_to_h(h)
        return out.view(*lead, out.shape[-1]), out_bias
