"""MoELayer(recompute=True) on the Triton kernels (under the interpreter on the CPU, natively on a GPU):
the same bits as without recompute, the rows and activation freed after the forward."""
import os

import pytest
import torch

from conftest import HAS_CUDA
from recompute_cases import CASES, check_recompute

if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU, or TRITON_INTERPRET=1 on the CPU", allow_module_level=True)

DEV = "cuda" if HAS_CUDA else "cpu"


@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[3]])
def test_recompute_same_bits_triton(case):
    check_recompute(*case, torch.float32, DEV, backend="triton")
