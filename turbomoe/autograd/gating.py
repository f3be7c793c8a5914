"""autograd.Function for topk_gating over the Triton kernels, with a hand-written backward."""
from typing import Optional

import torch

from ..kernels import gating as kernels
from ..reference import GatingOutput


class TopKGating(torch.autograd.Function):

    @staticmethod
    def forward(ctx, logits_SE, k: int, score_func: str, renormalize: bool, bias_E: Optional[torch.Tensor]):
        sigmoid = score_func == "sigmoid"
        ids, scores, counts, ce_E, lse, aux, z = kernels.gating_forward(
            logits_SE, k, sigmoid, renormalize, None if bias_E is None else bias_E.detach().contiguous())
        ctx.save_for_backward(logits_SE, ids, lse, ce_E)
        ctx.config = (sigmoid, renormalize)
        ctx.mark_non_differentiable(ids, counts)
        return ids, scores, counts, aux, z

    @staticmethod
    def backward(ctx, _g_ids, g_scores, _g_counts, g_aux, g_z):
        logits_SE, ids, lse, ce_E = ctx.saved_tensors
        sigmoid, renormalize = ctx.config
        grad = kernels.gating_backward(logits_SE, ids, g_scores, lse, ce_E, g_aux, g_z, sigmoid, renormalize)
        return grad, None, None, None, None


def topk_gating(logits_SE, k, score_func="softmax", renormalize=False, selection_bias_E=None) -> GatingOutput:
    return GatingOutput(*TopKGating.apply(logits_SE, k, score_func, renormalize, selection_bias_E))
