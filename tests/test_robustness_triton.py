"""Issue #20: one rule per edge input, written in the reference, followed by every kernel backend.

  S = 0                     aux and z losses 0 (means over max(S, 1)), gradients empty
  NaN in selection_bias     the expert's selection value ranks as -inf (chosen after every number)
  probs policy, NaN score   ranks as -inf: dropped first; -0.0 ranks as +0.0 (ties to the earlier route)
  bare slots                outside [0, num_rows) route nowhere, int64 ones too (tests/test_errors.py)

Runs the Triton kernels under TRITON_INTERPRET=1 on the CPU (scripts/test.sh), natively on a GPU,
where the CUDA kernels run too.
"""
import os

import pytest
import torch

from conftest import HAS_CUDA, require_cuda_backend

if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU, or TRITON_INTERPRET=1 on the CPU", allow_module_level=True)

from turbomoe import ops  # noqa: E402
from turbomoe import reference as ref  # noqa: E402
from turbomoe.nn import MoELayer  # noqa: E402

DEV = "cuda" if HAS_CUDA else "cpu"
BACKENDS = ["triton", pytest.param("cuda", marks=pytest.mark.gpu)] if HAS_CUDA else ["triton"]
NAN, INF = float("nan"), float("inf")


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param == "cuda":
        require_cuda_backend()
    return request.param


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_no_tokens(score_func, backend):
    """S = 0: aux = z = 0 on every backend (failed before on the reference: NaN, 0/0)."""
    logits = torch.zeros(0, 6, device=DEV, requires_grad=True)
    for b in (backend, "reference"):
        g = ops.topk_gating(logits, 2, score_func, renormalize=True, backend=b)
        assert g.expert_ids.shape == (0, 2) and g.counts.tolist() == [0] * 6
        assert g.aux_loss.item() == 0.0 and g.z_loss.item() == 0.0
        (g.aux_loss + g.z_loss + g.scores.sum()).backward()
        assert logits.grad.shape == (0, 6)
        s = ops.assign_slots(g.expert_ids, g.scores, 6, capacity=0, drop_policy="rts", backend=b)
        assert s.slots.shape == (0, 2) and s.num_rows == 0


def test_layer_on_an_empty_batch(backend):
    layer = MoELayer(16, 24, 4, 2, capacity_factor=1.0, min_capacity=0, z_loss_coef=0.1, backend=backend,
                     gmm_backend="triton", device=DEV)
    out, loss = layer(torch.randn(0, 16, device=DEV))
    assert out.shape == (0, 16) and loss.item() == 0.0


@pytest.mark.parametrize("bias", [[NAN, 0, 0, 0, 0], [0, NAN, NAN, 0, 0], [NAN] * 5, [0, -INF, -INF, 0, INF],
                                  [-INF] * 5, [INF, NAN, -INF, INF, 0]])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_non_finite_selection_bias(bias, k, backend):
    """A NaN bias ranks as -inf, ties (+-inf among them) to the lower id; the chosen experts are
    distinct even when k reaches the experts of -inf value (failed before: the reference chose a
    NaN-biased expert first, Triton never)."""
    logits = torch.round(torch.randn(9, 5, device=DEV) * 64) / 64
    bias_E = torch.tensor(bias, device=DEV)
    want = ref.topk_gating(logits.double(), k, selection_bias_E=bias_E.double())
    got = ops.topk_gating(logits, k, selection_bias_E=bias_E, backend=backend)
    assert torch.equal(got.expert_ids, want.expert_ids)
    assert torch.equal(got.counts, want.counts)
    assert torch.allclose(got.scores.double(), want.scores, rtol=1e-6, atol=1e-7)
    assert (got.expert_ids.sort(dim=1).values.diff(dim=1) > 0).all()


def test_probs_policy_nan_and_signed_zero_scores(backend):
    """probs keeps the highest scores; a NaN score ranks as -inf (dropped first), -0.0 and +0.0 are
    equal, so the earlier route wins (failed before: NaN dropped on one backend and kept on the
    other; the kernels put +0.0 ahead of -0.0)."""
    scores = torch.tensor([NAN, -0.0, 0.0, -0.0, 0.5, NAN, -INF, 0.0, 0.25, -1.0, NAN, 0.0], device=DEV)
    ids = torch.tensor([0, 0, 0, 1, 0, 1, 1, 1, 2, 2, 2, 2], dtype=torch.int32, device=DEV)
    for C in (1, 2, 3, 4):
        want = ref.assign_slots(ids[:, None].cpu(), scores[:, None].cpu(), 3, C, "probs")
        got = ops.assign_slots(ids[:, None], scores[:, None], 3, C, "probs", backend=backend)
        assert torch.equal(got.slots.cpu(), want.slots) and torch.equal(got.kept_counts.cpu(), want.kept_counts)
    # Spelled out for C = 2: expert 0 keeps 0.5 and the first zero (route 1, -0.0); expert 1 keeps
    # the zeros (routes 3, 7) over -inf and NaN; expert 2 keeps 0.25 and 0.0 over -1.0 and NaN.
    kept = ops.assign_slots(ids[:, None], scores[:, None], 3, 2, "probs", backend=backend).slots[:, 0] >= 0
    assert kept.nonzero().flatten().tolist() == [1, 3, 4, 7, 8, 11]
