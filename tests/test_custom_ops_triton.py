"""turbomoe.custom_ops: the gating ops as torch.library custom ops. torch.library.opcheck (schema,
fake implementation, registered autograd against the real kernels), a fullgraph torch.compile of
the whole chain with no graph break, and its forward and backward equal to turbomoe.ops' eager
kernels and to the float64 reference. Triton kernels: natively on a GPU (cuda backend too), under
TRITON_INTERPRET=1 on the CPU."""
import os

import pytest
import torch

from conftest import HAS_CUDA

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not HAS_CUDA and not INTERPRET:
    pytest.skip("Triton kernels need a GPU, or TRITON_INTERPRET=1 on the CPU (as CI runs this file)",
                allow_module_level=True)

from torch._dynamo.utils import counters  # noqa: E402

from turbomoe import custom_ops, ops  # noqa: E402
from turbomoe import reference as ref  # noqa: E402

DEV = "cuda" if HAS_CUDA else "cpu"
BACKENDS = ["triton", pytest.param("cuda", marks=pytest.mark.gpu)] if HAS_CUDA else ["triton"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param == "cuda" and not ops.csrc.available():
        pytest.skip("the CUDA extension could not be built here")
    return request.param


def layer(x_SM, w_EM, k, capacity, backend, gating=custom_ops, renormalize=True, row_scores=False):
    """router -> slots -> scatter -> (experts: a per-row scale) -> gather, through `gating`
    (turbomoe.custom_ops, or a shim over turbomoe.ops with the same signatures); row_scores: the
    rows weighed by ops.row_scores and summed by the gather with unit weights (MoELayer's order)."""
    E = w_EM.shape[0]
    g = gating.topk_gating(x_SM @ w_EM.t(), k, "softmax", False, None, backend)
    s = gating.assign_slots(g.expert_ids, g.scores, E, capacity, "position", 0, backend)
    buf_RM = gating.scatter_tokens(x_SM, s, backend)
    y_RM = torch.tanh(buf_RM) * 1.5
    if row_scores:
        out = gating.gather_tokens(y_RM * ops.row_scores(s, g.scores)[:, None], s, None, False, backend)
    else:
        out = gating.gather_tokens(y_RM, s, g.scores, renormalize, backend)
    return out.square().sum() + 0.1 * g.aux_loss + 0.01 * g.z_loss


class eager_ops:  # turbomoe.ops with custom_ops' signatures: the eager autograd.Functions
    topk_gating = staticmethod(lambda logits, k, f, r, b, backend: ops.topk_gating(logits, k, f, r, b, backend=backend))
    assign_slots = staticmethod(lambda ids, sc, E, C, p, seed, backend: ops.assign_slots(ids, sc, E, C, p, seed,
                                                                                         backend=backend))
    scatter_tokens = staticmethod(lambda x, s, backend: ops.scatter_tokens(x, s, backend=backend))
    gather_tokens = staticmethod(lambda y, s, sc, r, backend: ops.gather_tokens(y, s, sc, r, backend=backend))


def inputs(S, E, M, dtype=torch.float32):
    x = torch.randn(S, M, device=DEV, dtype=dtype, requires_grad=True)
    w = (torch.randn(E, M, device=DEV, dtype=dtype) / M ** 0.5).requires_grad_()
    return x, w


@pytest.mark.parametrize("S, E, k, capacity", [(13, 4, 2, None), (9, 8, 1, 2), (5, 8, 3, None), (0, 4, 2, None)])
@pytest.mark.parametrize("row_scores", [False, True])
def test_compiled_chain_matches_eager_and_reference(backend, S, E, k, capacity, row_scores):
    torch._dynamo.reset()
    counters.clear()
    x, w = inputs(S, E, 24)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager", dynamic=False)
    results = []
    for fn, kernel_backend in ((compiled, backend), (layer, backend), (layer, "reference")):
        x.grad = w.grad = None
        gating = eager_ops if fn is layer else custom_ops
        loss = fn(x, w, k, capacity, kernel_backend, gating=gating, row_scores=row_scores)
        loss.backward()
        results.append((loss.detach(), x.grad.clone(), w.grad.clone()))
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    (loss_c, gx_c, gw_c), (loss_e, gx_e, gw_e), (loss_r, gx_r, gw_r) = results
    # The compiled chain runs the same kernels as eager: the same bits.
    assert torch.equal(loss_c, loss_e) and torch.equal(gx_c, gx_e) and torch.equal(gw_c, gw_e)
    if S == 0:  # the reference's aux and z losses are means over no tokens, NaN; the kernels' are 0
        assert loss_c == 0 and gx_c.shape == (0, 24) and not gw_c.any()
        return
    torch.testing.assert_close(loss_c, loss_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx_c, gx_r, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gw_c, gw_r, rtol=1e-4, atol=1e-5)


def test_opcheck(backend):
    S, E, k, M = 11, 6, 2, 16
    logits = torch.randn(S, E, device=DEV, requires_grad=True)
    bias = torch.randn(E, device=DEV)
    # opcheck's AOT checks sum every output into one loss, which fails on the int32 ids before the
    # float scores (a limit of the checker); the compiled chain above covers AOT dispatch.
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(custom_ops._topk_gating, (logits, k, "softmax", True, bias, backend), test_utils=checks)
    torch.library.opcheck(custom_ops._topk_gating, (logits, 1, "sigmoid", False, None, backend), test_utils=checks)
    g = ops.topk_gating(logits.detach(), k, backend=backend)
    for capacity in (None, 3):
        torch.library.opcheck(custom_ops._assign_slots, (g.expert_ids, g.scores, E, capacity, "position", 0, backend))
        s = ops.assign_slots(g.expert_ids, g.scores, E, capacity, backend=backend)
        x = torch.randn(S, M, device=DEV, requires_grad=True)
        torch.library.opcheck(custom_ops._scatter_tokens, (x, s.slots, s.num_rows, s.kept_counts, capacity, backend))
        y = torch.randn(s.num_rows, M, device=DEV, requires_grad=True)
        scores = g.scores.clone().requires_grad_()
        for renormalize in (False, True):
            torch.library.opcheck(custom_ops._gather_tokens,
                                  (y, s.slots, scores, s.kept_counts, capacity, renormalize, backend))
        torch.library.opcheck(custom_ops._gather_tokens, (y, s.slots, None, s.kept_counts, capacity, False, backend))


def test_fake_backward_strides_match_the_kernels(backend):
    """The backward ops' fake outputs are laid out as the kernels make them (contiguous) whatever the
    strides of the tensors they are given: router logits, or a GEMM's rows, in a transposed layout.
    Before, the fakes took those strides (empty_like), and inductor's compiled backward raised on its
    stride assertion (a wrong fake)."""
    S, E, k, M, N = 11, 6, 2, 8, 5
    checks = ("test_schema", "test_faketensor")
    logits_SE = torch.randn(E, S, device=DEV).t()
    ids, _, _, _, _, lse_S, ce_E = custom_ops._topk_gating(logits_SE, k, "softmax", True, None, backend)
    g_scores, one = torch.randn(S, k, device=DEV), torch.ones((), device=DEV)
    torch.library.opcheck(custom_ops._topk_gating_backward,
                          (logits_SE, ids, lse_S, ce_E, g_scores, one, one, "softmax", True, backend),
                          test_utils=checks)
    counts_G = torch.tensor([4, 0, 7], dtype=torch.int32, device=DEV)
    x_RK = torch.randn(M, 11, device=DEV).t()
    for w_GKN in (torch.randn(3, M, N, device=DEV), torch.randn(3, N, M, device=DEV).transpose(1, 2)):
        torch.library.opcheck(custom_ops._grouped_mm_backward,
                              (torch.randn(11, N, device=DEV), x_RK, w_GKN, counts_G, None, "triton", True, True),
                              test_utils=checks)
