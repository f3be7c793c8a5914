"""autograd.Function for topk_gating over the Triton kernels, with a hand-written backward."""
from typing import Optional

import torch

from ..reference import GatingOutput
from . import once_differentiable


class TopKGating(torch.autograd.Function):

    @staticmethod
    def forward(ctx, logits_SE, k: int, score_func: str, renormalize: bool, bias_E: Optional[torch.Tensor], impl):
        """impl: the backend module (turbomoe.kernels or turbomoe.csrc)."""
        sigmoid = score_func == "sigmoid"
        ids, scores, counts, ce_E, lse, aux, z = impl.gating_forward(
            logits_SE, k, sigmoid, renormalize, None if bias_E is None else bias_E.detach().contiguous())
        ctx.save_for_backward(logits_SE, ids, lse, ce_E)
        ctx.config = (sigmoid, renormalize, impl)
        ctx.mark_non_differentiable(ids, counts)
        return ids, scores, counts, aux, z

    @staticmethod
    @once_differentiable  # kernels: create_graph gives the gradient; differentiating it raises
    def backward(ctx, _g_ids, g_scores, _g_counts, g_aux, g_z):
        logits_SE, ids, lse, ce_E = ctx.saved_tensors
        sigmoid, renormalize, impl = ctx.config
        grad = impl.gating_backward(logits_SE, ids, g_scores, lse, ce_E, g_aux, g_z, sigmoid, renormalize)
        return grad, None, None, None, None, None


def topk_gating(logits_SE, k, score_func, renormalize, selection_bias_E, impl) -> GatingOutput:
    return GatingOutput(*TopKGating.apply(logits_SE, k, score_func, renormalize, selection_bias_E, impl))
