"""torch.library.opcheck of turbomoe's custom ops on the Triton kernels (natively on a GPU, under
TRITON_INTERPRET=1 on the CPU): schema, registered autograd, the fake implementation against the real
op (shapes, dtypes, strides, storage offsets, devices), forward and backward ops, and AOT dispatch with
dynamic shapes, over edge inputs: no tokens, capacity 0, one hot expert, k = 1 and 3, empty groups,
fp32 / fp64 / bf16 (the grouped GEMM: fp32 / fp16), strided inputs, each differentiable input alone.
The reference backend's ops: tests/test_opcheck.py."""
import os

import pytest
import torch

from conftest import HAS_CUDA

if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU, or TRITON_INTERPRET=1 on the CPU (as CI runs this file)",
                allow_module_level=True)

from torch.testing._internal.optests import aot_autograd_check  # noqa: E402

from turbomoe import custom_ops, ops  # noqa: E402

DEV = "cuda" if HAS_CUDA else "cpu"
B = "triton"
NO_AOT = ("test_schema", "test_autograd_registration", "test_faketensor")
FAKE = ("test_schema", "test_faketensor")  # the backward ops: no autograd of their own (no double backward)


def randn(*shape, dtype=torch.float32, transposed=False):
    """A tensor, or a [rows, cols] one with its values laid out column-major (a transposed view)."""
    if transposed:
        return torch.randn(*shape[::-1], device=DEV, dtype=dtype).t()
    return torch.randn(*shape, device=DEV, dtype=dtype)


# S, E, k, score_func, renormalize, selection bias, dtype
@pytest.mark.parametrize("S, E, k, score_func, renormalize, bias, dtype", [
    (7, 5, 2, "softmax", True, True, torch.float32),
    (5, 6, 3, "sigmoid", True, False, torch.bfloat16),
    (6, 4, 1, "sigmoid", False, True, torch.float64),
    (0, 4, 2, "softmax", False, False, torch.float32),
])
def test_topk_gating(S, E, k, score_func, renormalize, bias, dtype):
    bias_E = torch.randn(E, device=DEV) if bias else None
    for transposed in (False, True):
        logits_SE = randn(S, E, dtype=dtype, transposed=transposed).requires_grad_()
        torch.library.opcheck(custom_ops._topk_gating, (logits_SE, k, score_func, renormalize, bias_E, B),
                              test_utils=NO_AOT)

    # opcheck's AOT check sums every output into one loss, and the sum of the int32 ids cannot take the
    # float scores (a limit of the checker): the check it runs (aot_autograd_check), on the float outputs.
    def float_outputs(logits, bias):
        g = custom_ops.topk_gating(logits, k, score_func, renormalize, bias, B)
        return g.scores, g.aux_loss, g.z_loss

    aot_autograd_check(float_outputs, (logits_SE, bias_E), {}, dynamic=True, check_gradients="auto")
    ids, scores, _, _, _, lse_S, ce_E = custom_ops._topk_gating(logits_SE.detach(), k, score_func, renormalize, bias_E,
                                                                B)
    one = torch.ones((), device=DEV, dtype=scores.dtype)
    for g_scores, g_aux, g_z in ((randn(S, k, dtype=scores.dtype, transposed=True), one, one), (None, None, one)):
        torch.library.opcheck(custom_ops._topk_gating_backward, (logits_SE.detach(), ids, lse_S, ce_E, g_scores, g_aux,
                                                                 g_z, score_func, renormalize, B), test_utils=FAKE)


def test_topk_gating_backward_only_outputs_are_not_differentiable():
    """lse and ce, returned for the backward only, get no gradient: before, they required grad, and a loss
    through them got a zero gradient for logits without an error."""
    logits_SE = torch.randn(7, 5, device=DEV, requires_grad=True)
    *_, lse_S, ce_E = custom_ops._topk_gating(logits_SE, 2, "softmax", False, None, B)
    assert not lse_S.requires_grad and not ce_E.requires_grad


# S, E, k, capacity, one hot expert, dtype: dropless; over capacity with k = 3; capacity 0 (every route
# dropped) with k = 1; no tokens
@pytest.mark.parametrize("S, E, k, capacity, hot, dtype", [
    (7, 5, 2, None, False, torch.float32),
    (9, 4, 3, 2, True, torch.bfloat16),
    (6, 6, 1, 0, False, torch.float64),
    (0, 4, 2, 3, False, torch.float32),
])
def test_routing_chain(S, E, k, capacity, hot, dtype):
    """assign_slots, scatter_tokens, gather_tokens and their backward ops on one routing."""
    logits = torch.randn(S, E, device=DEV, dtype=dtype)
    if hot:
        logits[:, 0] += 100  # every token's first choice: expert 0
    g = ops.topk_gating(logits, k, backend=B)
    for policy in ("position", ) if capacity is None else ("position", "rts", "probs"):
        torch.library.opcheck(custom_ops._assign_slots, (g.expert_ids, g.scores, E, capacity, policy, 5, B))
    s = ops.assign_slots(g.expert_ids, g.scores, E, capacity, backend=B)
    M, R = 3, s.num_rows
    x_SM = randn(S, M, dtype=dtype, transposed=True).requires_grad_()
    torch.library.opcheck(custom_ops._scatter_tokens, (x_SM, s.slots, R, s.kept_counts, capacity, B))
    torch.library.opcheck(custom_ops._scatter_tokens_backward, (randn(R, M, dtype=dtype, transposed=True), s.slots, B),
                          test_utils=FAKE)
    y_RM = randn(R, M, dtype=dtype, transposed=True)
    scores = g.scores.t().contiguous().t()
    for y_grad, scores_grad, renormalize in ((True, True, True), (True, False, False), (False, True, True)):
        torch.library.opcheck(custom_ops._gather_tokens, (y_RM.detach().requires_grad_(y_grad), s.slots,
                                                          scores.detach().requires_grad_(scores_grad), s.kept_counts,
                                                          capacity, renormalize, B))
    for kept_E, cap in ((s.kept_counts, capacity), (None, None)):  # unit weights: the backward is a scatter
        torch.library.opcheck(custom_ops._gather_tokens, (y_RM.detach().requires_grad_(), s.slots, None, kept_E, cap,
                                                          False, B))
    # the backward op as _gather_setup calls it: y and scores contiguous
    torch.library.opcheck(custom_ops._gather_tokens_backward, (randn(S, M, dtype=dtype, transposed=True),
                                                               y_RM.contiguous(), s.slots, g.scores, s.kept_counts,
                                                               capacity, True, B), test_utils=FAKE)


@pytest.mark.parametrize("capacity", [None, 150])
def test_assign_slots_kept_counts_over_several_blocks(capacity):
    """1040 routes over E = 5 experts span two blocks of the Triton launcher's ranks: its kept counts were
    then the last row of its [blocks, E] running sums, a view at storage offset 5 where the fake has a
    tensor of its own (so inductor asserted them 16-byte aligned, and 20 bytes are not)."""
    S, E, k = 520, 5, 2
    ids = torch.randint(0, E, (S, 1), device=DEV, dtype=torch.int32)
    ids_SK = torch.cat([ids, (ids + 1) % E], 1)
    torch.library.opcheck(custom_ops._assign_slots, (ids_SK, torch.rand(S, k, device=DEV), E, capacity, "position",
                                                     0, B))


# counts (R = their sum: the Triton GEMM leaves rows past it unspecified), w's layout (nn.Linear's: each
# w[g] the transpose of a contiguous [N, K], where dw is made in that layout), dtype
@pytest.mark.parametrize("counts, transposed, dtype", [
    ([4, 0, 9, 1], True, torch.float32),
    ([2, 0, 3, 0], False, torch.float16),
    ([0, 0, 0], False, torch.float32),
])
def test_grouped_mm(counts, transposed, dtype):
    G, K, N, R = len(counts), 3, 5, sum(counts)
    counts_G = torch.tensor(counts, device=DEV, dtype=torch.int32)

    def w_GKN(requires_grad):
        w = randn(G, N, K, dtype=dtype).transpose(1, 2) if transposed else randn(G, K, N, dtype=dtype)
        return w.requires_grad_(requires_grad)

    for need_dx, need_dw in ((True, True), (True, False), (False, True)):
        x_RK = randn(R, K, dtype=dtype, transposed=True).requires_grad_(need_dx)
        torch.library.opcheck(custom_ops._grouped_mm, (x_RK, w_GKN(need_dw), counts_G, None, B))
        torch.library.opcheck(custom_ops._grouped_mm_backward, (randn(R, N, dtype=dtype), x_RK.detach(), w_GKN(False),
                                                                counts_G, None, B, need_dx, need_dw), test_utils=FAKE)


# rows, F, dtype: odd F, no rows, F past one block of the kernels (1024)
@pytest.mark.parametrize("R, F, dtype", [(5, 3, torch.float32), (0, 4, torch.bfloat16), (2, 1030, torch.float64)])
def test_swiglu(R, F, dtype):
    h_R2F = torch.randn(R, 2 * F + 3, device=DEV, dtype=dtype)[:, :2 * F]  # unit column stride, rows apart
    scale_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    scale_R = torch.rand(R, device=DEV, dtype=scale_dtype)
    for h_grad, scale_grad in ((True, None), (True, True), (False, True), (True, False)):
        scale = None if scale_grad is None else scale_R.detach().requires_grad_(scale_grad)
        torch.library.opcheck(custom_ops._swiglu, (h_R2F.detach().requires_grad_(h_grad), scale))
    for scale in (None, scale_R):
        torch.library.opcheck(custom_ops._swiglu_backward, (randn(R, F, dtype=dtype), h_R2F, scale), test_utils=FAKE)
