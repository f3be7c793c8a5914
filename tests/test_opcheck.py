"""torch.library.opcheck of the custom ops the reference backend runs while compiling (turbomoe.custom_ops
with backend "reference": assign_slots, scatter_tokens and grouped_mm, and their backward ops): schema,
registered autograd, the fake implementation against the real op (shapes, dtypes, strides, storage
offsets, devices) and AOT dispatch with dynamic shapes, over edge inputs: no tokens, capacity 0, one hot
expert, k = 1 and 3, empty groups, fp32 / fp64 / bf16, non-contiguous inputs, each differentiable input
alone. The kernel backends: tests/test_opcheck_triton.py."""
import pytest
import torch

from turbomoe import custom_ops, ops
from turbomoe.autograd.grouped_gemm import row_offsets

FAKE = ("test_schema", "test_faketensor")  # the backward ops: no autograd of their own (no double backward)


def routes(S, E, k, capacity, hot=False):
    """topk_gating and assign_slots of random logits; hot: every token's first choice is expert 0."""
    logits = torch.randn(S, E, generator=torch.Generator().manual_seed(S * E + k))
    if hot:
        logits[:, 0] += 100
    g = ops.topk_gating(logits, k)
    return g, ops.assign_slots(g.expert_ids, g.scores, E, capacity)


# S, E, k, capacity, hot: dropless; one hot expert over capacity with k = 3; capacity 0 (every route
# dropped) with k = 1; no tokens
ROUTINGS = [(7, 5, 2, None, False), (9, 4, 3, 2, True), (6, 6, 1, 0, False), (0, 4, 2, 3, False)]


@pytest.mark.parametrize("S, E, k, capacity, hot", ROUTINGS)
def test_assign_slots(S, E, k, capacity, hot):
    g, _ = routes(S, E, k, capacity, hot)
    for policy in ("position", ) if capacity is None else ("position", "rts", "probs"):
        torch.library.opcheck(custom_ops._assign_slots, (g.expert_ids, g.scores, E, capacity, policy, 5, "reference"))


def test_assign_slots_seed_draw_int64_ids_and_strided_inputs():
    g, _ = routes(7, 5, 2, 2)
    draw = torch.tensor([123456789])
    torch.library.opcheck(custom_ops._assign_slots, (g.expert_ids, g.scores, 5, 2, "rts", 5, "reference", draw))
    torch.library.opcheck(custom_ops._assign_slots,
                          (g.expert_ids.long().t().contiguous().t(), g.scores.t().contiguous().t(), 5, 2, "probs", 5,
                           "reference"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("S, E, k, capacity, hot", ROUTINGS[1:])
def test_scatter_tokens(dtype, S, E, k, capacity, hot):
    _, s = routes(S, E, k, capacity, hot)
    for x in (torch.randn(S, 3, dtype=dtype), torch.randn(3, S, dtype=dtype).t()):  # and x transposed
        torch.library.opcheck(custom_ops._scatter_tokens,
                              (x.requires_grad_(), s.slots, s.num_rows, s.kept_counts, capacity, "reference"))
    grad_RM = torch.randn(3, s.num_rows, dtype=dtype).t()
    torch.library.opcheck(custom_ops._scatter_tokens_backward, (grad_RM, s.slots, "reference"), test_utils=FAKE)


# counts (R = their sum, + 1 row past them that no group owns), w's layout (nn.Linear's: each w[g] the
# transpose of a contiguous [N, K], where dw is made in that layout), dtype
@pytest.mark.parametrize("counts, transposed, dtype", [([4, 0, 9, 1], False, torch.float64),
                                                       ([4, 0, 9, 1], True, torch.float32),
                                                       ([0, 0, 0], True, torch.float64), ([5], False, torch.bfloat16)])
def test_grouped_mm(counts, transposed, dtype):
    G, K, N, R = len(counts), 3, 5, sum(counts) + 1
    counts_G = torch.tensor(counts, dtype=torch.int32)

    def w_GKN(requires_grad):
        if transposed:
            return torch.randn(G, N, K, dtype=dtype, requires_grad=requires_grad).transpose(1, 2)
        return torch.randn(G, K, N, dtype=dtype, requires_grad=requires_grad)

    for need_dx, need_dw in ((True, True), (True, False), (False, True)):
        x_RK = torch.randn(K, R, dtype=dtype).t().requires_grad_(need_dx)  # strided rows
        for offs_G in (None, row_offsets(counts_G, R)):
            torch.library.opcheck(custom_ops._grouped_mm, (x_RK, w_GKN(need_dw), counts_G, offs_G, "reference"))
        dy_RN = torch.randn(N, R, dtype=dtype).t()
        torch.library.opcheck(custom_ops._grouped_mm_backward,
                              (dy_RN, x_RK.detach(), w_GKN(False), counts_G, None, "reference", need_dx, need_dw),
                              test_utils=FAKE)
