"""autograd.Function for second_expert (top-2's second expert, sampled or the best other logit), hand-written
backward."""
from ..reference import as_contiguous
from . import Function, once_differentiable


class SecondExpert(Function):

    @staticmethod
    def forward(logits_SE, first_ids_S1, first_scores_S1, counts_E, rand_SE, impl):
        """impl: the backend module that fuses the op (turbomoe.csrc or turbomoe.kernels)."""
        ids_S2, scores_S2, counts = impl.second_expert_forward(logits_SE, first_ids_S1, first_scores_S1, counts_E,
                                                               rand_SE)
        return ids_S2, scores_S2, counts

    @staticmethod
    def setup_context(ctx, inputs, output):
        logits_SE, _, first_scores_S1, _, _, impl = inputs
        ids_S2, _, counts = output
        ctx.save_for_backward(logits_SE, ids_S2, first_scores_S1)
        ctx.impl = impl
        ctx.mark_non_differentiable(ids_S2, counts)

    @staticmethod
    @once_differentiable  # kernels: create_graph gives the gradient; differentiating it raises
    def backward(ctx, _g_ids, g_scores_S2, _g_counts):
        logits_SE, ids_S2, first_scores_S1 = ctx.saved_tensors
        # p2 = p1 * exp(l2 - l1): d l2 = g2 * p2, d l1 = -g2 * p2, d p1 = g1 + g2 * exp(l2 - l1).
        g_logits, g_first = ctx.impl.second_expert_backward(logits_SE, ids_S2, first_scores_S1, g_scores_S2)
        return g_logits, None, as_contiguous(g_first.view_as(first_scores_S1), first_scores_S1.dtype), None, None, None


def second_expert(logits_SE, first_ids_S1, first_scores_S1, counts_E, rand_SE, impl):
    return SecondExpert.apply(logits_SE, first_ids_S1, first_scores_S1, counts_E, rand_SE, impl)
