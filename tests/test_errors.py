"""Bad input gets a clear Python error on every backend, never a fault or silent garbage.

Every test runs once per backend this process can run (conftest.kernel_backends): the reference
here; the Triton kernels too where tests/test_errors_triton.py runs this file under
TRITON_INTERPRET=1, and the CUDA kernels on a GPU. Tensors live where the backend runs.
"""
import pytest
import torch

import turbomoe
from conftest import HAS_CUDA, kernel_backends, require_cuda_backend
from turbomoe import ops, reference


@pytest.fixture(params=kernel_backends())
def backend(request):
    if request.param == "cuda":
        require_cuda_backend()
    return request.param


@pytest.fixture
def dev(backend):
    return "cuda" if HAS_CUDA and backend != "reference" else "cpu"


def test_k_out_of_range(backend, dev):
    logits = torch.randn(4, 3, device=dev)
    for k in (0, -1, 4, 9):
        with pytest.raises(ValueError, match="k must be"):
            ops.topk_gating(logits, k, backend=backend)
    with pytest.raises(ValueError, match="k must be"):
        ops.topk_gating(torch.randn(4, 16, device=dev), 9, backend=backend)  # k above the supported maximum of 8
    for k in (1.5, True):
        with pytest.raises(ValueError, match="k must be"):
            ops.topk_gating(logits, k, backend=backend)


def test_logits_must_be_2d_float(backend, dev):
    with pytest.raises(ValueError, match="2-D"):
        ops.topk_gating(torch.randn(2, 3, 4, device=dev), 1, backend=backend)
    with pytest.raises(ValueError, match="2-D"):
        ops.topk_gating(torch.randn(5, device=dev), 1, backend=backend)
    with pytest.raises(TypeError, match="float"):
        ops.topk_gating(torch.randint(0, 5, (4, 3), device=dev), 1, backend=backend)
    with pytest.raises(TypeError, match="torch.Tensor"):
        ops.topk_gating([[1.0, 2.0]], 1, backend=backend)
    with pytest.raises(ValueError, match="score_func"):
        ops.topk_gating(torch.randn(4, 3, device=dev), 1, score_func="relu", backend=backend)


def test_selection_bias_shape_and_device(backend, dev):
    with pytest.raises(ValueError, match="selection_bias"):
        ops.topk_gating(torch.randn(4, 3, device=dev), 1, selection_bias_E=torch.zeros(4, device=dev),
                        backend=backend)
    with pytest.raises(ValueError, match="different devices"):
        ops.topk_gating(torch.randn(4, 3, device=dev), 1, selection_bias_E=torch.zeros(3, device="meta"),
                        backend=backend)


def test_token_count_mismatch(backend, dev):
    x = torch.randn(5, 8, device=dev)
    slots = torch.zeros(4, 1, dtype=torch.int32, device=dev)
    with pytest.raises(ValueError, match="slots must be"):
        ops.scatter_tokens(x, slots, 4, backend=backend)
    with pytest.raises(ValueError, match="slots must be"):
        ops.gather_tokens(torch.randn(4, 8, device=dev), slots, torch.rand(5, 1, device=dev), backend=backend)
    with pytest.raises(ValueError, match="differ"):
        ops.gather_tokens(torch.randn(4, 8, device=dev), slots, torch.rand(4, 2, device=dev), backend=backend)
    with pytest.raises(ValueError, match="differ"):
        ops.assign_slots(slots, torch.rand(5, 1, device=dev), 2, backend=backend)


def test_slots_and_num_rows(backend, dev):
    x = torch.randn(4, 8, device=dev)
    s = reference.assign_slots(torch.zeros(4, 1, dtype=torch.int32, device=dev), torch.rand(4, 1, device=dev), 2,
                               capacity=3)
    with pytest.raises(ValueError, match="num_rows is required"):
        ops.scatter_tokens(x, s.slots, backend=backend)
    with pytest.raises(ValueError, match="disagrees"):
        ops.scatter_tokens(x, s, 5, backend=backend)
    with pytest.raises(ValueError, match="num_rows"):
        ops.scatter_tokens(x, s.slots, -2, backend=backend)
    with pytest.raises(TypeError, match="num_rows"):
        ops.scatter_tokens(x, s.slots, True, backend=backend)


def test_wrong_dtypes(backend, dev):
    with pytest.raises(TypeError, match="int32 or int64"):
        ops.scatter_tokens(torch.randn(4, 8, device=dev), torch.zeros(4, 1, device=dev), 4, backend=backend)
    with pytest.raises(TypeError, match="float"):
        ops.scatter_tokens(torch.ones(4, 8, dtype=torch.int64, device=dev),
                           torch.zeros(4, 1, dtype=torch.int32, device=dev), 4, backend=backend)
    with pytest.raises(TypeError, match="float"):
        ops.gather_tokens(torch.randn(4, 8, device=dev), torch.zeros(4, 1, dtype=torch.int32, device=dev),
                          torch.ones(4, 1, dtype=torch.int32, device=dev), backend=backend)
    with pytest.raises(TypeError, match="int32 or int64"):
        ops.assign_slots(torch.zeros(4, 1, device=dev), torch.rand(4, 1, device=dev), 2, backend=backend)


def test_tensors_on_different_devices(backend, dev):
    with pytest.raises(ValueError, match="different devices"):
        ops.scatter_tokens(torch.randn(4, 8, device=dev), torch.zeros(4, 1, dtype=torch.int32, device="meta"), 4,
                           backend=backend)
    with pytest.raises(ValueError, match="different devices"):
        ops.gather_tokens(torch.randn(4, 8, device=dev), torch.zeros(4, 1, dtype=torch.int32, device=dev),
                          torch.rand(4, 1, device="meta"), backend=backend)


def test_bad_capacity_arguments(backend, dev):
    for cf in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="capacity_factor"):
            turbomoe.capacity(16, 4, 1, cf)
    ids, scores = torch.zeros(4, 1, dtype=torch.int32, device=dev), torch.rand(4, 1, device=dev)
    with pytest.raises(ValueError, match="capacity"):
        ops.assign_slots(ids, scores, 2, capacity=-1, backend=backend)
    with pytest.raises(ValueError, match="drop_policy"):
        ops.assign_slots(ids, scores, 2, capacity=2, drop_policy="lifo", backend=backend)
    with pytest.raises(ValueError, match="num_experts"):
        ops.assign_slots(ids, scores, 0, backend=backend)


@pytest.mark.parametrize("call,error,match", [
    # Failed before: capacity=True ran as C = 1, num_experts=True as E = 1, renormalize="yes" was taken.
    (lambda ids, sc, lg, b: ops.assign_slots(ids, sc, 2, capacity=True, backend=b), TypeError, "capacity"),
    (lambda ids, sc, lg, b: ops.assign_slots(ids, sc, 2, capacity=2.0, backend=b), TypeError, "capacity"),
    (lambda ids, sc, lg, b: ops.assign_slots(ids, sc, True, backend=b), TypeError, "num_experts"),
    (lambda ids, sc, lg, b: ops.topk_gating(lg, 1, renormalize="yes", backend=b), TypeError, "renormalize"),
    (lambda ids, sc, lg, b: ops.topk_gating(lg, 1, check_finite=1, backend=b), TypeError, "check_finite"),
    (lambda ids, sc, lg, b: ops.gather_tokens(sc, ids, sc, renormalize=1, backend=b), TypeError, "renormalize"),
    # Failed before with an internal TypeError from deep inside the hash (or the kernel launch).
    (lambda ids, sc, lg, b: ops.assign_slots(ids, sc, 2, 2, "rts", seed=1.5, backend=b), TypeError, "seed"),
    (lambda ids, sc, lg, b: ops.assign_slots(ids, sc, 2, 2, "rts", seed=None, backend=b), TypeError, "seed"),
    (lambda ids, sc, lg, b: ops.assign_slots(ids, sc, 2, 2, "rts", seed="7", backend=b), TypeError, "seed"),
])
def test_argument_types(call, error, match, backend, dev):
    """Arguments of the wrong type raise at the call, naming the argument, the same on every backend."""
    ids, scores = torch.zeros(4, 1, dtype=torch.int32, device=dev), torch.rand(4, 1, device=dev)
    with pytest.raises(error, match=match):
        call(ids, scores, torch.randn(4, 3, device=dev), backend)


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        ops.topk_gating(torch.randn(4, 3), 1, backend="cuda-magic")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_logits(bad, backend, dev):
    logits = torch.randn(6, 4, device=dev)
    logits[2, 1] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        ops.topk_gating(logits, 2, check_finite=True, backend=backend)
    # Default, documented behaviour: the row routes nowhere and has no gradient; others are unharmed.
    logits.requires_grad_()
    g = ops.topk_gating(logits, 2, backend=backend)
    assert g.expert_ids[2].tolist() == [-1, -1] and g.scores[2].tolist() == [0.0, 0.0]
    assert torch.isfinite(g.aux_loss) and torch.isfinite(g.z_loss)
    (g.scores.sum() + g.aux_loss + g.z_loss).backward()
    assert torch.isfinite(logits.grad).all() and (logits.grad[2] == 0).all()
    s = ops.assign_slots(g.expert_ids, g.scores, 4, capacity=2, backend=backend)
    assert (s.slots[2] == -1).all()
    out = ops.gather_tokens(torch.randn(s.num_rows, 3, device=dev), s.slots, g.scores, backend=backend)
    assert (out[2] == 0).all() and torch.isfinite(out).all()


def test_out_of_range_expert_ids_route_nowhere(backend, dev):
    """Ids outside [0, E) route nowhere, int64 ones at or above 2**31 too (failed before on Triton:
    the kernels narrowed them to int32, so 2**32 + 1 routed to expert 1)."""
    for dtype in (torch.int32, torch.int64):
        big = [2**31 - 1, -2**31] if dtype == torch.int32 else [2**32 + 1, 2**31, -2**32]
        ids = torch.tensor([[0], [7], [-3], [1], *[[b] for b in big]], dtype=dtype, device=dev)
        for cap in (None, 4):
            s = ops.assign_slots(ids, torch.rand(ids.shape[0], 1, device=dev), 2, cap, backend=backend)
            assert s.slots[:, 0].tolist()[:4] == [0, -1, -1, 1 if cap is None else cap]
            assert (s.slots[4:] == -1).all() and s.kept_counts.tolist() == [1, 1]


def test_bare_slots_out_of_range_route_nowhere(backend, dev):
    """The bare-slots rule (reference.routed_slots): an entry outside [0, num_rows) routes nowhere,
    whatever its width (failed before: the reference raised, Triton dropped int32 ones and wrapped
    int64 2**32 + 1 to row 1)."""
    x = torch.randn(5, 3, device=dev, dtype=torch.float64, requires_grad=True)
    for dtype in (torch.int32, torch.int64):
        far = 2**31 - 1 if dtype == torch.int32 else 2**32 + 1
        slots = torch.tensor([[far], [1], [4], [-5], [0]], dtype=dtype, device=dev)
        buf = ops.scatter_tokens(x, slots, 4, backend=backend)
        assert torch.equal(buf, torch.stack([x[4], x[1], torch.zeros_like(x[0]), torch.zeros_like(x[0])]))
        y = torch.randn(4, 3, device=dev, dtype=torch.float64, requires_grad=True)
        w = torch.rand(5, 1, device=dev, dtype=torch.float64, requires_grad=True)
        out = ops.gather_tokens(y, slots, w, backend=backend)
        assert (out[[0, 2, 3]] == 0).all() and torch.allclose(out[1], w[1] * y[1])
        out.sum().backward()
        assert (w.grad[[0, 2, 3]] == 0).all() and (y.grad[2:] == 0).all()


def test_duplicate_slots_are_rejected_where_checked(backend, dev, monkeypatch):
    """Two routes naming one row break the precondition of a bare table (gather's backward would
    give the row one route's gradient: 1.0 where 6.0 is right); checked where it costs no host sync:
    on the CPU always, on a GPU in debug mode."""
    monkeypatch.setenv("TURBOMOE_DEBUG", "1")
    slots = torch.tensor([[0, 2], [2, -1]], dtype=torch.int32, device=dev)
    with pytest.raises(ValueError, match="same buffer row"):
        ops.gather_tokens(torch.randn(3, 4, device=dev), slots, torch.rand(2, 2, device=dev), backend=backend)
    with pytest.raises(ValueError, match="same buffer row"):
        ops.scatter_tokens(torch.randn(2, 4, device=dev), slots, 3, backend=backend)
    # Entries that route nowhere share no row, whatever their value.
    nowhere = torch.tensor([[0, 2**32 + 1], [2**32 + 1, 5]], device=dev)
    assert (ops.scatter_tokens(torch.ones(2, 4, device=dev), nowhere, 3, backend=backend)[1:] == 0).all()
