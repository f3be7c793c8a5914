"""The Triton grouped GEMM kernels on the CPU through the Triton interpreter.

Run in its own process with TRITON_INTERPRET=1 in the environment (read when kernels are defined):
    TRITON_INTERPRET=1 pytest tests/test_grouped_gemm_triton.py
"""
import os

import pytest
import torch

from test_grouped_gemm import check, check_counts_past_rows, check_grad_into_w, check_main_grad, check_no_rows

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 set before triton kernels are defined")


@pytest.mark.parametrize("zero_groups,tail,transposed_w", [((), 0, False), ((0, 3), 5, True)])
def test_triton_interpreter_fp32(zero_groups, tail, transposed_w):
    # 5 groups of 16-row tiles over 4 programs: tiles of several groups interleave across programs.
    check(70, 24, 40, 5, torch.float32, "cpu", "triton", zero_groups, tail, tol=1e-5, transposed_w=transposed_w)


def test_triton_interpreter_counts_past_rows():
    check_counts_past_rows("cpu", "triton", torch.float32, 1e-5)


def test_triton_interpreter_no_rows():
    check_no_rows("cpu", "triton", torch.float32, 1e-5)


@pytest.mark.parametrize("zero_groups,tail", [((), 0), ((0, 3), 5)])
@pytest.mark.parametrize("add,layout", [(True, "plain"), (True, "transposed"), (False, "gap")])
def test_triton_interpreter_main_grad(zero_groups, tail, add, layout):
    check_main_grad(70, 24, 40, 5, torch.float32, "cpu", "triton", zero_groups, tail, tol=1e-5, add=add,
                    placeholder=add, layout=layout)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph")
def test_triton_interpreter_grad_into_w():
    check_grad_into_w(70, 24, 40, 5, torch.float32, "cpu", "triton", (1, ), tol=1e-5)


def test_triton_interpreter_fp16():
    check(37, 24, 40, 3, torch.float16, "cpu", "triton", (1, ), 3, tol=3e-3)


@pytest.mark.parametrize("dtype,want", [(torch.float32, "triton"), (torch.float16, "triton"),
                                        (torch.bfloat16, "reference"), (torch.float64, "reference")])
def test_default_backend_under_the_interpreter(dtype, want):
    """The default takes the Triton GEMM on the CPU only for the dtypes it computes right there: the
    interpreter's bf16 tl.dot is wrong, and the kernel accumulates in fp32 (float64 would be rounded).
    Forcing it on those dtypes is an error naming them, not a wrong result."""
    from turbomoe.autograd.grouped_gemm import choose_gmm_backend, grouped_mm
    x, w = torch.randn(6, 16, dtype=dtype), torch.randn(2, 16, 16, dtype=dtype)
    assert choose_gmm_backend(x, w) == want
    counts = torch.tensor([2, 4], dtype=torch.int32)
    if want == "reference":
        with pytest.raises(TypeError, match="triton grouped GEMM takes .*got torch"):
            grouped_mm(x, w, counts, backend="triton")
    y = grouped_mm(x.double(), w.double(), counts, backend="reference").to(dtype)
    tol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2, torch.float64: 1e-12}[dtype]
    assert (grouped_mm(x, w, counts) - y).abs().max().item() <= tol * y.abs().max().item()


def test_triton_interpreter_double_backward_raises():
    """The kernels' backward under create_graph gives the first gradient (autograd's way into .grad);
    differentiating that gradient again is an error, not a silent constant."""
    from turbomoe.autograd.grouped_gemm import grouped_mm
    torch.manual_seed(3)
    x = torch.randn(20, 16, requires_grad=True)
    w = torch.randn(3, 16, 24, requires_grad=True)
    counts = torch.tensor([7, 0, 13], dtype=torch.int32)
    (gx, ) = torch.autograd.grad(grouped_mm(x, w, counts, backend="triton").square().sum(), x, create_graph=True)
    (want, ) = torch.autograd.grad(grouped_mm(x, w, counts, backend="reference").square().sum(), x)
    torch.testing.assert_close(gx, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        (gx.square().sum() + x.sum()).backward()
