"""fp32 router logits from 16-bit tokens (turbomoe.autograd.router) against F.linear on fp32 copies,
the computation DeepSpeed's gate spells out."""
import pytest
import torch
import torch.nn.functional as F

from conftest import needs_cuda, rel_err
from turbomoe.autograd.router import fp32_logits, fp32_logits_and_x, split_applies

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,w_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                           (torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("S,M,E", [(1, 8, 1), (37, 96, 8), (1000, 256, 64)])
def test_matches_fp32_linear(S, M, E, dtype, w_dtype, device):
    torch.manual_seed(S + M + E)
    x = torch.randn(S, M, device=device).to(dtype)
    w = (torch.randn(E, M, device=device) * M ** -0.5).to(w_dtype)
    g = torch.randn(S, E, device=device)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    xb, wb = x.double().requires_grad_(), w.double().requires_grad_()
    out = fp32_logits(xa, wa)
    ref = F.linear(xb, wb)  # fp64 of the same values: 16-bit products are exact in fp32
    assert out.dtype == torch.float32 and rel_err(out, ref) < 1e-6
    out.backward(g)
    ref.backward(g.double())
    assert xa.grad.dtype == dtype and wa.grad.dtype == w_dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # gradients are rounded to the parameters' dtype
    assert rel_err(xa.grad, xb.grad) < tol and rel_err(wa.grad, wb.grad) < (1e-6 if w_dtype == torch.float32 else 1e-2)
    # The gradients are F.linear's on fp32 copies, rounded once to the input dtypes; on CUDA with bf16
    # tokens (bf16 terms on tensor cores, sums in another order) but for one-ulp rounding flips.
    xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
    F.linear(xc.float(), wc.float()).backward(g)
    if split_applies(x, w):
        flipped = xa.grad != xc.grad
        assert flipped.float().mean() < 1e-3 and rel_err(xa.grad, xc.grad) < 2e-4
        assert rel_err(wa.grad, wc.grad) < (1e-6 if w_dtype == torch.float32 else 1e-2)
    else:
        assert rel_err(xa.grad, xc.grad) < 1e-5 and rel_err(wa.grad, wc.grad) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("E", [8, 64])  # the split's kernels' range, and cuBLAS's beyond it
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_compiled_gradients_equal_eager(device, E, w_dtype):
    """Traced by torch.compile (plain ops there: an fp32 GEMM), the logits and both gradients are
    eager's within rounding. (torch 2.11's dynamo traced the Function with a bf16 w with a zero
    gradient in place of the logits': x and w got zeros, on the GPU machine only.)"""
    torch.manual_seed(E)
    x, w = torch.randn(33, 64, device=device).bfloat16(), torch.randn(E, 64, device=device).to(w_dtype)
    g = torch.randn(33, E, device=device)
    grads = []
    for fn in (fp32_logits, torch.compile(fp32_logits, backend="aot_eager", fullgraph=True)):
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(xa, wa)
        out.backward(g)
        grads.append((out.detach(), xa.grad, wa.grad))
    torch._dynamo.reset()
    for got, want in zip(grads[1], grads[0]):
        assert got is not None
        torch.testing.assert_close(got, want, rtol=2e-2 if got.dtype == torch.bfloat16 else 1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,w_dtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                           (torch.float32, torch.float32)])
@pytest.mark.parametrize("E", [8, 64])
@pytest.mark.parametrize("compiled", [False, True])
def test_x_passed_through_gets_both_gradients(device, dtype, w_dtype, E, compiled):
    """fp32_logits_and_x: the x it returns is x (same values, storage), and x's gradient is the sum of
    the logits' and the other consumer's, added inside the router's backward before its one rounding:
    against fp64, and against the two consumers of x apart (autograd's add of two roundings); the
    weight's gradient unchanged. Logits unused, or the x passed unused, still give the right gradient.
    Traced by torch.compile too (dynamo, aot_eager): there the logits are plain ops and autograd adds
    x's two gradients (other sums than the kernels'), so against eager within rounding, not bit for bit."""
    torch.manual_seed(E)
    S, M = 75, 96
    x = torch.randn(S, M, device=device).to(dtype)
    w = (torch.randn(E, M, device=device) * M ** -0.5).to(w_dtype)
    g, h = torch.randn(S, E, device=device), torch.randn(S, M, device=device).to(dtype)
    fn = torch.compile(fp32_logits_and_x, backend="aot_eager", fullgraph=True) if compiled else fp32_logits_and_x
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    logits, x2 = fn(xa, wa)
    assert torch.equal(x2, xa) and (compiled or x2.data_ptr() == xa.data_ptr())
    torch.autograd.backward([logits, x2 * 3], [g, h])

    def same(got, want):
        if not compiled:
            return torch.equal(got, want)
        torch.testing.assert_close(got, want, rtol=2e-2 if got.dtype == torch.bfloat16 else 1e-5, atol=1e-5)
        return True

    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch.autograd.backward([fp32_logits(xb, wb), xb * 3], [g, h])
    want = g.double() @ w.double() + 3 * h.double()
    tol = 1e-6 if dtype == torch.float32 else 2 ** -8
    assert xa.grad.dtype == dtype and rel_err(xa.grad, want) < tol and rel_err(xa.grad, xb.grad) < tol
    assert same(wa.grad, wb.grad)
    for used in ("logits", "x"):
        xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
        logits, x2 = fn(xc, wc)
        (logits * g).sum().backward() if used == "logits" else (x2 * h).sum().backward()
        xd, wd = x.clone().requires_grad_(), w.clone().requires_grad_()
        (fp32_logits(xd, wd) * g).sum().backward() if used == "logits" else (xd * h).sum().backward()
        assert same(xc.grad, xd.grad)
        if wd.grad is None:  # the logits unused: no gradient (compiled, zeros)
            assert wc.grad is None or (compiled and not wc.grad.any())
        else:
            assert same(wc.grad, wd.grad)
    torch._dynamo.reset()


def test_x_passed_through_without_grad_stays_without():
    """x that needs no gradient (a frozen input) comes back needing none, though w needs one: the
    dispatch's backward then does not run for it; w's gradient is fp32_logits' own."""
    torch.manual_seed(1)
    x, w = torch.randn(9, 16).bfloat16(), torch.randn(4, 16, requires_grad=True)
    g = torch.randn(9, 4)
    logits, x2 = fp32_logits_and_x(x, w)
    assert logits.requires_grad and not x2.requires_grad and torch.equal(x2, x)
    (logits * g).sum().backward()
    w2 = w.detach().clone().requires_grad_()
    (fp32_logits(x, w2) * g).sum().backward()
    assert torch.equal(w.grad, w2.grad)


def test_gradcheck():
    torch.manual_seed(0)
    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    # fp32 logits: gradcheck in fp64 needs the fp64 path, so check against the fp32 tolerance.
    assert torch.autograd.gradcheck(lambda a, b: fp32_logits(a, b).double(), (x, w), eps=1e-3, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("S,M,E", [(64, 32, 4), (37, 96, 8), (1000, 256, 64)])
def test_cpu_equals_f_linear_bits(S, M, E):
    """On the CPU, the logits and both gradients are bit for bit those of F.linear on fp32 copies
    (DeepSpeed's gate), the gradients rounded once to bf16. (Before, the test compared the op's
    own expression, torch.mm of fp32 copies, with itself.)"""
    torch.manual_seed(S)
    x, w, g = torch.randn(S, M).bfloat16(), torch.randn(E, M).bfloat16(), torch.randn(S, E)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fp32_logits(xa, wa)
    out.backward(g)
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = F.linear(xb.float(), wb.float())
    ref.backward(g)
    assert torch.equal(out, ref) and torch.equal(xa.grad, xb.grad) and torch.equal(wa.grad, wb.grad)


def test_bf16_terms_sum_exactly():
    """Three bf16 terms hold an fp32 value exactly (8 significant bits each), over every scale from
    ~2^-110 to bf16's largest value; a non-finite value stays non-finite."""
    from turbomoe.reference import bf16_terms
    torch.manual_seed(1)
    t = torch.randn(64, 33) * torch.logspace(-30, 30, 33)
    t[0, :4] = torch.tensor([0.0, -0.0, 1.0, 3.3e38])
    terms = bf16_terms(t)
    assert terms.shape == (64, 3, 33) and terms.dtype == torch.bfloat16
    assert torch.equal(terms.double().sum(-2), t.double())
    assert (terms[..., 0, :].float() == t.bfloat16().float()).all()  # the leading term is t's rounding
    bad = bf16_terms(torch.tensor([[float("inf"), float("nan"), 1.0]]))
    assert not bad[..., 0].isfinite().all() and not bad[..., 1].isfinite().all() and torch.equal(
        bad[0, :, 2].float(), torch.tensor([1.0, 0.0, 0.0]))


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("S,M,E", [(0, 8, 4), (1, 8, 1), (37, 96, 8), (513, 256, 64)])
def test_split_matches_fp64(S, M, E, w_dtype):
    """The split's spec (reference.split_logits / split_grads: bf16 terms, products exact, fp32 sums;
    the CUDA path's kernels are tested against it in test_ops_triton.py), on the CPU with fp32 copies
    standing in for the tensor cores: logits and the weight's gradient within fp32 rounding of fp64,
    the input's gradient fp64's rounded to bf16 but for rounding ties of its fp32 sum."""
    from turbomoe.reference import bf16_terms, split_grads, split_logits
    torch.manual_seed(S + M + E)
    x = torch.randn(S, M).bfloat16()
    w = (torch.randn(E, M) * M ** -0.5).to(w_dtype)
    g = torch.randn(S, E) * torch.logspace(-8, 8, E)  # gradients of many scales
    ref = x.double() @ w.double().t()
    out = split_logits(x, w)
    assert out.dtype == torch.float32 and out.shape == (S, E) and rel_err(out, ref, 1e-30) < 1e-6
    gx, gw = split_grads(g, x, w, True, True)
    gx_ref, gw_ref = g.double() @ w.double(), g.double().t() @ x.double()
    assert gx.dtype == torch.bfloat16 and gw.dtype == w_dtype
    assert rel_err(gw, gw_ref, 1e-30) < (1e-6 if w_dtype == torch.float32 else 1e-2)
    if S:
        assert (gx != gx_ref.bfloat16()).float().mean() < 0.01 and rel_err(gx, gx_ref) < 2 ** -8
    assert split_grads(g, x, w, False, True)[0] is None
    assert split_grads(g, x, w, True, False)[1] is None
    if w_dtype == torch.float32:  # an fp32 w's terms made once by the caller (autograd's forward): the same bits
        terms = bf16_terms(w)
        assert torch.equal(split_logits(x, terms), out)
        gx_t, gw_t = split_grads(g, x, terms)
        assert torch.equal(gx_t, gx) and gw_t.dtype == torch.float32 and torch.equal(gw_t, gw)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("E", [8, 64])  # the kernels, and the cuBLAS form above 16 experts
def test_no_host_sync(w_dtype, E):
    """Forward and backward of the split (bf16 tokens, a bf16 or fp32 weight) never wait for the GPU
    (the fp32 weight's backward once indexed its terms with a Python list: a copy to the device and a
    sync)."""
    x = torch.randn(300, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(E, 64, device="cuda", dtype=w_dtype, requires_grad=True)
    g = torch.randn(300, E, device="cuda")
    fp32_logits(x, w).backward(g)  # warm-up: the kernels' compilation
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fp32_logits(x, w).backward(g)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_autocast_leaves_them_fp32(device, dtype):
    """Under torch.autocast (whose mm would round to bf16) the logits and both gradients are the bits
    of the run without it, backward inside the region or after it."""
    torch.manual_seed(3)
    x = torch.randn(37, 96, device=device).to(dtype)
    w = torch.randn(8, 96, device=device) * 96 ** -0.5
    g = torch.randn(37, 8, device=device)

    def run(autocast, backward_inside):
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            out = fp32_logits(xa, wa)
            if backward_inside:
                out.backward(g)
        if not backward_inside:
            out.backward(g)
        return out, xa.grad, wa.grad

    want = run(False, False)
    assert want[0].dtype == torch.float32
    for inside in (False, True):
        assert all(torch.equal(a, b) for a, b in zip(run(True, inside), want))
