"""turbomoe.kernels.adamw (AdamW with the 16-bit copy and the cleared gradient in one pass) against
torch.optim.AdamW's single-tensor update in float64, the spec; under the Triton interpreter on the
CPU, natively on a GPU:
    TRITON_INTERPRET=1 pytest tests/test_adamw_triton.py
"""
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="needs a GPU or TRITON_INTERPRET=1 set before triton kernels are defined")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference_steps(p0, grads, lrs, skips, scales, wd, betas, eps):
    """torch.optim.AdamW (foreach=False) in float64 over the steps; a skipped step is not taken."""
    p = p0.double().clone().requires_grad_()
    opt = torch.optim.AdamW([p], lr=lrs[0], betas=betas, eps=eps, weight_decay=wd, foreach=False)
    for g, lr, skip, scale in zip(grads, lrs, skips, scales):
        if skip:
            continue
        opt.param_groups[0]["lr"] = lr
        p.grad = g.double() / (1.0 if scale is None else scale)
        opt.step()
    st = opt.state[p] if opt.state[p] else {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    return p.detach(), st["exp_avg"], st["exp_avg_sq"]


@pytest.mark.parametrize("n", [0, 1, 4097, 10007, pytest.param(3_000_001, marks=pytest.mark.skipif(
    DEVICE != "cuda", reason="a recipe-sized buffer (733 programs): natively on a GPU only"))])
@pytest.mark.parametrize("dtype,wd,clip,lp", [(torch.float32, 0.0, False, None), (torch.float32, 0.1, True, torch.bfloat16),
                                              (torch.float32, 0.01, False, torch.float16), (torch.float64, 0.1, True, None)])
def test_adamw_matches_torch(n, dtype, wd, clip, lp):
    from turbomoe.kernels.adamw import adamw_step
    gen = torch.Generator().manual_seed(n + 7)
    betas, eps = (0.9, 0.95), 1e-8
    p0 = torch.randn(n, generator=gen, dtype=torch.float64)
    # gradients of many scales, one step skipped as a non-finite norm skips it
    grads = [torch.randn(n, generator=gen, dtype=torch.float64) * s for s in (1.0, 1e-3, 30.0, 1e-6)]
    lrs, skips = [1e-3, 2e-3, 5e-4, 1e-3], [False, False, True, False]
    scales = [3.0 if clip else None, 1.0 if clip else None, 2.0 if clip else None, 7.5 if clip else None]

    p = p0.to(dtype).to(DEVICE, copy=True)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    step = torch.zeros((), device=DEVICE)
    p_lp = torch.full((n,), float("nan"), dtype=lp, device=DEVICE) if lp else None
    for g, lr, skip, scale in zip(grads, lrs, skips, scales):
        grad = g.to(dtype).to(DEVICE, copy=True)
        found_inf = torch.tensor([float(skip)], device=DEVICE)
        step += 1 - found_inf[0]
        adamw_step(p, grad, m, v, step, lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=wd,
                   grad_scale=None if scale is None else torch.tensor(scale, device=DEVICE, dtype=torch.float32),
                   found_inf=found_inf, param_lp=p_lp, zero_grad=True)
        assert not grad.any()  # cleared, the skipped step's too
    assert step.item() == 3
    ref_p, ref_m, ref_v = reference_steps(p0.to(dtype), grads, lrs, skips, scales, wd, betas, eps)
    # fp32 math: a few ulps of each term, so an element that cancels (m = beta1 m + (1 - beta1) g near 0)
    # is off by ulps of the buffer's scale, not of itself; fp64: the hyperparameters arrive as fp32
    tol = 1e-6 if dtype == torch.float32 else 1e-7
    scale = lambda t: float(t.abs().max()) if t.numel() else 0.0  # noqa: E731
    for got, want, floor in ((p, ref_p, 1e-2), (m, ref_m, scale(ref_m)), (v, ref_v, scale(ref_v))):
        assert torch.allclose(got.cpu().double(), want, rtol=tol, atol=tol * floor)
    if lp and DEVICE == "cuda":
        assert torch.equal(p_lp, p.to(lp))  # the copy of the final weights, rounded once
    elif lp:  # the interpreter truncates to bfloat16 where the GPU rounds to nearest
        assert ((p_lp.double() - p.double()).abs() <= p.double().abs() * torch.finfo(lp).eps).all()


def test_skipped_step_leaves_everything_but_the_gradient():
    from turbomoe.kernels.adamw import adamw_step
    p = torch.randn(5000, device=DEVICE)
    m, v, lp = torch.randn_like(p), torch.rand_like(p), p.to(torch.bfloat16)
    before = [t.clone() for t in (p, m, v, lp)]
    grad = torch.full_like(p, float("nan"))
    adamw_step(p, grad, m, v, torch.ones((), device=DEVICE), lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
               weight_decay=0.1, found_inf=torch.ones(1, device=DEVICE), param_lp=lp, zero_grad=True)
    assert all(torch.equal(a, b) for a, b in zip(before, (p, m, v, lp)))
    assert not grad.any()


def test_bad_buffers_are_errors():
    from turbomoe.kernels.adamw import adamw_step
    p = torch.zeros(10, device=DEVICE)
    step = torch.ones((), device=DEVICE)
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match="exp_avg must be contiguous with param's numel 10"):
        adamw_step(p, torch.zeros_like(p), torch.zeros(9, device=DEVICE), torch.zeros_like(p), step, **kw)
    with pytest.raises(TypeError, match="grad must share param's dtype"):
        adamw_step(p, torch.zeros(10, dtype=torch.float64, device=DEVICE), torch.zeros_like(p), torch.zeros_like(p),
                   step, **kw)
    with pytest.raises(ValueError, match="param_lp must be contiguous"):
        adamw_step(p, torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p), step,
                   param_lp=torch.zeros(20, dtype=torch.bfloat16, device=DEVICE)[::2], **kw)
    with pytest.raises(ValueError, match="step must be one element"):
        adamw_step(p, torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p), torch.ones(2, device=DEVICE), **kw)


@pytest.mark.parametrize("t", [1, 2, 7, 12345, 2**33 + 5])
def test_bias_corrections_at_any_step(t):
    """The step count t read from the device, its bias corrections formed by squaring: one step from
    a given state (moments as after t - 1 steps) against torch's AdamW from the same state."""
    from turbomoe.kernels.adamw import adamw_step
    gen = torch.Generator().manual_seed(t % 1000)
    n, betas = 777, (0.8, 0.999)  # 1 - beta2 from an fp32 beta2 would be 1.3e-5 off
    p0, g = torch.randn(n, generator=gen, dtype=torch.float64), torch.randn(n, generator=gen, dtype=torch.float64)
    m0, v0 = torch.randn(n, generator=gen, dtype=torch.float64) * 0.1, torch.rand(n, generator=gen, dtype=torch.float64)
    ref = p0.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=betas, weight_decay=0.0, foreach=False)
    opt.state[ref] = {"step": torch.tensor(float(t - 1), dtype=torch.float64), "exp_avg": m0.clone(), "exp_avg_sq": v0.clone()}
    ref.grad = g.clone()
    opt.step()
    p, m, v = (x.to(DEVICE, copy=True) for x in (p0, m0, v0))
    adamw_step(p, g.to(DEVICE, copy=True), m, v, torch.tensor(float(t), dtype=torch.float64, device=DEVICE), lr=1e-2,
               beta1=betas[0], beta2=betas[1], eps=1e-8, weight_decay=0.0)
    assert torch.allclose(p.cpu(), ref.detach(), rtol=1e-7, atol=1e-9)  # the betas arrive as fp32


@pytest.mark.skipif(DEVICE != "cuda", reason="a race between the threads of a program: only a GPU runs them")
@pytest.mark.parametrize("lp", [torch.bfloat16, torch.float16])
def test_clearing_the_gradient_changes_nothing_else(lp):
    """The gradient cleared in the pass that reads it: the update bit for bit as without clearing,
    over many programs and steps (a constant zero tile once took another thread layout than the
    load and cleared elements before they were read: a few per step, not every run)."""
    from turbomoe.kernels.adamw import adamw_step
    n = 3_000_001
    gen = torch.Generator(device="cuda").manual_seed(0)
    p = torch.randn(n, device="cuda", generator=gen)
    states = [[p.clone(), torch.zeros_like(p), torch.zeros_like(p), torch.empty(n, dtype=lp, device="cuda")]
              for _ in range(2)]
    step, found_inf = torch.zeros((), device="cuda"), torch.zeros(1, device="cuda")
    for i in range(6):
        g = torch.randn(n, device="cuda", generator=gen) * 10.0 ** -i
        step += 1
        grads = [g.clone(), g.clone()]
        for (pp, m, v, low), grad, clear in zip(states, grads, (False, True)):
            adamw_step(pp, grad, m, v, step, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01,
                       found_inf=found_inf, param_lp=low, zero_grad=clear)
        assert torch.equal(grads[0], g) and not grads[1].any()
        for a, b in zip(*states):
            assert torch.equal(a, b), i
