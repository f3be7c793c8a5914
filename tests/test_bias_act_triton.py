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

from turbomoe.autograd.bias_act import BiasAct, bias_act, bias_act_reference  # noqa: E402

DEV = "cuda" if HAS_CUDA else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel_err(a, b):
    return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm().clamp_min(1e-30)).item()


def groups_of(counts, R):
    """Rows in expert order by counts, then R - sum(counts) rows past them (group G)."""
    g = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    return torch.cat([g, torch.full((R - len(g), ), len(counts))])


def check(R, N, G, dtype, act, groups_R=None, C=None, fn=BiasAct.apply):
    gen = torch.Generator().manual_seed(R * 7919 + N * 31 + G + len(act))
    y = (torch.randn(R, N, generator=gen, dtype=torch.float64) * 3).to(DEV, dtype).requires_grad_()
    b = torch.randn(G, N, generator=gen, dtype=torch.float64).to(DEV, dtype).requires_grad_()
    dout = torch.randn(R, N, generator=gen, dtype=torch.float64).to(DEV, dtype)
    g = None if groups_R is None else groups_R.to(DEV)
    out = fn(y, b, g, C, act)
    out.backward(dout)
    yr, br = (t.detach().double().cpu().requires_grad_() for t in (y, b))
    ref = bias_act_reference(yr, br, groups_R, C, act)
    ref.backward(dout.double().cpu())
    assert out.dtype == dtype and y.grad.dtype == dtype and b.grad.dtype == dtype
    for got, want in ((out, ref), (y.grad, yr.grad), (b.grad, br.grad)):
        if want.numel():
            assert rel_err(got.detach(), want.detach()) < TOL[dtype]
        else:
            assert got.shape == want.shape and not got.abs().sum()
    return out, y.grad, b.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["none", "gelu_tanh", "gelu"])
@pytest.mark.parametrize("counts, R, N", [
    ([3, 0, 5, 1], 9, 7),              # an empty expert
    ([0, 11, 0], 13, 1030),           # one expert holds every row, two rows past the counts; two column blocks
    ([1] * 9, 9, 33),                 # more experts than... one row each
    ([0, 0], 0, 5),                   # no rows
    ([2, 3], 5, 1),
])
def test_row_groups(dtype, act, counts, R, N):
    check(R, N, len(counts), dtype, act, groups_R=groups_of(counts, R))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["none", "gelu_tanh", "gelu"])
@pytest.mark.parametrize("blocks, G, C, N", [(1, 3, 5, 7), (2, 4, 3, 1030), (1, 1, 1, 1), (2, 3, 0, 9), (3, 2, 7, 64)])
def test_equal_groups(dtype, act, blocks, G, C, N):
    """The capacity buffer [blocks, G, C, N] (blocks: expert-parallel source ranks) as rows."""
    check(blocks * G * C, N, G, dtype, act, C=C)


def test_equal_and_row_groups_same_bits():
    """The two ways of naming the groups give the same bits, and on a GPU the public function the
    Function's (on the CPU it takes the reference, which check holds to the tolerance)."""
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
    out = BiasAct.apply(y, b, None, 1, "gelu_tanh")
    out.sum().backward()
    assert torch.equal(out.detach().cpu(), torch.tensor([[-0.0, -0.0, 0.0, 30.0, 1e4]]))
    assert torch.equal(y.grad.cpu(), torch.tensor([[0.0, 0.0, 0.5, 1.0, 1.0]]))
