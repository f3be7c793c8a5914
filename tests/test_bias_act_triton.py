"""The bias + activation kernels (turbomoe/kernels/bias_act.py) through their autograd Function, forward
and backward against the reference evaluated in float64: natively on a GPU, under TRITON_INTERPRET=1 on
the CPU (scripts/test.sh runs this file in a process of its own there)."""
import os

import pytest
import torch

from conftest import HAS_CUDA

if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU, or TRITON_INTERPRET=1 on the CPU (as CI runs this file)",
                allow_module_level=True)

from test_bias_act import ACTS, EQUAL_CASES, ROW_CASES, groups_of  # noqa: E402
from test_bias_act import check as check_form  # noqa: E402
from test_bias_act import check_non_finite_past_the_groups  # noqa: E402
from turbomoe.autograd.bias_act import BiasAct, bias_act  # noqa: E402

DEV = "cuda" if HAS_CUDA else "cpu"


def kernels(y, b, g, C, act):
    return BiasAct.apply(y, b, g, C, act, True)


def check(*args, **kw):
    return check_form(*args, fn=kw.pop("fn", kernels), device=DEV, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("counts, R, N", ROW_CASES)
def test_row_groups(dtype, act, counts, R, N):
    check(R, N, len(counts), dtype, act, groups_R=groups_of(counts, R))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("blocks, G, C, N", EQUAL_CASES)
def test_equal_groups(dtype, act, blocks, G, C, N):
    check(blocks * G * C, N, G, dtype, act, C=C)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ACTS)
def test_non_finite_rows_past_the_groups(dtype, act):
    check_non_finite_past_the_groups(kernels, DEV, dtype, act)


def test_equal_and_row_groups_same_bits():
    """The two ways of naming the groups give the same bits, and on a GPU the public function the
    kernels' (on the CPU it takes the PyTorch form, which check holds to the tolerance)."""
    G, C, N = 3, 6, 70
    groups_R = (torch.arange(2 * G * C) // C % G).to(torch.int32)
    a = check(2 * G * C, N, G, torch.bfloat16, "gelu_tanh", C=C)
    b = check(2 * G * C, N, G, torch.bfloat16, "gelu_tanh", groups_R=groups_R)
    c = check(2 * G * C, N, G, torch.bfloat16, "gelu_tanh", C=C,
              fn=lambda y, b, g, C, act: bias_act(y, b, rows_per_group=C, act=act))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and (DEV == "cpu" or torch.equal(a[0], c[0]))
    assert (a[2] - b[2]).abs().max() <= 2 ** -6 * b[2].abs().max()  # a sum over C against a one-hot GEMM


def test_large_values_stay_finite():
    """gelu_tanh through sig(2u): no tanh overflow at |z| ~ 1e4 (u ~ 3.6e10)."""
    y = torch.tensor([[-1e4, -30.0, 0.0, 30.0, 1e4]], device=DEV).requires_grad_()
    b = torch.zeros(1, 5, device=DEV, requires_grad=True)
    out = kernels(y, b, None, 1, "gelu_tanh")
    out.sum().backward()
    assert torch.equal(out.detach().cpu(), torch.tensor([[-0.0, -0.0, 0.0, 30.0, 1e4]]))
    assert torch.equal(y.grad.cpu(), torch.tensor([[0.0, 0.0, 0.5, 1.0, 1.0]]))
