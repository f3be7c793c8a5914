"""SwiGLU (turbomoe.autograd.swiglu): the Triton kernels' forward and backward against the fp64
reference, h [R, 2F] = [gate | up] -> silu(gate) * up [R, F], and with a row scale s [R] (the
routing score): s * silu(gate) * up, whose backward also gives ds."""
import pytest
import torch
import torch.nn.functional as F

from turbomoe.autograd.swiglu import swiglu, swiglu_reference


def rel_err(a, b):
    return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm().clamp_min(1e-30)).item()


def check(R, F_, dtype, device, tol, run=None, scaled=False):
    """run(h, da) -> (a, dh), or with scaled run(h, da, s) -> (a, dh, ds); by default swiglu's
    autograd path. The scale has zeros, negatives and ones among fresh random values."""
    gen = torch.Generator().manual_seed(R * 31 + F_ + scaled)
    h = (torch.randn(R, 2 * F_, generator=gen, dtype=torch.float64) * 3).to(device, dtype)
    da = torch.randn(R, F_, generator=gen, dtype=torch.float64).to(device, dtype)
    s = torch.rand(R, generator=gen, dtype=torch.float64)
    s[::3], s[1::5] = 0.0, -s[1::5]
    s = s.to(device, torch.float32) if scaled else None
    if run is None:
        h.requires_grad_()
        if scaled:
            s.requires_grad_()
        a = swiglu(h, s)
        a.backward(da)
        dh, ds = h.grad, None if s is None else s.grad
    else:
        a, dh, *ds = run(h, da, s) if scaled else run(h, da)
        ds = ds[0] if ds else None
    hr = h.detach().double().cpu().requires_grad_()
    sr = None if s is None else s.detach().double().cpu().requires_grad_()
    ar = swiglu_reference(hr, sr)
    ar.backward(da.double().cpu())
    assert rel_err(a, ar.detach()) < tol
    assert rel_err(dh, hr.grad) < tol
    if scaled:
        assert ds.dtype == torch.float32 and ds.shape == (R, )
        assert rel_err(ds, sr.grad) < tol


def closed_form_backward(h, da):
    """dh of a = silu(gate) * up, as the kernels' backward writes it (turbomoe/kernels/swiglu.py)."""
    gate, up = h.chunk(2, dim=-1)
    s = torch.sigmoid(gate)
    return torch.cat([da * up * s * (1 + gate * (1 - s)), da * gate * s], dim=-1)


def test_reference_gradcheck():
    """The reference (the CPU path of swiglu) by gradcheck, and the closed form that the hand-written
    backward implements against its autograd gradient. The hand-written backward itself runs in
    tests/test_swiglu_triton.py (interpreter) and test_gpu (before, this test only gradchecked the
    reference through torch autograd and never reached the formula of the hand-written backward)."""
    h = torch.randn(4, 10, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu_reference, (h,))
    assert torch.equal(swiglu(h.detach()), F.silu(h[:, :5]) * h[:, 5:])
    da = torch.randn(4, 5, dtype=torch.float64)
    swiglu_reference(h).backward(da)
    assert rel_err(closed_form_backward(h.detach(), da), h.grad) < 1e-14


def test_scaled_reference_gradcheck():
    """The row-scaled reference by gradcheck (h and s), and the scale's closed-form gradient, the sum
    of da * silu(gate) * up over the row, which the backward kernel forms."""
    h = torch.randn(4, 10, dtype=torch.float64, requires_grad=True)
    s = torch.tensor([0.5, 0.0, -2.0, 1.0], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu_reference, (h, s))
    da = torch.randn(4, 5, dtype=torch.float64)
    swiglu_reference(h, s).backward(da)
    assert rel_err(s.grad, (da * swiglu_reference(h.detach())).sum(1)) < 1e-14
    assert rel_err(h.grad, closed_form_backward(h.detach(), da * s.detach()[:, None])) < 1e-14


def test_bad_input():
    with pytest.raises(ValueError, match=r"\[R, 2F\]"):
        swiglu(torch.randn(3, 5))
    with pytest.raises(ValueError, match=r"\[R, 2F\]"):
        swiglu(torch.randn(6))
    with pytest.raises(ValueError, match=r"scale must be a float \[3\]"):
        swiglu(torch.randn(3, 4), torch.ones(4))
    with pytest.raises(ValueError, match="scale must be a float"):
        swiglu(torch.randn(3, 4), torch.ones(3, dtype=torch.int32))


@pytest.mark.parametrize("R,F_", [(1, 1), (33, 100), (70, 1025), (5, 5632), (0, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scaled", [False, True])
def test_gpu(R, F_, dtype, scaled):
    """F = 1025: a masked second block of columns (and with a scale, two blocks summed into ds in
    one program); R = 0: nothing launched."""
    check(R, F_, dtype, "cuda", 1e-5 if dtype == torch.float32 else 1e-2, scaled=scaled)
