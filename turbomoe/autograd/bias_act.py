"""Each expert's bias, and its activation, over the rows of a grouped GEMM's output, in one pass each way:

    y [R, N] (expert e's rows), b [G, N] -> act(y + b[group of row]) [R, N]

The groups: `groups_R` (the dropless rows: row_groups of the counts; rows whose group is >= G, past
the counts, are zero out and pass no gradient, to b or to y: a grouped GEMM leaves them unspecified,
NaN too, which a one-hot GEMM's 0 x NaN would carry into b's gradient) or `rows_per_group` C (the
capacity buffer [.., G, C, N] seen as rows: row r is expert (r // C) % G's). act: none, gelu_tanh
(Megatron's fused bias-GELU), gelu (erf). Math in fp32 (fp64 for fp64), rounded once to y's dtype.

The hand-written backward (CUDA: the Triton kernels) writes z's gradient once and sums it per group
for b in fp32, in a fixed order (a sum over C, or a one-hot [G, R] GEMM): deterministic, no float
atomics. It keeps y (not the activation's output) and b. Unfused, the bias add, the activation and
their backward take four passes each way, and a broadcast add takes PyTorch's strided path.
CPU tensors take the same Function with its math in PyTorch; torch.compile traces the reference.
`bias_act_reference` is the spec the tests hold both to (a one-hot GEMM for the bias, autograd's
backward).
"""
from typing import Optional

import torch
import torch.nn.functional as F

from ..kernels.bias_act import ACTS
from ..reference import compute_dtype
from . import Function, kernel_backward


def _groups(R: int, G: int, groups_R: Optional[torch.Tensor], rows_per_group: Optional[int], device) -> torch.Tensor:
    if groups_R is not None:
        return groups_R
    return torch.arange(R, device=device) // max(rows_per_group, 1) % max(G, 1)


def _act(z: torch.Tensor, act: str) -> torch.Tensor:
    return z if act == "none" else F.gelu(z, approximate="tanh" if act == "gelu_tanh" else "none")


def bias_act_reference(y_RN: torch.Tensor, b_GN: torch.Tensor, groups_R: Optional[torch.Tensor] = None,
                       rows_per_group: Optional[int] = None, act: str = "none") -> torch.Tensor:
    """The spec: the bias through a one-hot [R, G] GEMM (no bias past the groups; its gradient a
    deterministic GEMM), in the compute dtype."""
    c = compute_dtype(y_RN.dtype)
    G = b_GN.shape[0]
    group_R1 = _groups(y_RN.shape[0], G, groups_R, rows_per_group, y_RN.device)[:, None]
    z_RN = y_RN.to(c) + (group_R1 == torch.arange(G, device=y_RN.device)).to(c) @ b_GN.to(c)
    return _act(torch.where(group_R1 < G, z_RN, 0), act).to(y_RN.dtype)  # past the groups: 0, no gradient


def _biased(y_RN, b_GN, groups_R, rows_per_group) -> torch.Tensor:
    """z = y + b[group of row] in the compute dtype (0 past the groups), the PyTorch form: a broadcast
    over the capacity buffer's [blocks, G, C, N] view, or a gather by groups_R."""
    c = compute_dtype(y_RN.dtype)
    (R, N), G = y_RN.shape, b_GN.shape[0]
    if rows_per_group is not None:
        C = rows_per_group
        return (y_RN.to(c).view(R // max(G * C, 1), G, C, N) + b_GN.to(c)[:, None]).view(R, N)
    if G == 0:
        return y_RN.new_zeros(y_RN.shape, dtype=c)
    bias_RN = b_GN.to(c).index_select(0, groups_R.clamp(0, G - 1))
    return torch.where((groups_R < G)[:, None], y_RN.to(c) + bias_RN, 0)


class BiasAct(Function):
    """kernels: the Triton kernels (CUDA tensors, or the CPU under TRITON_INTERPRET=1), else the same
    math in PyTorch (the CPU, fp64)."""

    @staticmethod
    def forward(y_RN, b_GN, groups_R, rows_per_group, act, kernels):
        from ..kernels.bias_act import bias_act_forward
        if kernels:
            return bias_act_forward(y_RN, b_GN, groups_R, rows_per_group, act)
        return _act(_biased(y_RN, b_GN, groups_R, rows_per_group), act).to(y_RN.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        y_RN, b_GN, groups_R, rows_per_group, act, kernels = inputs
        ctx.save_for_backward(None if act == "none" else y_RN, b_GN, groups_R)
        ctx.rows_per_group, ctx.act, ctx.kernels = rows_per_group, act, kernels

    @staticmethod
    def backward(ctx, dout_RN):
        return kernel_backward(ctx.kernels, BiasAct._backward, ctx, dout_RN)

    @staticmethod
    def _backward(ctx, dout_RN):
        from ..kernels.bias_act import bias_act_backward
        y_RN, b_GN, groups_R = ctx.saved_tensors
        dout_RN = dout_RN.contiguous()
        if ctx.act == "none" and groups_R is None:
            dz_RN = dout_RN
        elif ctx.kernels:  # (act none: a pass that zeroes the rows past the groups)
            dz_RN = bias_act_backward(y_RN, b_GN, groups_R, ctx.rows_per_group, ctx.act, dout_RN)
        else:
            dz_RN = dout_RN
            if ctx.act != "none":
                z_RN = _biased(y_RN, b_GN, groups_R, ctx.rows_per_group)
                dz_RN = torch.ops.aten.gelu_backward(dout_RN.to(z_RN.dtype), z_RN,
                                                     approximate="tanh" if ctx.act == "gelu_tanh" else "none")
                dz_RN = dz_RN.to(y_RN.dtype)
            if groups_R is not None:
                dz_RN = torch.where((groups_R < b_GN.shape[0])[:, None], dz_RN, 0)
        db_GN = None
        if ctx.needs_input_grad[1]:
            G, N = b_GN.shape
            if ctx.rows_per_group is not None:
                C = ctx.rows_per_group
                dz_BGCN = dz_RN.view(dz_RN.shape[0] // max(G * C, 1), G, C, N)
                db_GN = dz_BGCN.sum((0, 2), dtype=compute_dtype(dz_RN.dtype)).to(b_GN.dtype)
            else:
                onehot_GR = groups_R[None, :] == torch.arange(G, device=groups_R.device)[:, None]
                db_GN = onehot_GR.to(dz_RN.dtype) @ dz_RN
        return dz_RN if ctx.needs_input_grad[0] else None, db_GN, None, None, None, None


def check_bias_act_args(y_RN, b_GN, groups_R, rows_per_group, act):
    if act not in ACTS:
        raise ValueError(f"act must be one of {ACTS}, got {act!r}")
    if y_RN.dim() != 2 or b_GN.dim() != 2 or y_RN.shape[1] != b_GN.shape[1]:
        raise ValueError(f"y must be [R, N] and b [G, N], got {tuple(y_RN.shape)} and {tuple(b_GN.shape)}")
    if y_RN.dtype != b_GN.dtype or not y_RN.is_floating_point():
        raise TypeError(f"y and b must share one float dtype, got {y_RN.dtype} and {b_GN.dtype}")
    if (groups_R is None) == (rows_per_group is None):
        raise ValueError("give the rows' groups either as groups_R or as rows_per_group, not both")
    if groups_R is not None:
        if groups_R.shape != y_RN.shape[:1] or groups_R.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"groups_R must be an int [R] = [{y_RN.shape[0]}], got {groups_R.dtype} "
                             f"{tuple(groups_R.shape)}")
    elif not (isinstance(rows_per_group, int) and rows_per_group >= 0
              and (y_RN.shape[0] % (rows_per_group * b_GN.shape[0]) == 0 if rows_per_group * b_GN.shape[0]
                   else y_RN.shape[0] == 0)):
        raise ValueError(f"rows_per_group must be an int C with R = blocks x G x C, got C = {rows_per_group!r}, "
                         f"R = {y_RN.shape[0]}, G = {b_GN.shape[0]}")
    for name, t in (("b", b_GN), ("groups_R", groups_R)):
        if t is not None and t.device != y_RN.device:
            raise ValueError(f"{name} is on {t.device}, y on {y_RN.device}")


def bias_act(y_RN: torch.Tensor, b_GN: torch.Tensor, groups_R: Optional[torch.Tensor] = None,
             rows_per_group: Optional[int] = None, act: str = "none", kernels: bool = True) -> torch.Tensor:
    """act(y + b[group of row]) [R, N]; differentiable in y and b (see the module doc). Under
    torch.autocast b is cast to y's dtype, as F.linear casts its bias there. kernels=False: plain
    PyTorch on CUDA too (differentiable twice: the reference experts)."""
    if b_GN.dtype != y_RN.dtype and torch.is_autocast_enabled(y_RN.device.type):
        b_GN = b_GN.to(y_RN.dtype)
    check_bias_act_args(y_RN, b_GN, groups_R, rows_per_group, act)
    if torch.compiler.is_compiling():
        # plain ops, differentiated by AOTAutograd. Through the Function, the GPU machine's torch
        # 2.11 traced a zero output where inputs need gradients (tests/test_bias_act.py, 2026-11-28;
        # right on 2.13; cause not found). The one-hot GEMM keeps the bias's gradient a GEMM: an
        # index_select's would be atomic adds.
        return bias_act_reference(y_RN, b_GN, groups_R, rows_per_group, act)
    # fp64 (gradcheck) in PyTorch: the kernels compute in fp32
    kernels = kernels and y_RN.is_cuda and y_RN.dtype != torch.float64
    return BiasAct.apply(y_RN.contiguous(), b_GN.contiguous(), None if groups_R is None else groups_R.contiguous(),
                         rows_per_group, act, kernels)
