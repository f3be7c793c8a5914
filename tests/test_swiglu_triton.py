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


@pytest.mark.parametrize("R,F_", [(3, 7), (2, 1030)])
def test_triton_interpreter_fp32(R, F_):
    from turbomoe.kernels.swiglu import swiglu_backward, swiglu_forward
    check(R, F_, torch.float32, "cpu", 1e-5, run=lambda h, da: (swiglu_forward(h), swiglu_backward(h, da)))


def test_hand_written_backward_gradcheck():
    """The autograd Function with the hand-written backward (the Triton kernels, which compute in
    fp32), by gradcheck at fp32 tolerance, and against the fp64 reference."""
    from turbomoe.autograd.swiglu import SwiGLU
    h = (torch.randn(5, 14, dtype=torch.float64) * 2).requires_grad_()
    assert torch.autograd.gradcheck(SwiGLU.apply, (h, ), eps=1e-3, atol=2e-3, rtol=2e-3)
    check(6, 9, torch.float32, "cpu", 1e-5, run=lambda h, da: _autograd(SwiGLU.apply, h, da))


def _autograd(fn, h, da):
    h = h.clone().requires_grad_()
    a = fn(h)
    a.backward(da)
    return a.detach(), h.grad
