"""Review of README.md's "Edge inputs and errors" table and the paragraph after it (2026-12), row by
row, on the reference backend and on the Triton kernels, forward and backward: the two must agree on
each edge input (values, errors, NaN / Inf handling, gradients of dropped and unrouted routes).

Triton cases run on a GPU, or on the CPU under TRITON_INTERPRET=1 (scripts/test.sh runs *_triton.py
so); without either only the reference cases run and the Triton ones skip. Its fault, fixed 2026-12-06:
with zero-width rows (M = 0) the kernels' early exit zeroed the score gradient where the reference's
renormalised sum made it NaN (a NaN or Inf kept score): test_renormalize_non_finite_kept_score_zero_width_tokens.
"""
import os

import pytest
import torch

import turbomoe
from conftest import HAS_CUDA
from turbomoe import ops
from turbomoe.autograd.grouped_gemm import grouped_mm
from turbomoe.nn import MoELayer

HAS_TRITON = HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if HAS_CUDA else "cpu"
NAN, INF = float("nan"), float("inf")
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton kernels need a GPU, or TRITON_INTERPRET=1 on the CPU")
BACKENDS = ["reference", pytest.param("triton", marks=needs_triton)]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _gmm(backend):
    return "triton" if backend == "triton" else "reference"


def _same(a, b, tol=1e-5):
    """Equal up to fp32 rounding, NaN where NaN, Inf where Inf."""
    torch.testing.assert_close(a.double().cpu(), b.double().cpu(), rtol=tol, atol=tol, equal_nan=True)


def _gather(backend, y, slots, scores, renormalize, grad_out):
    ya = y.clone().requires_grad_()
    sa = None if scores is None else scores.clone().requires_grad_()
    out = ops.gather_tokens(ya, slots, sa, renormalize=renormalize, backend=backend)
    out.backward(grad_out)
    return out.detach(), ya.grad, None if sa is None else sa.grad


# ---------------------------------------------------------------------------------------------------
# Row "NaN among a token's kept scores, renormalize=True": the sum stays NaN, the token's weights,
# output and gradients are NaN. FAILS on Triton for zero-width tokens (M = 0): push_rows returns
# early with dscores zeroed, so the NaN token's score gradients are 0 where the reference's are NaN.
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [NAN, INF])
@pytest.mark.parametrize("backend", BACKENDS)
def test_renormalize_non_finite_kept_score_zero_width_tokens(bad, backend):
    slots = torch.tensor([[0, 1], [2, -1], [3, 4]], dtype=torch.int32, device=DEV)
    scores = torch.rand(3, 2, generator=_gen(11)).to(DEV)
    scores[0, 0] = bad  # token 0: both routes kept, sum non-finite
    y = torch.zeros(5, 0, device=DEV)
    got = _gather(backend, y, slots, scores, True, torch.zeros(3, 0, device=DEV))
    want = _gather("reference", y, slots, scores, True, torch.zeros(3, 0, device=DEV))
    assert got[0].shape == (3, 0)
    # The reference: NaN gradients for token 0's kept scores (0 / NaN), the other tokens' 0.
    assert torch.isnan(want[2][0]).all() and (want[2][1:] == 0).all()
    _same(got[2], want[2])


# ---------------------------------------------------------------------------------------------------
# Passing checks of the other rows, both backends, forward and backward.
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_no_tokens_every_op_forward_and_backward(backend):
    """S = 0: empty tables through assign_slots (every policy, dropless and C = 0 / 3, int64 ids),
    scatter, gather (renormalize too), row_scores, sample_second_expert, the grouped GEMM; empty
    gradients, zero losses."""
    logits = torch.zeros(0, 4, device=DEV, requires_grad=True)
    g1 = ops.topk_gating(logits, 1, check_finite=True, backend=backend)
    g = ops.sample_second_expert(logits, g1, backend=backend)
    assert g.expert_ids.shape == (0, 2) and g.counts.tolist() == [0] * 4 and g.aux_loss.item() == 0.0
    (g.scores.sum() + g.aux_loss + g.z_loss).backward()
    assert logits.grad.shape == (0, 4)
    x = torch.zeros(0, 3, device=DEV, requires_grad=True)
    scores = torch.zeros(0, 2, device=DEV, requires_grad=True)
    for cap in (None, 0, 3):
        for policy in ("position", "rts", "probs"):
            s = ops.assign_slots(torch.zeros(0, 2, dtype=torch.int64, device=DEV), scores, 4, cap, policy,
                                 backend=backend)
            assert s.slots.shape == (0, 2) and s.kept_counts.tolist() == [0] * 4
            assert s.num_rows == (0 if cap is None else 4 * cap)
        buf = ops.scatter_tokens(x, s, backend=backend)
        assert buf.shape == (s.num_rows, 3) and (buf == 0).all()
        w = ops.row_scores(s, scores, backend=backend)
        assert w.shape == (s.num_rows, ) and (w == 0).all()
        out = ops.gather_tokens(buf * 2, s, scores, renormalize=True, backend=backend)
        assert out.shape == (0, 3)
        (out.sum() + buf.sum() + w.sum()).backward()
    assert x.grad.shape == (0, 3) and scores.grad.shape == (0, 2)
    w_GKN = torch.randn(3, 3, 5, generator=_gen(0)).to(DEV).requires_grad_()
    y = grouped_mm(x.detach(), w_GKN, torch.zeros(3, dtype=torch.int32, device=DEV), backend=_gmm(backend))
    y.sum().backward()
    assert y.shape == (0, 5) and (w_GKN.grad == 0).all()


@pytest.mark.parametrize("kw", [dict(), dict(capacity_factor=1.0, renormalize=True, drop_policy="probs"),
                                dict(activation="gelu", bias=True, shared_ffn_hidden_size=8)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_no_tokens_backward(kw, backend):
    """MoELayer on S = 0: an empty output, a zero loss, and a backward with zero parameter gradients,
    on the Triton ops and grouped GEMM too (tests/test_robustness_triton.py ran the forward only)."""
    torch.manual_seed(0)
    layer = MoELayer(8, 12, 4, 2, z_loss_coef=0.1, backend=backend, gmm_backend=_gmm(backend), device=DEV, **kw)
    x = torch.randn(2, 0, 8, device=DEV, requires_grad=True)
    out, loss = layer(x)
    assert out.shape == (2, 0, 8) and loss.item() == 0.0
    (out.sum() + loss).backward()
    assert all(p.grad is None or (p.grad == 0).all() for p in layer.parameters())


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@needs_triton
def test_non_finite_logit_rows_every_option(score_func, renormalize, dtype):
    """A row holding NaN, +Inf or -Inf routes nowhere (ids -1, scores 0, zero gradient) with a
    selection bias, renormalize and sigmoid too; the other rows, counts, aux and z and every gradient
    agree between the backends."""
    logits = torch.randn(6, 5, generator=_gen(1), dtype=dtype).to(DEV)
    logits[1, 2], logits[3, :], logits[4, 0] = NAN, INF, -INF
    bias = (torch.randn(5, generator=_gen(2)) * 0.1).to(DEV)
    grad_scores = torch.randn(6, 3, generator=_gen(3), dtype=dtype).to(DEV)
    res = {}
    for b in ("reference", "triton"):
        la = logits.clone().requires_grad_()
        g = ops.topk_gating(la, 3, score_func, renormalize, bias, backend=b)
        ((g.scores * grad_scores).sum() + g.aux_loss + 0.1 * g.z_loss).backward()
        assert (g.expert_ids[[1, 3, 4]] == -1).all() and (g.scores[[1, 3, 4]] == 0).all()
        assert (la.grad[[1, 3, 4]] == 0).all() and torch.isfinite(la.grad).all()
        res[b] = (g.expert_ids, g.scores.detach(), g.counts, g.aux_loss.detach(), g.z_loss.detach(), la.grad)
    assert torch.equal(res["triton"][0], res["reference"][0]) and torch.equal(res["triton"][2], res["reference"][2])
    for a, c in zip(res["triton"][3:], res["reference"][3:]):
        _same(a, c)
    _same(res["triton"][1], res["reference"][1])


@needs_triton
def test_equal_selection_values_go_to_the_lower_id():
    """Equal selection values (equal logits, saturated sigmoids, a huge bias that absorbs the
    probabilities, +0.0 / -0.0 biases): the lower expert id first, on both backends."""
    cases = [torch.zeros(2, 10), torch.tensor([[100., 60, 50, 40, 30, 20, 19, 18, 17, 16]]),
             torch.tensor([[0.0, -0.0] * 5])]
    biases = [None, torch.tensor([-0.0, 0.0] * 5), torch.full((10, ), 1e30),
              torch.tensor([5.0, 5.0, 0, 0, 0, 5.0, 0, 0, 0, 5.0])]
    for logits in cases:
        for bias in biases:
            for sf in ("softmax", "sigmoid"):
                for k in (1, 3, 8):
                    b = None if bias is None else bias.to(DEV)
                    r = ops.topk_gating(logits.to(DEV), k, sf, selection_bias_E=b, backend="reference")
                    t = ops.topk_gating(logits.to(DEV), k, sf, selection_bias_E=b, backend="triton")
                    assert torch.equal(r.expert_ids, t.expert_ids), (logits, bias, sf, k)
    # Spelled out: all equal -> 0, 1, 2; a bias of 1e30 absorbs every probability -> 0, 1, 2 too.
    for bias in (None, torch.full((10, ), 1e30, device=DEV)):
        t = ops.topk_gating(torch.randn(3, 10, generator=_gen(4)).to(DEV) * (bias is not None), 3,
                            selection_bias_E=bias, backend="triton")
        assert (t.expert_ids == torch.tensor([0, 1, 2], dtype=torch.int32, device=DEV)).all()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@needs_triton
def test_out_of_range_ids_every_policy(dtype):
    """Ids outside [0, E) (E itself, negatives, int64 at or above 2**31) route nowhere under rts and
    probs (NaN scores among them) as under position and dropless: the same slots on both backends."""
    big = [2**31 - 1, -2**31] if dtype == torch.int32 else [2**32 + 1, 2**31, -2**32]
    ids = torch.tensor([[0, 3], [-3, 1], *[[b, 0] for b in big], [1, 2], [2, 1]], dtype=dtype, device=DEV)
    scores = torch.rand(ids.shape, generator=_gen(5)).to(DEV)
    scores[0, 1], scores[2, 0], scores[-1, 1] = NAN, NAN, NAN
    for policy in ("rts", "probs", "position"):
        for cap in (None, 0, 1, 2, 5):
            r = ops.assign_slots(ids, scores, 3, cap, policy, 7, backend="reference")
            t = ops.assign_slots(ids, scores, 3, cap, policy, 7, backend="triton")
            assert torch.equal(r.slots, t.slots) and torch.equal(r.kept_counts, t.kept_counts), (policy, cap)
            assert (t.slots[0, 1] == -1) and (t.slots[1, 0] == -1) and (t.slots[2:2 + len(big), 0] == -1).all()


def _finite_and_agreeing(y, slots, scores, renorm, grad_out):
    """gather on Triton and on the reference: every output and gradient finite and the same; Triton's."""
    got = _gather("triton", y, slots, scores, renorm, grad_out)
    for a, c in zip(got, _gather("reference", y, slots, scores, renorm, grad_out)):
        assert torch.isfinite(a).all()
        _same(a, c)
    return got


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
@needs_triton
def test_bare_slots_out_of_range_non_finite_scores_add_nothing(dtype, bad):
    """A bare slots entry outside [0, num_rows) adds nothing whatever its score, NaN or +-Inf: output,
    y's gradient and the score's gradient finite (0 for that route), with and without renormalize,
    and the same on both backends; scatter writes nothing there."""
    far = 2**31 - 1 if dtype == torch.int32 else 2**32 + 1
    slots = torch.tensor([[far, 1], [0, -1], [-7, 3], [2, far]], dtype=dtype, device=DEV)
    scores = torch.rand(4, 2, generator=_gen(6)).to(DEV)
    scores[0, 0] = scores[1, 1] = scores[2, 0] = scores[3, 1] = bad
    y = torch.randn(4, 3, generator=_gen(7)).to(DEV)
    grad_out = torch.randn(4, 3, generator=_gen(8)).to(DEV)
    for renorm in (False, True):
        got = _finite_and_agreeing(y, slots, scores, renorm, grad_out)
        assert (got[2][[0, 1, 2, 3], [0, 1, 0, 1]] == 0).all()
    x = torch.randn(4, 3, generator=_gen(9)).to(DEV)
    bufs = [ops.scatter_tokens(x, slots, 4, backend=b) for b in ("triton", "reference")]
    assert torch.equal(bufs[0], bufs[1]) and torch.equal(bufs[0], torch.stack([x[1], x[0], x[3], x[2]]))


@pytest.mark.parametrize("bad", [NAN, INF])
@needs_triton
def test_dropped_routes_of_slots_non_finite_scores_add_nothing(bad):
    """Routes assign_slots dropped (slot -1) add nothing and take no gradient whatever their score."""
    ids = torch.tensor([[0, 1], [0, 1], [0, 2], [1, 0]], dtype=torch.int32, device=DEV)
    s = ops.assign_slots(ids, torch.rand(4, 2, device=DEV), 3, 1)
    assert (s.slots < 0).sum() == 5
    scores = torch.rand(4, 2, generator=_gen(10)).to(DEV)
    scores[s.slots < 0] = bad
    y = torch.randn(3, 3, generator=_gen(11)).to(DEV)
    grad_out = torch.randn(4, 3, generator=_gen(12)).to(DEV)
    for renorm in (False, True):
        got = _finite_and_agreeing(y, s, scores, renorm, grad_out)
        assert (got[2][s.slots < 0] == 0).all() and (got[0][1] == 0).all()


@pytest.mark.parametrize("bad", [NAN, INF])
@needs_triton
def test_non_finite_kept_score_renormalize(bad):
    """NaN among a token's kept scores with renormalize: that token's output, its rows' gradients and
    its kept scores' gradients NaN, on both backends alike; other tokens finite. (A dropped route of
    such a token still gets gradient 0, on both; an Inf kept score, not a row of the table, gives the
    Inf route weight NaN and the others 0, on both.)"""
    slots = torch.tensor([[0, 1], [2, 3], [4, -1], [5, 6]], dtype=torch.int32, device=DEV)
    scores = torch.rand(4, 2, generator=_gen(13)).to(DEV)
    scores[1, 0] = scores[2, 0] = bad
    y = torch.randn(7, 3, generator=_gen(14)).to(DEV)
    grad_out = torch.randn(4, 3, generator=_gen(15)).to(DEV)
    got = _gather("triton", y, slots, scores, True, grad_out)
    want = _gather("reference", y, slots, scores, True, grad_out)
    for a, c in zip(got, want):
        _same(a, c)
    out, gy, gs = got
    assert torch.isnan(out[1:3]).all() and torch.isfinite(out[[0, 3]]).all()
    # NaN: every weight of the token NaN. Inf: the Inf route's weight Inf / Inf = NaN, the other's x / Inf = 0.
    assert torch.isnan(gy[[2, 4]]).all() and torch.isnan(gy[3]).all() == (bad != INF)
    assert torch.isfinite(gy[[0, 1, 5, 6]]).all()
    assert torch.isnan(gs[1]).all() and torch.isnan(gs[2, 0]) and gs[2, 1] == 0
    assert torch.isfinite(gs[[0, 3]]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_argument_paragraph(backend):
    """The argument errors the paragraph names, where test_errors.py leaves them out: capacity with an
    infinite factor or num_experts=True, and MoELayer's on a Triton-backed layer as well."""
    with pytest.raises(ValueError, match="capacity_factor"):
        turbomoe.capacity(16, 4, 1, float("inf"))
    with pytest.raises(TypeError, match="num_experts"):
        turbomoe.capacity(16, True, 1, 1.0)
    for kw, error, match in ((dict(hidden_size=0), ValueError, "hidden_size"),
                             (dict(min_capacity=-3), ValueError, "min_capacity"),
                             (dict(renormalize="yes"), TypeError, "renormalize"),
                             (dict(seed="7"), TypeError, "seed")):
        args = dict(dict(hidden_size=8, ffn_hidden_size=8, num_experts=4, k=2, backend=backend,
                         gmm_backend=_gmm(backend)), **kw)
        with pytest.raises(error, match=match):
            MoELayer(**args)


@pytest.mark.parametrize("backend", BACKENDS)
def test_double_backward_grouped_gemm_and_layer(backend):
    """A double backward through the kernels' backward raises (the grouped GEMM's and a whole
    MoELayer's too); the reference differentiates twice."""
    x = torch.randn(5, 4, generator=_gen(16)).to(DEV).requires_grad_()
    w = torch.randn(2, 4, 3, generator=_gen(17)).to(DEV).requires_grad_()
    y = grouped_mm(x, w, torch.tensor([2, 3], dtype=torch.int32, device=DEV), backend=_gmm(backend))
    (gx, ) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    torch.manual_seed(0)
    layer = MoELayer(8, 12, 4, 2, capacity_factor=1.0, renormalize=True, backend=backend,
                     gmm_backend=_gmm(backend), device=DEV)
    xl = torch.randn(6, 8, generator=_gen(18)).to(DEV).requires_grad_()
    out, loss = layer(xl)
    (gxl, ) = torch.autograd.grad(out.square().sum() + loss, xl, create_graph=True)
    if backend == "triton":
        for g in (gx, gxl):
            with pytest.raises(RuntimeError, match="differentiate twice"):
                g.square().sum().backward()
    else:
        gx.square().sum().backward()
        gxl.square().sum().backward()
        assert torch.isfinite(w.grad).all() and (w.grad != 0).any()
        assert all(torch.isfinite(p.grad).all() for p in layer.parameters())


def test_reference_differentiates_twice_through_renormalize():
    """The reference's second derivatives, through renormalised gating (its custom gradient path) and
    renormalised gather, pass gradgradcheck."""
    logits = torch.randn(4, 5, dtype=torch.float64, generator=_gen(19), requires_grad=True)
    for sf in ("softmax", "sigmoid"):
        assert torch.autograd.gradgradcheck(
            lambda lg: ops.topk_gating(lg, 2, sf, True, backend="reference")[1:5:2], (logits, ))
    slots = torch.tensor([[0, 1], [2, -1], [3, 4]], dtype=torch.int32)
    y = torch.randn(5, 3, dtype=torch.float64, generator=_gen(20), requires_grad=True)
    sc = torch.rand(3, 2, dtype=torch.float64, generator=_gen(21), requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda a, b: ops.gather_tokens(a, slots, b, True, backend="reference"), (y, sc))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@needs_triton
def test_probs_policy_nan_and_signed_zero_in_every_score_dtype(dtype):
    """probs: a NaN score ranks as -inf and -0.0 as +0.0 in every score dtype (ranked in fp32:
    fp64 values that round to one fp32 tie, tiny ones flush to a signed zero), the same slots on both
    backends."""
    scores = torch.tensor([NAN, -0.0, 0.0, -0.0, 0.5, NAN, -INF, 0.0, 0.25, -1.0, NAN, 0.0, 1e-30, -1e-30,
                           1e-45, 3e-39], dtype=torch.float64)
    ids = torch.tensor([0, 0, 0, 1, 0, 1, 1, 1, 2, 2, 2, 2, 0, 0, 1, 1], dtype=torch.int32, device=DEV)[:, None]
    for C in (1, 2, 3, 4, 6):
        sc = scores.to(dtype).to(DEV)[:, None]
        r = ops.assign_slots(ids, sc, 3, C, "probs", backend="reference")
        t = ops.assign_slots(ids, sc, 3, C, "probs", backend="triton")
        assert torch.equal(r.slots, t.slots) and torch.equal(r.kept_counts, t.kept_counts), (dtype, C)
