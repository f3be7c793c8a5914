"""autograd.Function for topk_gating over the Triton kernels, with a hand-written backward."""
from typing import Optional

import torch

from ..reference import GatingOutput
from . import Function, Kept, once_differentiable


class TopKGating(Function):

    @staticmethod
    def forward(logits_SE, k: int, score_func: str, renormalize: bool, bias_E: Optional[torch.Tensor], impl):
        """impl: the backend module (turbomoe.kernels or turbomoe.csrc). Returns ids, scores, counts,
        aux, z and Kept(lse [S], ce [E]) for backward."""
        bias_E = None if bias_E is None else bias_E.detach().contiguous()
        ids, scores, counts, ce_E, lse_S, aux, z = impl.gating_forward(logits_SE, k, score_func == "sigmoid",
                                                                       renormalize, bias_E)
        return ids, scores, counts, aux, z, Kept(lse_S, ce_E)

    @staticmethod
    def setup_context(ctx, inputs, output):
        logits_SE, _, score_func, renormalize, _, impl = inputs
        ids, _, counts, _, _, kept = output
        ctx.save_for_backward(logits_SE, ids, *kept.tensors)
        ctx.config = (score_func == "sigmoid", renormalize, impl)
        ctx.mark_non_differentiable(ids, counts)

    @staticmethod
    @once_differentiable  # kernels: create_graph gives the gradient; differentiating it raises
    def backward(ctx, _g_ids, g_scores, _g_counts, g_aux, g_z, _g_kept):
        logits_SE, ids, lse, ce_E = ctx.saved_tensors
        sigmoid, renormalize, impl = ctx.config
        grad = impl.gating_backward(logits_SE, ids, g_scores, lse, ce_E, g_aux, g_z, sigmoid, renormalize)
        return grad, None, None, None, None, None


def topk_gating(logits_SE, k, score_func, renormalize, selection_bias_E, impl) -> GatingOutput:
    return GatingOutput(*TopKGating.apply(logits_SE, k, score_func, renormalize, selection_bias_E, impl)[:5])
