"""autograd.Function for gather_tokens: out [S, M] = sum_j w * y[slot], hand-written backward."""
from typing import Optional

import torch

from ..reference import as_contiguous, compute_dtype, zero_width_dscores
from . import Function, Kept, once_differentiable


class GatherTokens(Function):

    @staticmethod
    def forward(y_RM, slots_SK, scores_SK: Optional[torch.Tensor], kept_counts_E: Optional[torch.Tensor],
                capacity: Optional[int], impl, renormalize: bool = False):
        """impl: the backend module (turbomoe.kernels or turbomoe.csrc). w = scores, or with
        renormalize the kept scores over their sum (formed inside the kernels, both ways), or 1 where
        scores is None (then y is not kept: the backward is a scatter). Returns out and Kept(y, the
        slots and scores as the kernels take them) for backward."""
        y_RM, slots_SK = y_RM.contiguous(), as_contiguous(slots_SK, torch.int32)
        scores_SK = None if scores_SK is None else scores_SK.contiguous()
        out_SM = y_RM.new_empty(slots_SK.shape[0], y_RM.shape[1])
        impl.pull_rows(y_RM, slots_SK, out_SM, scores_SK, renormalize=renormalize)
        return out_SM, Kept(None if scores_SK is None else y_RM, slots_SK, scores_SK)

    @staticmethod
    def setup_context(ctx, inputs, output):
        y_RM, _, _, kept_counts_E, capacity, impl, renormalize = inputs
        ctx.save_for_backward(*output[1].tensors, kept_counts_E)
        ctx.capacity, ctx.impl, ctx.renormalize, ctx.num_rows = capacity, impl, renormalize, y_RM.shape[0]

    @staticmethod
    @once_differentiable  # kernels: create_graph gives the gradient; differentiating it raises
    def backward(ctx, grad_out_SM, _g_kept):
        y_RM, slots_SK, scores_SK, kept_counts_E = ctx.saved_tensors
        # grad_y[slot] = w * grad_out (one writer per row, empty rows zero); grad_score from
        # <grad_out, y[slot]> in fp32 (through the renormalisation where asked).
        grad_out_SM = grad_out_SM.contiguous()
        grad_y_RM = grad_out_SM.new_empty(ctx.num_rows, grad_out_SM.shape[1])
        if scores_SK is None:
            ctx.impl.push_rows(grad_out_SM, slots_SK, grad_y_RM, kept_counts_E, ctx.capacity)
            return grad_y_RM, None, None, None, None, None, None
        acc = compute_dtype(y_RM.dtype)
        if grad_out_SM.shape[1] == 0 or grad_out_SM.shape[0] + ctx.num_rows == 0:  # no products, no rows to write
            # (the backends' launches exit early; the renormalised sum still makes NaN where it is NaN)
            grad_scores_SK = zero_width_dscores(scores_SK, slots_SK, ctx.num_rows, ctx.renormalize, acc)
        else:
            grad_scores_SK = torch.empty_like(scores_SK, dtype=acc)
            ctx.impl.push_rows(grad_out_SM, slots_SK, grad_y_RM, kept_counts_E, ctx.capacity, scores_SK=scores_SK,
                               y_RM=y_RM, dscores_SK=grad_scores_SK, renormalize=ctx.renormalize)
        return grad_y_RM, None, as_contiguous(grad_scores_SK, scores_SK.dtype), None, None, None, None


def gather_tokens(y_RM, slots_SK, scores_SK, kept_counts_E, capacity, impl, renormalize=False):
    return GatherTokens.apply(y_RM, slots_SK, scores_SK, kept_counts_E, capacity, impl, renormalize)[0]
