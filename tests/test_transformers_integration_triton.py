"""The "turbomoe" experts of transformers' Qwen3-MoE and Mixtral on turbomoe's Triton kernels (slots,
scatter, grouped GEMM, gather) on the CPU through the Triton interpreter, against transformers' eager
loop, forward and backward; routes dropped to id E and an fp16 input into fp32 experts. Run in its own
process with TRITON_INTERPRET=1 (scripts/test.sh does)."""
import os

import pytest
import torch

pytest.importorskip("transformers")
from test_transformers_integration import (check_gradient_checkpointing, fp32_case, gpt_oss_experts,  # noqa: E402
                                           mixtral_experts, qwen3_experts, run)

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


def test_triton_gradient_checkpointing(monkeypatch):
    monkeypatch.setenv("TURBOMOE_BACKEND", "triton")
    monkeypatch.setenv("TURBOMOE_GMM_BACKEND", "triton")
    tt.register()
    check_gradient_checkpointing(torch.float32, 1e-5)


@pytest.mark.parametrize("family", [qwen3_experts, gpt_oss_experts])
def test_triton_dropped_routes_and_fp16_input_into_fp32_experts(family, monkeypatch):
    """Routes to id E (transformers' expert-parallel sentinel, weight 0) leave rows past the counts, which
    GPT-OSS's bias kernel must skip; and an fp16 input into fp32 experts (a projection under autocast) runs
    in the weights' dtype, as transformers' grouped_mm does (the grouped GEMM raised on the mixed dtypes).
    Expected: eager on the same routes sent to expert 0 with weight 0, whose weight gradient is then 0."""
    monkeypatch.setenv("TURBOMOE_BACKEND", "triton")
    monkeypatch.setenv("TURBOMOE_GMM_BACKEND", "triton")
    tt.register()
    experts, x, ids, w = fp32_case(family, 17, seed=8)
    x = x.half()
    dropped = torch.zeros_like(ids, dtype=torch.bool)
    dropped[::3, -1] = True
    dropped[4] = True  # a token routed nowhere
    w = w.masked_fill(dropped, 0)
    expected = run(experts, "eager", x.float(), ids.masked_fill(dropped, 0), w)
    expected[2].masked_fill_(dropped, 0)
    got = run(experts, "turbomoe", x, ids.masked_fill(dropped, experts.num_experts), w)
    assert got[0].dtype == got[1].dtype == torch.float16
    for a, b in zip([*got[:3], *got[3]], [*expected[:3], *expected[3]]):
        assert ((a.float() - b).norm() / b.norm()).item() < 2e-3  # fp16 output and grad_out roundings
        assert not (a[b == 0] != 0).any()  # dropped routes and unused experts: gradients exactly 0
