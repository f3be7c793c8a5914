"""MoELayer on its Triton path (gating ops, grouped GEMM) on the CPU through the Triton interpreter.

Run in its own process with TRITON_INTERPRET=1 in the environment:
    TRITON_INTERPRET=1 pytest tests/test_nn_layer_triton.py
"""
import os

import pytest
import torch

from test_nn_layer import check_expert_load_modified_before_backward, check_no_expert_output_kept, compare
from turbomoe.nn import MoELayer

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 set before triton kernels are defined")


@pytest.mark.parametrize("kw", [dict(), dict(capacity_factor=0.75, bias=True, k=1)])
def test_triton_path_against_loop(kw):
    torch.manual_seed(6)
    kw = dict(kw)
    k = kw.pop("k", 2)
    layer = MoELayer(32, 48, 5, k, backend="triton", gmm_backend="triton", **kw)
    compare(layer, torch.randn(40, 32), 1e-5, 1e-4)


def test_triton_path_keeps_no_expert_output():
    check_no_expert_output_kept("triton", "cpu", "triton")


@pytest.mark.parametrize("kw", [dict(capacity_factor=0.75), dict(recompute=True)])
def test_triton_path_expert_load_can_be_reduced_before_backward(kw):
    check_expert_load_modified_before_backward("triton", "triton", kw)
