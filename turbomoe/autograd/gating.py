"""autograd.Function for topk_gating over the Triton kernels, with a hand-written backward."""
from typing import Optional

import torch

from ..kernels import gating as kernels
from ..reference import GatingOutput, aux_loss_coefficient


class TopKGating(torch.autograd.Function):

    @staticmethod
    def forward(ctx, logits_SE, k: int, score_func: str, renormalize: bool, bias_E: Optional[torch.Tensor]):
        S, E = logits_SE.shape
        sigmoid = score_func == "sigmoid"
        ids, scores, counts, first_counts, lse, probsum = kernels.gating_forward(
            logits_SE, k, sigmoid, renormalize, None if bias_E is None else bias_E.detach().contiguous())
        # DeepSpeed's l_aux = coef * sum_e me_e * ce_e; k <= 2 counts first choices only.
        ce_E = (first_counts if k <= 2 else counts).to(scores.dtype) / max(S, 1)
        me_E = probsum.sum(dim=0) / max(S, 1)
        aux = aux_loss_coefficient(E, k) * (me_E * ce_E).sum()
        z = (lse * lse).sum() / max(S, 1)
        ctx.save_for_backward(logits_SE, ids, scores, lse, ce_E)
        ctx.config = (k, sigmoid, renormalize)
        ctx.mark_non_differentiable(ids, counts)
        return ids, scores, counts, aux, z

    @staticmethod
    def backward(ctx, _g_ids, g_scores, _g_counts, g_aux, g_z):
        logits_SE, ids, scores, lse, ce_E = ctx.saved_tensors
        k, sigmoid, renormalize = ctx.config
        S, E = logits_SE.shape
        acc = scores.dtype
        if g_scores is None:
            g_scores = torch.zeros_like(scores)
        # Scale each partial term by 1/S here, before the kernel sums it into the logit gradient.
        aux_grad_E = (ce_E * (aux_loss_coefficient(E, k) / max(S, 1)) * g_aux.to(acc)
                      if g_aux is not None else torch.zeros_like(ce_E))
        z_coef = (g_z.to(acc) * (2.0 / max(S, 1))).reshape(1) if g_z is not None else scores.new_zeros(1)
        grad = kernels.gating_backward(logits_SE, ids, scores, g_scores.to(acc), lse, aux_grad_E.contiguous(), z_coef,
                                       sigmoid, renormalize)
        return grad, None, None, None, None


def topk_gating(logits_SE, k, score_func="softmax", renormalize=False, selection_bias_E=None) -> GatingOutput:
    return GatingOutput(*TopKGating.apply(logits_SE, k, score_func, renormalize, selection_bias_E))
