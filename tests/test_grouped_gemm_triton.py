"""The Triton grouped GEMM kernels on the CPU through the Triton interpreter.

Run in its own process with TRITON_INTERPRET=1 in the environment (read when kernels are defined):
    TRITON_INTERPRET=1 pytest tests/test_grouped_gemm_triton.py
"""
import os

import pytest
import torch

from test_grouped_gemm import check, check_counts_past_rows, check_main_grad

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 set before triton kernels are defined")


@pytest.mark.parametrize("zero_groups,tail,transposed_w", [((), 0, False), ((0, 3), 5, True)])
def test_triton_interpreter_fp32(zero_groups, tail, transposed_w):
    # 5 groups of 16-row tiles over 4 programs: tiles of several groups interleave across programs.
    check(70, 24, 40, 5, torch.float32, "cpu", "triton", zero_groups, tail, tol=1e-5, transposed_w=transposed_w)


def test_triton_interpreter_counts_past_rows():
    check_counts_past_rows("cpu", "triton", torch.float32, 1e-5)


@pytest.mark.parametrize("zero_groups,tail", [((), 0), ((0, 3), 5)])
def test_triton_interpreter_main_grad(zero_groups, tail):
    check_main_grad(70, 24, 40, 5, torch.float32, "cpu", "triton", zero_groups, tail, tol=1e-5)
