"""The Triton SwiGLU kernels on the CPU through the Triton interpreter.

Run in its own process with TRITON_INTERPRET=1 in the environment (read when kernels are defined):
    TRITON_INTERPRET=1 pytest tests/test_swiglu_triton.py
"""
import os

import pytest
import torch

from test_swiglu import check

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 set before triton kernels are defined")


@pytest.mark.parametrize("R,F_", [(3, 7), (2, 1030), (7, 2100), (0, 5)])
@pytest.mark.parametrize("scaled", [False, True])
def test_triton_interpreter_fp32(R, F_, scaled):
    """F = 1030 and 2100: two and three blocks of columns, which the scaled backward sums into ds in
    one program, in order."""
    from turbomoe.kernels.swiglu import swiglu_backward, swiglu_forward
    if scaled:
        check(R, F_, torch.float32, "cpu", 1e-5, scaled=True,
              run=lambda h, da, s: (swiglu_forward(h, s), *swiglu_backward(h, da, s)))
    else:
        check(R, F_, torch.float32, "cpu", 1e-5, run=lambda h, da: (swiglu_forward(h), swiglu_backward(h, da)[0]))


def test_hand_written_backward_gradcheck():
    """The autograd Function with the hand-written backward (the Triton kernels, which compute in
    fp32), by gradcheck at fp32 tolerance, and against the fp64 reference."""
    from turbomoe.autograd.swiglu import SwiGLU
    h = (torch.randn(5, 14, dtype=torch.float64) * 2).requires_grad_()
    s = torch.tensor([0.3, 0.0, -1.5, 1.0, 0.8], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(SwiGLU.apply, (h, ), eps=1e-3, atol=2e-3, rtol=2e-3)
    assert torch.autograd.gradcheck(SwiGLU.apply, (h, s), eps=1e-3, atol=2e-3, rtol=2e-3)
    check(6, 9, torch.float32, "cpu", 1e-5, run=lambda h, da: _autograd(SwiGLU.apply, h, da))
    check(6, 9, torch.float32, "cpu", 1e-5, scaled=True, run=lambda h, da, s: _autograd(SwiGLU.apply, h, da, s))


def _autograd(fn, h, da, s=None):
    h = h.clone().requires_grad_()
    s = None if s is None else s.clone().requires_grad_()
    a = fn(h, s)
    a.backward(da)
    return (a.detach(), h.grad) if s is None else (a.detach(), h.grad, s.grad)
