"""autograd.Function for scatter_tokens: x [S, M] -> expert buffer [R, M], hand-written backward."""
from typing import Optional

import torch

from ..reference import as_contiguous
from . import once_differentiable


class ScatterTokens(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x_SM, slots_SK, num_rows: int, kept_counts_E: Optional[torch.Tensor], capacity: Optional[int],
                impl):
        """impl: the backend module (turbomoe.kernels or turbomoe.csrc)."""
        x_SM, slots_SK = x_SM.contiguous(), as_contiguous(slots_SK, torch.int32)
        buf_RM = x_SM.new_empty(num_rows, x_SM.shape[1])
        impl.push_rows(x_SM, slots_SK, buf_RM, kept_counts_E, capacity)
        ctx.save_for_backward(slots_SK)
        ctx.impl = impl
        return buf_RM

    @staticmethod
    @once_differentiable  # kernels: create_graph gives the gradient; differentiating it raises
    def backward(ctx, grad_buf_RM):
        (slots_SK, ) = ctx.saved_tensors
        # Each token sums the gradients of its k rows in fp32: a pull, so no float atomics.
        grad_x_SM = grad_buf_RM.new_empty(slots_SK.shape[0], grad_buf_RM.shape[1])
        ctx.impl.pull_rows(grad_buf_RM.contiguous(), slots_SK, grad_x_SM)
        return grad_x_SM, None, None, None, None, None


def scatter_tokens(x_SM, slots_SK, num_rows: int, kept_counts_E, capacity, impl):
    return ScatterTokens.apply(x_SM, slots_SK, num_rows, kept_counts_E, capacity, impl)
