"""autograd.Function for scatter_tokens: x [S, M] -> expert buffer [R, M], hand-written backward."""
from typing import Optional

import torch

from ..kernels.rows import pull_rows, push_rows


class ScatterTokens(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x_SM, slots_SK, num_rows: int, kept_counts_E: Optional[torch.Tensor], capacity: Optional[int]):
        x_SM, slots_SK = x_SM.contiguous(), slots_SK.to(torch.int32).contiguous()
        buf_RM = x_SM.new_empty(num_rows, x_SM.shape[1])
        push_rows(x_SM, slots_SK, buf_RM, kept_counts_E, capacity)
        ctx.save_for_backward(slots_SK)
        return buf_RM

    @staticmethod
    def backward(ctx, grad_buf_RM):
        (slots_SK, ) = ctx.saved_tensors
        # Each token sums the gradients of its k rows in fp32: a pull, so no float atomics.
        grad_x_SM = grad_buf_RM.new_empty(slots_SK.shape[0], grad_buf_RM.shape[1])
        pull_rows(grad_buf_RM.contiguous(), slots_SK, grad_x_SM)
        return grad_x_SM, None, None, None, None


def scatter_tokens(x_SM, slots_SK, num_rows: int, kept_counts_E=None, capacity=None):
    return ScatterTokens.apply(x_SM, slots_SK, num_rows, kept_counts_E, capacity)
