"""The kernel backends (Triton, and CUDA C++ on a GPU) against the reference evaluated in
float64, forward and backward.

Runs natively on a GPU, where every test runs once per backend. On the CPU it runs the Triton
kernels under TRITON_INTERPRET=1 (CI does this in its own process, since the variable is read when
kernels are decorated), where the largest cases are left to the GPU because the interpreter is slow.
"""
import os

import pytest
import torch

from conftest import HAS_CUDA, assert_uniform, rel_err, require_cuda_backend, rts_keep_frequencies

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not HAS_CUDA and not INTERPRET:
    pytest.skip("Triton kernels need a GPU, or TRITON_INTERPRET=1 on the CPU (as CI runs this file)",
                allow_module_level=True)

from turbomoe import csrc, ops  # noqa: E402  (after the TRITON_INTERPRET check)
from turbomoe import reference as ref  # noqa: E402
from turbomoe.autograd.gather import GatherTokens  # noqa: E402
from turbomoe.autograd.gating import TopKGating  # noqa: E402
from turbomoe.autograd.scatter import ScatterTokens  # noqa: E402

DEV = "cuda" if HAS_CUDA else "cpu"
KERNEL_BACKENDS = (["triton", pytest.param("cuda", marks=pytest.mark.gpu)] if HAS_CUDA else ["triton"])
TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float64: 1e-12}
DTYPES = [torch.float32, torch.bfloat16]
SEK = [(S, E, k) for S in (1, 7, 128, 1000) for E in (1, 2, 8, 64, 128) for k in (1, 2, 4, 8) if k <= E]
INTERPRETER_BUDGET = 300_000  # elements a case may move under the interpreter


@pytest.fixture(params=KERNEL_BACKENDS)
def backend(request):
    if request.param == "cuda":
        require_cuda_backend()
    return request.param


@pytest.fixture(params=["reference"] + KERNEL_BACKENDS)
def any_backend(request):
    """The kernel backends and the reference: for tests against an op's own definition (not the
    reference), which the reference backend must meet too."""
    if request.param == "cuda":
        require_cuda_backend()
    return request.param


def interpreter_limit(elements: int):
    if INTERPRET and not HAS_CUDA and elements > INTERPRETER_BUDGET:
        pytest.skip("large case: runs on the GPU, too slow for the CPU interpreter")


def make_logits(S, E, dtype):
    """Fresh normal logits on a 2**-12 grid: distinct values stay distinct in fp32 softmax, so the
    top-k choice cannot flip between the fp32 kernel and the fp64 reference; equal values tie
    and both sides give the tie to the lower expert."""
    x = torch.round(torch.randn(S, E, device=DEV) * 4096) / 4096
    return x.to(dtype)


def routing(S, E, k, kind="random"):
    """expert_ids [S, k] int32 and scores for slot and row tests, on DEV."""
    if kind == "hot":  # every token's first choice is expert 0
        logits = torch.randn(S, E, device=DEV)
        logits[:, 0] += 100
    else:
        logits = torch.randn(S, E, device=DEV)
    g = ref.topk_gating(logits, k)
    return g.expert_ids, g.scores


def assert_near_tie(got_ids, want_ids, logits, score_func, bias_E):
    """The rows where the kernel chose other experts than the reference choose values that agree
    with the reference's to within fp32 rounding (so the top-k sets are equally valid)."""
    probs = torch.softmax(logits, 1) if score_func == "softmax" else torch.sigmoid(logits)
    sel = probs + bias_E
    rows = (got_ids != want_ids).any(dim=1)
    got_v = sel[rows].gather(1, got_ids[rows].long()).sort(dim=1).values
    want_v = sel[rows].gather(1, want_ids[rows].long()).sort(dim=1).values
    assert torch.allclose(got_v, want_v, rtol=0, atol=1e-6), (got_v, want_v)


# Beyond SEK: the cuda kernels' thread-a-row forms (E <= 8: 8 columns, E <= 16: 16), the warp's from
# 17 experts, and more rows than 512 blocks of 256 take at once (a thread then owns several rows).
GATING_SEK = SEK + [(300, 13, 3), (1000, 16, 8), (1000, 17, 2), (140_000, 16, 2), (140_000, 7, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("S,E,k", GATING_SEK)
def test_gating_matches_reference(S, E, k, dtype, backend):
    interpreter_limit(S * E * 4)
    for score_func, renorm, bias in (("softmax", False, False), ("softmax", True, False), ("sigmoid", True, True)):
        logits = make_logits(S, E, dtype)
        bias_E = torch.rand(E, device=DEV) * 0.1 if bias else None
        la = logits.clone().requires_grad_()
        lb = logits.double().requires_grad_()
        got = ops.topk_gating(la, k, score_func, renorm, bias_E, backend=backend)
        want = ref.topk_gating(lb, k, score_func, renorm, None if bias_E is None else bias_E.double())
        if bias_E is not None and not torch.equal(got.expert_ids, want.expert_ids):
            # probs + a continuous bias can tie to within fp32 rounding: either choice is right
            # there. Every differing row must be such a tie; the rest of this case then compares
            # losses and gradients of two different routings, so it stops here.
            assert_near_tie(got.expert_ids, want.expert_ids, lb.detach(), score_func, bias_E.double())
            continue
        assert torch.equal(got.expert_ids, want.expert_ids)
        assert torch.equal(got.counts, want.counts)
        assert got.scores.dtype == torch.float32 and got.expert_ids.dtype == torch.int32
        assert rel_err(got.scores, want.scores) < 1e-5
        assert abs(got.aux_loss.item() - want.aux_loss.item()) <= 1e-5 * max(1.0, abs(want.aux_loss.item()))
        assert abs(got.z_loss.item() - want.z_loss.item()) <= 1e-5 * max(1.0, abs(want.z_loss.item()))
        w = torch.randn(S, k, device=DEV, dtype=torch.float64)
        a, b = torch.rand(2).tolist()
        ((got.scores.double() * w).sum() + a * got.aux_loss + b * got.z_loss).backward()
        ((want.scores * w).sum() + a * want.aux_loss + b * want.z_loss).backward()
        assert la.grad.dtype == dtype
        assert rel_err(la.grad, lb.grad) < TOL[dtype], (score_func, renorm)


CAPACITIES = ("dropless", "tight", "one", "zero")


def capacity_of(name, S, E, k):
    return {"dropless": None, "tight": ref.capacity(S, E, k, 1.0), "one": 1, "zero": 0}[name]


@pytest.mark.parametrize("kind", ["random", "hot"])
@pytest.mark.parametrize("cap", CAPACITIES)
@pytest.mark.parametrize("S,E,k", SEK)
def test_slots_match_reference(S, E, k, cap, kind, backend):
    interpreter_limit(S * k * E * 8)
    ids, scores = routing(S, E, k, kind)
    ids[S // 2, 0] = -1  # a token with no route
    C = capacity_of(cap, S, E, k)
    for policy in ("position", "rts", "probs") if C is not None else ("position", ):
        got = ops.assign_slots(ids, scores, E, C, policy, seed=S + E, backend=backend)
        want = ref.assign_slots(ids, scores, E, C, policy, seed=S + E)
        assert torch.equal(got.slots, want.slots), policy
        assert torch.equal(got.kept_counts, want.kept_counts)
        assert got.num_rows == want.num_rows
        if C is not None:
            assert int(got.kept_counts.max()) <= C


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [3, 8, 96, 1024])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("S", [1, 7, 128, 1000])
@pytest.mark.parametrize("cap,renorm", [("dropless", False), ("tight", False), ("tight", True)])
def test_scatter_gather_match_reference(S, k, M, dtype, cap, renorm, backend):
    """renorm: gather weighs by the kept scores renormalised (DeepSpeed's top-k combine). M = 3: rows
    too narrow for a warp a token (the cuda push kernel's thread-a-token form)."""
    interpreter_limit(S * k * M)
    E = 8
    ids, scores = routing(S, E, k)
    C = capacity_of(cap, S, E, k)
    s = ref.assign_slots(ids, scores, E, C, "position")
    x = torch.randn(S, M, device=DEV).to(dtype)
    xa, xb = x.clone().requires_grad_(), x.double().requires_grad_()
    buf_a = ops.scatter_tokens(xa, s, backend=backend)
    buf_b = ref.scatter_tokens(xb, s.slots, s.num_rows)
    assert torch.equal(buf_a.double(), buf_b)  # a copy: exact, empty rows zero
    # Bare slots find the empty rows through the inverse table instead of the kept counts.
    assert torch.equal(ops.scatter_tokens(x, s.slots, s.num_rows, backend=backend), buf_a)
    y = torch.randn(s.num_rows, M, device=DEV).to(dtype)
    ya, yb = y.clone().requires_grad_(), y.double().requires_grad_()
    sa, sb = scores.clone().requires_grad_(), scores.double().requires_grad_()
    out_a = ops.gather_tokens(ya, s, sa, renormalize=renorm, backend=backend)
    out_b = ref.gather_tokens(yb, s.slots, sb, renormalize=renorm)
    assert out_a.dtype == dtype and rel_err(out_a, out_b) < TOL[dtype]
    g_out = torch.randn(S, M, device=DEV).to(dtype)
    g_buf = torch.randn(s.num_rows, M, device=DEV).to(dtype)
    out_a.backward(g_out)
    out_b.backward(g_out.double())
    buf_a.backward(g_buf)
    buf_b.backward(g_buf.double())
    assert rel_err(ya.grad, yb.grad) < TOL[dtype]
    # A score's gradient is a dot product over M of O(1) terms, rounded at their scale: where they
    # cancel to a small sum (S = 1: one value) its own relative error can pass the bound (2.07e-5
    # at M = 96, fp32, seen once), so it is measured against 1. Renormalised, a token with one kept
    # route has weight 1 whatever its score: a zero gradient that fp64 rounds to ~1e-16.
    assert rel_err(sa.grad, sb.grad, floor=1.0) < TOL[dtype]
    assert rel_err(xa.grad, xb.grad) < TOL[dtype]
    dropped_rows = torch.ones(s.num_rows, dtype=torch.bool, device=DEV)
    dropped_rows[s.slots[s.slots >= 0].long()] = False
    assert (ya.grad[dropped_rows] == 0).all()


def test_gradcheck_autograd_functions(backend):
    impl = ops._impl(backend)
    torch.manual_seed(0)
    logits = make_logits(6, 5, torch.float64).requires_grad_()
    for score_func, renorm in (("softmax", False), ("softmax", True), ("sigmoid", True)):
        def gating(l):
            ids, scores, counts, aux, z = TopKGating.apply(l, 3, score_func, renorm, None, impl)[:5]
            return scores, aux, z
        assert torch.autograd.gradcheck(gating, (logits, ), eps=1e-7, atol=1e-8)
    ids, scores = routing(6, 4, 2)
    s = ref.assign_slots(ids, scores, 4, 2, "position")
    x = torch.randn(6, 5, device=DEV, dtype=torch.float64, requires_grad=True)
    for kept, cap in ((s.kept_counts, s.capacity), (None, None)):  # empty rows from counts, or from slots
        assert torch.autograd.gradcheck(lambda t: ScatterTokens.apply(t, s.slots, s.num_rows, kept, cap, impl)[0],
                                        (x, ))
    y = torch.randn(s.num_rows, 5, device=DEV, dtype=torch.float64, requires_grad=True)
    sc = scores.double().requires_grad_()
    assert (s.slots < 0).any()  # 12 routes into 4 * 2 rows: drops
    for kept, cap, renorm in ((s.kept_counts, s.capacity, False), (None, None, False), (s.kept_counts, s.capacity, True)):
        assert torch.autograd.gradcheck(
            lambda a, b: GatherTokens.apply(a, s.slots, b, kept, cap, impl, renorm)[0], (y, sc))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gather_renormalize_tiny_and_dropped(dtype, backend):
    """Renormalised weights where a token's kept scores sum below eps (the sum is clamped: weights
    p / eps, no cross terms) or nothing is kept (no weight, no gradient): values and gradients
    equal the reference's autograd."""
    eps = torch.finfo(dtype).eps
    slots = torch.tensor([[0, 1], [2, -1], [-1, -1], [3, 4], [5, 6]], dtype=torch.int32, device=DEV)
    scores = torch.tensor([[0.7, 0.2], [0.3, 0.5], [0.4, 0.6], [eps / 8, eps / 4], [0.5, 0.5]], dtype=dtype,
                          device=DEV)
    y = torch.randn(7, 16, device=DEV, dtype=dtype)
    g = torch.randn(5, 16, device=DEV, dtype=dtype)
    ya, sa = y.clone().requires_grad_(), scores.clone().requires_grad_()
    yb, sb = y.double().requires_grad_(), scores.double().requires_grad_()
    out_a = ops.gather_tokens(ya, slots, sa, renormalize=True, backend=backend)
    # The reference in the same dtype, so that its eps clamps the same token.
    out_b = ref.gather_tokens(yb.to(dtype), slots, sb.to(dtype), renormalize=True)
    out_a.backward(g)
    out_b.backward(g)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert rel_err(out_a, out_b) < tol and rel_err(ya.grad, yb.grad) < tol and rel_err(sa.grad, sb.grad) < tol
    assert (out_a[2] == 0).all() and (sa.grad[2] == 0).all() and sa.grad[1, 1] == 0


def moe_step(logits, x, k, C, backend, seed=0):
    """Gating -> slots -> scatter -> a stand-in expert -> gather, forward and backward."""
    E = logits.shape[1]
    la, xa = logits.clone().requires_grad_(), x.clone().requires_grad_()
    g = ops.topk_gating(la, k, renormalize=True, backend=backend)
    s = ops.assign_slots(g.expert_ids, g.scores, E, C, "rts", seed, backend=backend)
    buf = ops.scatter_tokens(xa, s, backend=backend)
    out = ops.gather_tokens(torch.tanh(buf) * 2, s, g.scores, backend=backend)
    (out.float().square().sum() + g.aux_loss + g.z_loss).backward()
    return out, la.grad, xa.grad, s.slots


@pytest.mark.parametrize("case", ["one_hot_expert", "S_below_E", "S_is_1", "far_over_capacity", "empty_experts"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_edge_cases_finite(case, dtype, backend):
    S, E, k, C, M = {"one_hot_expert": (64, 8, 2, 20, 32), "S_below_E": (3, 64, 2, 1, 32),
                     "S_is_1": (1, 8, 2, 1, 32), "far_over_capacity": (200, 4, 1, 2, 32),
                     "empty_experts": (16, 128, 1, 4, 32)}[case]
    """The kernels against the reference in float64 on each edge case: the same slots, and the
    output and gradients within the dtype's tolerance (before, only finiteness was checked)."""
    logits = make_logits(S, E, dtype)
    if case in ("one_hot_expert", "far_over_capacity"):
        logits[:, 0] = 30
    for cap in (C, None):
        x = torch.randn(S, M, device=DEV).to(dtype)
        got = moe_step(logits, x, k, cap, backend)
        want = moe_step(logits.double(), x.double(), k, cap, "reference")
        assert torch.equal(got[3], want[3])
        for name, a, b in zip(("out", "grad logits", "grad x"), got[:3], want[:3]):
            # fp32 kernels against fp64: 2.4e-5 seen on an H100 for grad logits at E = 128
            assert rel_err(a, b) < (1e-4 if dtype == torch.float32 else 1e-2), (name, rel_err(a, b))
        if cap is not None:
            kept = got[3][got[3] >= 0]
            assert kept.numel() <= E * cap


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_renormalize_subnormal_chosen_sum(dtype, backend):
    """A selection bias steers the choice onto experts whose probabilities underflow (their sum below
    the dtype's smallest normal, or 0): every backend divides by the sum where it is > 0 (by 1 where it
    is 0) and takes the gradient through the chosen logits, finite. The reference clamped the sum at
    the smallest normal (scores 3.2e-6 where the kernels gave 0.5), and autograd through r / D
    overflowed once it no longer did."""
    big = 100.0 if dtype == torch.float32 else 720.0  # exp(-big): subnormal
    logits = torch.tensor([[big, 0.0, 0.0], [big, 0.0, 0.5], [2 * big, 0.0, 0.0], [0.3, -0.2, 0.1]], dtype=dtype)
    bias = torch.tensor([-2.0, 0.0, 0.0], dtype=dtype)
    grad_scores = torch.tensor([[1.0, 0.0], [0.3, -0.7], [1.0, 2.0], [0.5, 0.25]], dtype=dtype)
    out = {}
    for b in (backend, "reference"):
        # copy=True: on the CPU .to(DEV) is logits itself, and the two backends' gradients would
        # accumulate into one .grad tensor, compared with itself
        la = logits.to(DEV, copy=True).requires_grad_()
        g = ops.topk_gating(la, 2, "softmax", True, bias.to(DEV), backend=b)
        (g.scores * grad_scores.to(DEV)).sum().backward()
        out[b] = (g.expert_ids.cpu(), g.scores.detach().cpu(), la.grad.cpu())
    (ids, scores, grad), (ids_r, scores_r, grad_r) = out[backend], out["reference"]
    assert torch.equal(ids, ids_r) and ids[:3].tolist() == [[1, 2], [2, 1], [1, 2]]
    assert torch.isfinite(grad).all() and torch.isfinite(grad_r).all()
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(scores, scores_r, **tol)
    # fp32 probabilities near 1e-44 hold a few bits: the kernels' gradient, from r / D, and the
    # reference's, from the chosen logits, differ by up to 0.3% there (H200, 2026-11-29)
    torch.testing.assert_close(grad, grad_r, **(dict(rtol=1e-2, atol=1e-3) if dtype == torch.float32 else tol))
    assert torch.allclose(scores[0], torch.tensor([0.5, 0.5], dtype=dtype))  # exp(-big) / (2 exp(-big))
    assert torch.equal(scores[2], torch.zeros(2, dtype=dtype))  # exp(-2 big) underflows to 0: 0 / 1


def test_double_backward_raises(backend):
    """create_graph=True (a gradient penalty) through the kernels' backward: the first gradient is
    right, differentiating it again is an error. Before, the kernels' gradients came out as constants
    and the penalty's own gradient was silently left out."""
    logits = torch.randn(6, 5, device=DEV, dtype=torch.float64, requires_grad=True)
    x = torch.randn(6, 3, device=DEV, dtype=torch.float64, requires_grad=True)
    g = ops.topk_gating(logits, 2, backend=backend)
    want = torch.autograd.grad((ref.topk_gating(logits, 2).scores ** 2).sum(), logits)[0]
    (gl, ) = torch.autograd.grad((g.scores ** 2).sum(), logits, create_graph=True)
    torch.testing.assert_close(gl, want)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        (gl.square().sum() + logits.sum()).backward()
    s = ops.assign_slots(g.expert_ids, g.scores, 5, backend=backend)
    out = ops.gather_tokens(torch.sin(ops.scatter_tokens(x, s, backend=backend)), s, g.scores.detach(), backend=backend)
    (gx, ) = torch.autograd.grad(out.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        (gx.square().sum() + x.sum()).backward()
    # a loss linear in the scores: the gradient read is a constant, but the scores' gradient still
    # depends on the logits (saved): differentiating it raises rather than leave those terms out
    w = torch.randn(6, 2, device=DEV, dtype=torch.float64)
    (gl, ) = torch.autograd.grad((ops.topk_gating(logits, 2, backend=backend).scores * w).sum(), logits,
                                 create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        gl.square().sum().backward()


@pytest.mark.parametrize("policy", ["rts", "position", "probs", "dropless"])
def test_arbitrary_logit_bits(policy, backend):
    """Logits of every scale from subnormal to 2**50 (z-loss, the mean squared log-sum-exp, stays
    inside fp32), both signs, zeros, and NaN / +-Inf entries: no fault and nothing non-finite;
    rows holding NaN or Inf route nowhere, give zero and take no gradient; the other rows route to
    k distinct experts, each kept route in its own row of its expert's range."""
    S, E, k, M = 300, 16, 2, 32
    gen = torch.Generator().manual_seed(5)
    logits = torch.ldexp(torch.rand(S, E, generator=gen) * 2 - 1, torch.randint(-160, 51, (S, E), generator=gen))
    logits[torch.rand(S, E, generator=gen) < 0.05] = 0.0
    odd = torch.randint(0, S * E, (12, ), generator=gen)
    logits.view(-1)[odd] = torch.tensor([float("nan"), float("inf"), float("-inf")]).repeat(4)
    logits = logits.to(DEV).requires_grad_()
    x = torch.randn(S, M, device=DEV, requires_grad=True)
    C = None if policy == "dropless" else 24
    g = ops.topk_gating(logits, k, renormalize=True, backend=backend)
    s = ops.assign_slots(g.expert_ids, g.scores, E, C, "position" if C is None else policy, 3, backend=backend)
    out = ops.gather_tokens(ops.scatter_tokens(x, s, backend=backend), s, g.scores, backend=backend)
    (out.square().sum() + g.aux_loss + g.z_loss).backward()
    bad = ~torch.isfinite(logits.detach()).all(dim=1)
    assert bad.sum() >= 8
    ids, slots = g.expert_ids.long(), s.slots.long()
    assert (ids[bad] == -1).all() and (g.scores[bad] == 0).all() and (slots[bad] == -1).all()
    assert (out[bad] == 0).all() and (logits.grad[bad] == 0).all()
    good = ids[~bad]
    assert ((good >= 0) & (good < E)).all() and (good.sort(dim=1).values.diff(dim=1) > 0).all()
    kept = slots >= 0
    assert slots[kept].unique().numel() == int(kept.sum()) and (slots < s.num_rows).all()
    if C is not None:
        assert (slots[kept] // C == ids[kept]).all()
    for t in (g.scores, g.aux_loss, g.z_loss, out, logits.grad, x.grad):
        assert torch.isfinite(t).all()


def test_deterministic_bits(backend):
    logits = make_logits(300, 16, torch.bfloat16)
    x = torch.randn(300, 96, device=DEV).to(torch.bfloat16)
    a = moe_step(logits, x, 2, 40, backend, seed=7)
    b = moe_step(logits, x, 2, 40, backend, seed=7)
    for u, v in zip(a, b):
        assert torch.equal(u, v)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="many tiles of routes: GPU sizes")
@pytest.mark.parametrize("S,E,k", [(20000, 8, 1), (4096, 64, 2), (9000, 3, 2), (16384, 1024, 1), (1024, 16, 8)])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_slots_large_match_reference(S, E, k, id_dtype, backend):
    """Capacity slots over many tiles of routes: int32 and int64 ids, invalid ids, an expert
    with most of the routes, and probs with exact score ties (scores on a coarse grid)."""
    torch.manual_seed(S + E + k)
    logits = torch.randn(S, E, device=DEV)
    logits[: S // 3, 0] += 30  # expert 0 far over capacity
    g = ref.topk_gating(logits, k)
    ids = g.expert_ids.to(id_dtype)
    ids[7] = -1
    ids[S // 2, 0] = E  # an id outside [0, E) routes nowhere
    scores = torch.round(g.scores * 16) / 16
    for C in (ref.capacity(S, E, k, 1.0), ref.capacity(S, E, k, 0.25), 1):
        for policy in ("position", "rts", "probs"):
            got = ops.assign_slots(ids, scores, E, C, policy, seed=S, backend=backend)
            want = ref.assign_slots(ids, scores, E, C, policy, seed=S)
            assert torch.equal(got.slots, want.slots), (C, policy)
            assert torch.equal(got.kept_counts, want.kept_counts), (C, policy)


def test_rts_uniform(backend):
    freq = rts_keep_frequencies(lambda *a: ops.assign_slots(*a, backend=backend), 64, 16, 200, device=DEV)
    assert_uniform(freq, 16 / 64, 200)


@pytest.mark.parametrize("S,E", [(0, 4), (1, 2), (7, 3), (128, 8), (1000, 64), (333, 128), (64, 1024), (9, 1500)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("sample", [True, False], ids=["sampled", "by_logits"])
def test_second_expert_kernels_match_reference(S, E, dtype, sample, backend):
    """sample_second_expert with the same uniforms, or second_by_logits, fused (one kernel each way):
    the same experts (the noise is rounded as torch rounds it), counts, scores and gradients of logits
    and first scores; rows with non-finite logits route nowhere; a saturated router's row (softmax
    rounds the others to 0) and a row of equal logits (ties to the lower id); S = 0; E past one
    1024-column tile."""
    interpreter_limit(S * E * 8)
    torch.manual_seed(S + E)
    logits = make_logits(S, E, dtype)
    if backend == "cuda" and E > csrc.MAX_EXPERTS:  # the triton backend's range, not the cuda one's
        with pytest.raises(ValueError, match="at most"):
            ops.second_by_logits(logits, ops.topk_gating(logits, 1, backend=backend), backend=backend)
        return
    if S > 5:
        logits[5, 1] = float("inf")
        logits[3] = torch.arange(E, device=DEV, dtype=dtype) * -300.0
        logits[4] = 0.25
    rand = torch.rand(S, E, device=DEV)
    got_l, ref_l = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    if sample:
        got = ops.sample_second_expert(got_l, ops.topk_gating(got_l, 1, backend=backend), rand, backend=backend)
        exp = ops.sample_second_expert(ref_l, ops.topk_gating(ref_l, 1, backend=backend), rand, backend="reference")
    else:
        got = ops.second_by_logits(got_l, ops.topk_gating(got_l, 1, backend=backend), backend=backend)
        exp = ops.second_by_logits(ref_l, ops.topk_gating(ref_l, 1, backend=backend), backend="reference")
        if S > 5:
            assert got.expert_ids[3].tolist() == [0, 1] and got.expert_ids[4].tolist() == [0, 1]
    assert torch.equal(got.expert_ids, exp.expert_ids) and torch.equal(got.counts, exp.counts)
    assert rel_err(got.scores, exp.scores) < TOL[dtype]
    g = torch.randn(S, 2, device=DEV, dtype=got.scores.dtype)
    (got.scores * g).sum().backward()
    (exp.scores * g).sum().backward()
    assert rel_err(got_l.grad, ref_l.grad) < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graph capture")
def test_sampled_second_expert_captures_in_a_cuda_graph(backend):
    """Top-2 with sampled noise, forward and backward, captured in a CUDA graph (no host-to-device copy or
    sync inside) and replayed on new logits and uniforms: the eager call's experts, counts and gradient."""
    torch.manual_seed(7)
    S, E = 1000, 16
    logits, rand, g = torch.randn(S, E, device=DEV), torch.rand(S, E, device=DEV), torch.randn(S, 2, device=DEV)
    logits.requires_grad_()

    def step():
        out = ops.sample_second_expert(logits, ops.topk_gating(logits, 1, backend=backend), rand, backend=backend)
        (out.scores * g).sum().backward()
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up off the capture: kernels compiled, autograd's streams set up
    torch.cuda.current_stream().wait_stream(side)
    logits.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():
        logits.copy_(torch.randn(S, E, device=DEV))
        rand.copy_(torch.rand(S, E, device=DEV))
    logits.grad.zero_()
    graph.replay()
    got_grad = logits.grad.clone()
    logits.grad = None
    exp = step()
    assert torch.equal(captured.expert_ids, exp.expert_ids) and torch.equal(captured.counts, exp.counts)
    assert torch.equal(got_grad, logits.grad)


@pytest.mark.parametrize("sample", [True, False], ids=["sampled", "by_logits"])
def test_gradcheck_second_expert_kernels(sample, backend):
    from turbomoe.autograd.sampling import SecondExpert
    torch.manual_seed(0)
    logits = make_logits(6, 5, torch.float64).requires_grad_()
    first = ops.topk_gating(logits.detach(), 1, backend=backend)
    p1 = first.scores.clone().requires_grad_()
    rand = torch.rand(6, 5, device=DEV) if sample else None
    impl = ops._impl(backend)
    assert torch.autograd.gradcheck(
        lambda l, p: SecondExpert.apply(l, first.expert_ids, p, first.counts, rand, impl)[1], (logits, p1),
        eps=1e-7, atol=1e-8)


@pytest.mark.parametrize("S, E, k, C", [(37, 5, 2, 6), (9, 8, 3, None), (3, 8, 2, None), (0, 4, 2, None),
                                        (0, 4, 2, 3), (20, 4, 1, 1)])
def test_gather_unit_weights_and_row_scores(S, E, k, C, any_backend):
    """MoELayer's order: the rows weighed by row_scores, gathered with unit weights (scores None),
    against the weighted gather of the reference in fp64, forward and backward (y and scores),
    with drops, capacity padding, S < E and S = 0 (with and without padding rows, whose gradient is
    zero); the unit-weight gather keeps no y for backward. The reference backend too."""
    ids, scores = routing(S, E, k, "hot" if C == 1 else "random")
    s = ops.assign_slots(ids, scores, E, capacity=C, backend=any_backend)
    M = 24
    y = torch.randn(s.num_rows, M, device=DEV, dtype=torch.float64)
    g = torch.randn(S, M, device=DEV, dtype=torch.float64)
    ya, sa = y.float().requires_grad_(), scores.detach().float().clone().requires_grad_()
    w_R = ops.row_scores(s, sa, any_backend)
    out_a = ops.gather_tokens(ya * w_R[:, None], s, None, backend=any_backend)
    yb, sb = y.clone().requires_grad_(), scores.detach().double().requires_grad_()
    out_b = ref.gather_tokens(yb, ref.routed_slots(s.slots, s.num_rows), sb)
    out_a.backward(g.float())
    out_b.backward(g)
    assert rel_err(out_a, out_b) < TOL[torch.float32]
    assert rel_err(ya.grad, yb.grad) < TOL[torch.float32] and rel_err(sa.grad, sb.grad) < TOL[torch.float32]
    filled = torch.zeros(s.num_rows, dtype=torch.bool, device=DEV)
    filled[s.slots[s.slots >= 0].long()] = True
    assert (w_R[~filled] == 0).all() and (ya.grad[~filled] == 0).all()  # padding rows: no weight, no gradient
    assert (sa.grad[s.slots < 0] == 0).all()  # dropped routes
    # Unit weights: the backward is a scatter of the output gradient and y is not kept.
    import gc
    import weakref
    y2 = y.float().requires_grad_()
    y3 = y2 * 1.0
    alive = weakref.ref(y3)
    out = ops.gather_tokens(y3, s, None, backend=any_backend)
    del y3
    gc.collect()
    assert alive() is None
    out.backward(g.float())
    assert torch.equal(y2.grad, ops.scatter_tokens(g.float(), s, backend=any_backend))


@pytest.mark.parametrize("S, E, k, C, kind", [(37, 5, 2, 6, "random"), (9, 8, 3, None, "random"),
                                              (3, 8, 2, None, "random"), (0, 4, 2, None, "random"),
                                              (0, 4, 2, 3, "random"), (41, 6, 4, 2, "hot"), (13, 1, 1, None, "hot")])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_row_scores_matches_its_definition(S, E, k, C, kind, dtype, any_backend):
    """row_scores on the kernels (scatter_tokens of the scores read route-major) against its plain
    definition, forward and backward: row slots[s, j] holds scores[s, j] exactly, padding rows 0,
    dropped routes no gradient; fresh data, capacity with drops and padding, one hot expert, S < E,
    S = 0 (with and without padding rows), E = 1."""
    ids, scores = routing(S, E, k, kind)
    s = ops.assign_slots(ids, scores, E, capacity=C, backend=any_backend)
    sc = torch.randn(S, k, device=DEV, dtype=torch.float64).to(dtype).requires_grad_()
    w_R = ops.row_scores(s, sc, any_backend)
    want = torch.zeros(s.num_rows, device=DEV, dtype=torch.float64)
    kept = s.slots >= 0
    want[s.slots[kept].long()] = sc.detach()[kept].double()
    assert w_R.dtype == dtype and w_R.shape == (s.num_rows, ) and torch.equal(w_R.double(), want)
    g_R = torch.randn(s.num_rows, device=DEV, dtype=torch.float64).to(dtype)
    w_R.backward(g_R)
    want_grad = torch.where(kept, g_R.double()[s.slots.long().clamp_min(0)], 0.0)
    assert torch.equal(sc.grad.double(), want_grad)


@pytest.mark.parametrize("S, E, k, C, kind", [(37, 5, 2, 6, "random"), (9, 8, 3, None, "random"),
                                              (3, 8, 2, None, "random"), (0, 4, 2, 3, "random"),
                                              (41, 6, 4, 2, "hot"), (13, 1, 1, None, "hot"), (50, 3, 2, 1, "hot")])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_row_scores_renormalized_matches_the_reference(S, E, k, C, kind, dtype, any_backend):
    """row_scores(renormalize=True), the weights formed in the push kernel each way, against the
    reference's renormalize_kept then scatter in fp64, forward and backward: tokens with some routes
    dropped, with all dropped (weight 0, no gradient), one kept route (weight 1, gradient 0), padding
    rows 0; a score sum under eps (clamped: the weights no longer depend on each other), zeros and a
    NaN row (NaN weights, as the reference); fresh data, S < E, S = 0 with padding rows, E = 1."""
    ids, scores = routing(S, E, k, kind)
    s = ops.assign_slots(ids, scores, E, capacity=C, backend=any_backend)
    sc = torch.rand(S, k, device=DEV, dtype=torch.float64)
    if S > 3:
        sc[0] = 1e-12  # sum below fp32's and bf16's eps: clamped
        sc[1, 0] = 0.0
        sc[2] = float("nan")
    sc = sc.to(dtype).requires_grad_()
    w_R = ops.row_scores(s, sc, any_backend, renormalize=True)
    ref_sc = sc.detach().double().requires_grad_()
    kept = s.slots >= 0
    w_SK = ref.renormalize_kept(ref_sc.to(ref.compute_dtype(dtype)), s.slots).double()
    want = torch.zeros(s.num_rows, device=DEV, dtype=torch.float64).index_put((s.slots[kept].long(), ), w_SK[kept])
    assert w_R.dtype == dtype and w_R.shape == (s.num_rows, )
    nan_R = torch.isnan(want)
    assert torch.equal(torch.isnan(w_R), nan_R)
    assert rel_err(w_R.double()[~nan_R], want[~nan_R]) < TOL[dtype]
    g_R = torch.randn(s.num_rows, device=DEV, dtype=torch.float64).to(dtype)
    w_R.backward(g_R)
    want.backward(g_R.double())
    ok_SK = ~torch.isnan(ref_sc.grad)
    assert torch.equal(torch.isnan(sc.grad), ~ok_SK)
    assert rel_err(sc.grad.double()[ok_SK], ref_sc.grad[ok_SK]) < TOL[dtype]
    assert (sc.grad[~kept] == 0).all()  # dropped routes
    if dtype == torch.float64 and S:
        s2 = sc.detach()[3:].clone().requires_grad_()  # no NaN row
        s3 = ops.assign_slots(ids[3:], scores[3:], E, capacity=C, backend=any_backend)
        assert torch.autograd.gradcheck(lambda t: ops.row_scores(s3, t, any_backend, renormalize=True), (s2, ))


def test_row_scores_and_unit_gather_errors():
    ids, scores = routing(5, 4, 2)
    s = ops.assign_slots(ids, scores, 4)
    with pytest.raises(TypeError, match="Slots from assign_slots"):
        ops.row_scores(s.slots, scores)
    with pytest.raises(ValueError, match="differ"):
        ops.row_scores(s, scores[:, :1])
    with pytest.raises(TypeError, match="renormalize must be a bool"):
        ops.row_scores(s, scores, renormalize=1)
    with pytest.raises(ValueError, match="renormalize needs scores"):
        ops.gather_tokens(torch.randn(s.num_rows, 3, device=DEV), s, None, renormalize=True)


@pytest.mark.parametrize("shape", [(64, 33), (5, 3, 2048), (1, 1), (0, 8), (8, 0), (1000, 8), (3, 2500)])
def test_bf16_terms_kernel_matches_reference(shape):
    """The router split's terms in one kernel (the cuBLAS form's, above 16 experts): the reference's
    bits over every scale (2^-100 to bf16's largest), signed zeros, non-finite values, odd and empty
    sizes, fresh data; terms sum to t exactly."""
    from turbomoe.kernels.router import bf16_terms
    n = max(1, shape[-1])
    t = torch.randn(shape, device=DEV) * torch.logspace(-30, 30, n, device=DEV)[:shape[-1]]
    if t.numel() >= 8:
        t.view(-1)[:8] = torch.tensor([0.0, -0.0, 1.0, -3.3e38, float("inf"), float("-inf"), float("nan"),
                                       2.0 ** -100], device=DEV)
    got, want = bf16_terms(t), ref.bf16_terms(t)
    assert got.shape == want.shape == (*shape[:-1], 3, shape[-1]) and got.dtype == torch.bfloat16
    nan = want.isnan()  # NaN's bits differ between torch's CPU and CUDA casts
    assert torch.equal(got.isnan(), nan)
    # Below 2^-102 a remainder can fall under fp32's smallest normal, which a device may flush to
    # zero (the interpreter does): there the terms' sum is t to within that.
    normal = (t.abs() >= 2.0 ** -102) | (t == 0) | ~t.isfinite()
    same = normal.unsqueeze(-2).expand_as(got) & ~nan
    assert torch.equal(got[same].view(torch.int16), want[same].view(torch.int16))
    finite = t.isfinite()
    err = (got.double().sum(-2) - t.double())[finite]
    assert torch.equal(err[normal[finite]], torch.zeros_like(err[normal[finite]]))
    assert (err.abs() <= 2.0 ** -126).all()
    with pytest.raises(ValueError, match="fp32"):
        bf16_terms(t.double())


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S,M,E", [(0, 64, 8), (1, 8, 1), (37, 96, 8), (130, 200, 20), (300, 72, 130),
                                   (1000, 256, 64)])
def test_router_split_kernels_match_reference(S, M, E, w_dtype):
    """fp32 router logits from bf16 tokens and both gradients, one launch each way (kernels.router),
    against their spec (reference.split_logits / split_grads) and fp64: tiles cut at every edge, more
    experts than a tile, S = 0, E = 1, fresh data, logit gradients over 16 decades."""
    from turbomoe.kernels.router import split_grads, split_logits
    x = torch.randn(S, M, device=DEV).bfloat16()
    w = (torch.randn(E, M, device=DEV) * M ** -0.5).to(w_dtype)
    g = torch.randn(S, E, device=DEV) * torch.logspace(-8, 8, E, device=DEV)
    out = split_logits(x, w)
    assert out.shape == (S, E) and out.dtype == torch.float32
    want = ref.split_logits(x, w)
    assert rel_err(out, x.double() @ w.double().t(), 1e-30) < 1e-6 and rel_err(out, want, 1e-30) < 1e-6
    gx, gw = split_grads(g, x, w)
    gx_want, gw_want = ref.split_grads(g, x, w)
    gx64, gw64 = g.double() @ w.double(), g.double().t() @ x.double()
    assert gx.dtype == torch.bfloat16 and gx.shape == (S, M) and gw.dtype == w_dtype and gw.shape == (E, M)
    if S:  # rounded once to bf16 from an fp32 sum: but for ties of that sum, fp64's rounding
        assert (gx != gx64.bfloat16()).float().mean() < 0.01 and rel_err(gx, gx64) < 2 ** -8
        assert (gx != gx_want).float().mean() < 0.01
    assert rel_err(gw, gw64, 1e-30) < (1e-6 if w_dtype == torch.float32 else 1e-2)
    assert rel_err(gw, gw_want, 1e-30) < (1e-6 if w_dtype == torch.float32 else 1e-2)
    assert split_grads(g, x, w, need_x=False)[0] is None and split_grads(g, x, w, need_w=False)[1] is None
    assert torch.equal(split_grads(g, x, w, need_w=False)[0], gx)  # deterministic
    # x's other gradient added in the kernel, in fp32 before the one rounding, as the spec adds it
    add = torch.randn(S, M, device=DEV).bfloat16()
    gx_add, gw_add = split_grads(g, x, w, gx_add=add)
    gx_add_want = ref.split_grads(g, x, w, gx_add=add)[0]
    assert torch.equal(gw_add, gw)
    if S:
        assert (gx_add != (gx64 + add.double()).bfloat16()).float().mean() < 0.01
        assert (gx_add != gx_add_want).float().mean() < 0.01 and rel_err(gx_add, gx_add_want) < 2 ** -8
        assert torch.equal(split_grads(g, x, w, need_w=False, gx_add=add.t().contiguous().t())[0], gx_add)


def test_router_split_kernels_errors():
    """Inputs the kernels do not take are errors naming them, not wrong results."""
    from turbomoe.kernels.router import split_grads, split_logits
    x, w, g = torch.randn(5, 8, device=DEV).bfloat16(), torch.randn(3, 8, device=DEV), torch.randn(5, 3, device=DEV)
    with pytest.raises(ValueError, match="bf16 x and a bf16 or fp32 w"):
        split_logits(x.float(), w)
    with pytest.raises(ValueError, match="bf16 x and a bf16 or fp32 w"):
        split_grads(g, x, w.half())
    with pytest.raises(ValueError, match=r"x \[S, M\] and w \[E, M\]"):
        split_logits(x, w[:, :7])
    # strided operands (rows apart, or columns apart) give the contiguous ones' values
    for xs in (torch.randn(5, 24, device=DEV).bfloat16()[:, 3:11], torch.randn(8, 5, device=DEV).bfloat16().t()):
        assert torch.equal(split_logits(xs, w), split_logits(xs.contiguous(), w))
        assert torch.equal(split_grads(g, xs, w)[1], split_grads(g, xs.contiguous(), w)[1])
    ws = torch.randn(3, 20, device=DEV)[:, 4:12]
    assert torch.equal(split_grads(g, x, ws)[0], split_grads(g, x, ws.contiguous())[0])


def test_router_split_kernels_exact():
    """The split in registers keeps every bit: with one-hot operands each output is one input value,
    which the kernels must give back exactly (its three bf16 terms summed in fp32) over every scale
    from 2^-100 to bf16's largest value, signed zeros included: the logits give w, the weight
    gradient gives g, and the input gradient gives w and g rounded to bf16 as torch rounds."""
    from turbomoe.kernels.router import split_grads, split_logits
    M, E = 80, 12
    w = torch.randn(E, M, device=DEV) * torch.logspace(-30, 30, M, device=DEV)
    w[0, :4] = torch.tensor([0.0, -0.0, 1.0, -3.3e38], device=DEV)
    g = torch.randn(M, E, device=DEV) * torch.logspace(-30, 30, E, device=DEV)
    g[:4, 0] = torch.tensor([0.0, -0.0, 1.0, 3.3e38], device=DEV)
    eye = torch.eye(M, device=DEV)
    x = eye.bfloat16()  # token s is the unit vector e_s
    normal_w = (w.abs() >= 2.0 ** -100) | (w == 0)
    assert torch.equal(split_logits(x, w).t()[normal_w], w[normal_w])
    normal_g = (g.abs() >= 2.0 ** -100) | (g == 0)
    assert torch.equal(split_grads(g, x, w, need_x=False)[1].t()[normal_g], g[normal_g])
    pick = eye[:, :E].t().contiguous()  # [E, M]: expert e's weight row is e_e
    gx = split_grads(g, x, pick, need_w=False)[0]
    assert torch.equal(gx[:, :E][normal_g], g.bfloat16()[normal_g]) and not gx[:, E:].any()
    one_hot_g = eye[:E]  # [E, M] as g [S = E, E]: row s picks expert s
    gx = split_grads(one_hot_g[:, :E].contiguous(), x[:E], w, need_w=False)[0]
    assert torch.equal(gx[normal_w], w.bfloat16()[normal_w])
