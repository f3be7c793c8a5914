"""Review of the gating ops against DESIGN.md (2026-12-05): errors a caller can act on, and the
Triton backend against the reference on the inputs of those errors' neighbours. Runs natively on
a GPU; on the CPU under TRITON_INTERPRET=1 (set here where no GPU is, before turbomoe's kernels are
defined)."""
import os

import torch

if not torch.cuda.is_available():  # the interpreter is read when kernels are defined: before turbomoe
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU, or TRITON_INTERPRET=1 on the CPU", allow_module_level=True)

from turbomoe import ops  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("with_scores", [True, False])
def test_gather_names_y_when_its_rows_disagree_with_the_slots(backend, with_scores):
    # gather_tokens has no num_rows argument: the error must name y, the buffer whose rows are wrong.
    S, E, k, C = 7, 3, 2, 2
    ids_SK = torch.randint(0, E, (S, k), dtype=torch.int32, device=DEV)
    scores_SK = torch.rand(S, k, device=DEV)
    s = ops.assign_slots(ids_SK, scores_SK, E, capacity=C)
    y_RM = torch.randn(E * C - 1, 4, device=DEV)
    with pytest.raises(ValueError, match=r"y's rows .* 5 disagrees with the Slots' num_rows 6"):
        ops.gather_tokens(y_RM, s, scores_SK if with_scores else None, backend=backend)
    # The right buffer still gathers, the same on both backends.
    y_RM = torch.randn(E * C, 4, device=DEV)
    out = ops.gather_tokens(y_RM, s, scores_SK if with_scores else None, backend=backend)
    want = ops.gather_tokens(y_RM, s, scores_SK if with_scores else None, backend="reference")
    torch.testing.assert_close(out, want)


def _scatter_grad(x_SM, slots_SK, grad_buf_RM, backend):
    x = x_SM.clone().requires_grad_()
    ops.scatter_tokens(x, slots_SK, grad_buf_RM.shape[0], backend=backend).backward(grad_buf_RM)
    return x.grad


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_scatter_backward_sums_in_fp32_and_rounds_once(backend, dtype):
    # DESIGN.md: every reduction in fp32. A token's k buffer gradients summed in fp16 / bf16 round
    # after every add: 1 + seven half-ulps stays 1 that way, where the fp32 sum rounds up.
    if backend == "triton" and dtype == torch.bfloat16 and DEV == "cpu":
        pytest.skip("the interpreter's fp32 -> bf16 cast truncates (test_fuzz_triton.py's note)")
    S, k, M = 64, 8, 16
    half_ulp = 2.0**-11 if dtype == torch.float16 else 2.0**-8
    slots_SK = torch.randperm(S * k, device=DEV).view(S, k).to(torch.int32)
    grad_RM = (torch.randn(S * k, M, device=DEV) * 0.1).to(dtype)
    grad_RM[slots_SK[0].long()] = half_ulp  # token 0: 1 + 7 half-ulps, a tie the fp32 sum breaks upward
    grad_RM[slots_SK[0, 0].long()] = 1.0
    grad_SKM = grad_RM[slots_SK.long()]
    want_SM = grad_SKM.float().sum(1).to(dtype)
    stepwise_SM = grad_SKM[:, 0]
    for j in range(1, k):
        stepwise_SM = stepwise_SM + grad_SKM[:, j]
    assert not torch.equal(stepwise_SM, want_SM)  # the data tells the two sums apart
    got_SM = _scatter_grad(torch.randn(S, M, device=DEV, dtype=dtype), slots_SK, grad_RM, backend)
    torch.testing.assert_close(got_SM, want_SM, rtol=0, atol=0)
