"""autograd.Function for scatter_tokens: x [S, M] -> expert buffer [R, M], hand-written backward."""
from typing import Optional

import torch

from ..reference import as_contiguous, compute_dtype
from . import Function, Kept, once_differentiable


class ScatterTokens(Function):

    @staticmethod
    def forward(x_SM, slots_SK, num_rows: int, kept_counts_E: Optional[torch.Tensor], capacity: Optional[int], impl):
        """impl: the backend module (turbomoe.kernels or turbomoe.csrc). Returns the buffer and Kept(the
        int32 slots) for backward."""
        x_SM, slots_SK = x_SM.contiguous(), as_contiguous(slots_SK, torch.int32)
        buf_RM = x_SM.new_empty(num_rows, x_SM.shape[1])
        impl.push_rows(x_SM, slots_SK, buf_RM, kept_counts_E, capacity)
        return buf_RM, Kept(slots_SK)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*output[1].tensors)
        ctx.impl = inputs[5]

    @staticmethod
    @once_differentiable  # kernels: create_graph gives the gradient; differentiating it raises
    def backward(ctx, grad_buf_RM, _g_kept):
        (slots_SK, ) = ctx.saved_tensors
        # Each token sums the gradients of its k rows in fp32: a pull, so no float atomics.
        grad_x_SM = grad_buf_RM.new_empty(slots_SK.shape[0], grad_buf_RM.shape[1])
        ctx.impl.pull_rows(grad_buf_RM.contiguous(), slots_SK, grad_x_SM)
        return grad_x_SM, None, None, None, None, None


def scatter_tokens(x_SM, slots_SK, num_rows: int, kept_counts_E, capacity, impl):
    return ScatterTokens.apply(x_SM, slots_SK, num_rows, kept_counts_E, capacity, impl)[0]


class RowScores(Function):
    """w [R] of the buffer's rows: row slots[s, j] gets w[s, j] (the scores, or with renormalize the
    kept ones over their sum), rows no route fills 0. The push kernel on unit one-column tokens forms
    the weights per token in registers, and with the rows' gradient as y its dot products are the
    scores' gradient: one launch each way."""

    @staticmethod
    def forward(scores_SK, slots_SK, num_rows: int, kept_counts_E: Optional[torch.Tensor], capacity: Optional[int],
                impl, renormalize: bool):
        """Returns w and Kept(the unit tokens, the slots and scores as the kernels take them) for backward."""
        acc = compute_dtype(scores_SK.dtype)  # the kernels take the scores in their accumulation dtype
        dtype = scores_SK.dtype
        scores_SK, slots_SK = as_contiguous(scores_SK, acc), as_contiguous(slots_SK, torch.int32)
        ones_S1 = scores_SK.new_ones(slots_SK.shape[0], 1)
        w_R1 = scores_SK.new_empty(num_rows, 1)
        impl.push_rows(ones_S1, slots_SK, w_R1, kept_counts_E, capacity, scores_SK=scores_SK, renormalize=renormalize)
        return as_contiguous(w_R1.view(-1), dtype), Kept(ones_S1, slots_SK, scores_SK)

    @staticmethod
    def setup_context(ctx, inputs, output):
        scores_SK, _, _, kept_counts_E, capacity, impl, renormalize = inputs
        ctx.save_for_backward(*output[1].tensors, kept_counts_E)
        ctx.dtype, ctx.capacity, ctx.impl, ctx.renormalize = scores_SK.dtype, capacity, impl, renormalize

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_w_R, _g_kept):
        ones_S1, slots_SK, scores_SK, kept_counts_E = ctx.saved_tensors
        grad_scores_SK = torch.empty_like(scores_SK)
        # The push writes the unit rows again (a scratch column) beside the dot products.
        scratch_R1 = scores_SK.new_empty(grad_w_R.shape[0], 1)
        ctx.impl.push_rows(ones_S1, slots_SK, scratch_R1, kept_counts_E, ctx.capacity, scores_SK=scores_SK,
                           y_RM=as_contiguous(grad_w_R, scores_SK.dtype).view(-1, 1), dscores_SK=grad_scores_SK,
                           renormalize=ctx.renormalize)
        return as_contiguous(grad_scores_SK, ctx.dtype), None, None, None, None, None, None


def row_scores(scores_SK, slots_SK, num_rows: int, kept_counts_E, capacity, impl, renormalize: bool):
    return RowScores.apply(scores_SK, slots_SK, num_rows, kept_counts_E, capacity, impl, renormalize)[0]
