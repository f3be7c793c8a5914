"""The "turbomoe" experts of transformers' Qwen3-MoE and Mixtral on turbomoe's Triton kernels (slots,
scatter, grouped GEMM, gather) on the CPU through the Triton interpreter, against transformers' eager
loop, forward and backward. Run in its own process with TRITON_INTERPRET=1 (scripts/test.sh does)."""
import os

import pytest
import torch

pytest.importorskip("transformers")
from test_transformers_integration import fp32_case, gpt_oss_experts, mixtral_experts, qwen3_experts, run  # noqa: E402

import turbomoe.integrations.transformers as tt  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 set before triton kernels are defined")


@pytest.mark.parametrize("family", [qwen3_experts, mixtral_experts, gpt_oss_experts])
def test_triton_experts_against_eager(family, monkeypatch):
    monkeypatch.setenv("TURBOMOE_BACKEND", "triton")
    monkeypatch.setenv("TURBOMOE_GMM_BACKEND", "triton")
    tt.register()
    experts, x, ids, w = fp32_case(family, 23)
    expected = run(experts, "eager", x, ids, w)
    got = run(experts, "turbomoe", x, ids, w)
    for a, b in zip([*got[:3], *got[3]], [*expected[:3], *expected[3]]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
