"""torch.compile(fullgraph=True) through MoELayer and the DeepSpeed drop-in on the Triton kernels
(gating ops and grouped GEMM; natively on a GPU, under TRITON_INTERPRET=1 on the CPU): one graph,
no break, forward and backward equal to eager; and torch.library.opcheck of the grouped GEMM and
SwiGLU custom ops."""
import os

import pytest
import torch

from conftest import HAS_CUDA

if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU, or TRITON_INTERPRET=1 on the CPU (as CI runs this file)",
                allow_module_level=True)

from compile_cases import assert_compiles_like_eager, assert_exports_dynamic, ds_layer, moe_layer  # noqa: E402
from turbomoe import custom_ops  # noqa: E402
from turbomoe.autograd.grouped_gemm import row_offsets  # noqa: E402

DEV = "cuda" if HAS_CUDA else "cpu"
F32 = torch.float32
KERNEL_OPS = ("topk_gating", "assign_slots", "scatter_tokens", "gather_tokens")


@pytest.mark.parametrize("capacity_factor", [None, 1.25])
def test_moe_layer_compiles_on_triton(capacity_factor):
    torch.manual_seed(3)
    layer = moe_layer("triton", capacity_factor, F32, device=DEV)
    assert_compiles_like_eager(layer, torch.randn(13, 12, device=DEV), rtol=1e-6, atol=1e-6,
                               custom_ops=KERNEL_OPS + ("grouped_mm", "swiglu")[:2 if HAS_CUDA else 1])


@pytest.mark.parametrize("capacity_factor", [None, 1.25])
def test_moe_layer_exports_on_triton_with_dynamic_shapes(capacity_factor):
    torch.manual_seed(4)
    assert_exports_dynamic(moe_layer("triton", capacity_factor, F32, device=DEV), DEV)


@pytest.mark.parametrize("k, drop_tokens", [(2, False), (1, True)])
def test_deepspeed_drop_in_compiles_on_triton(k, drop_tokens, monkeypatch):
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("TURBOMOE_BACKEND", "triton")
    monkeypatch.setenv("TURBOMOE_GMM_BACKEND", "triton")
    torch.manual_seed(k)
    assert_compiles_like_eager(ds_layer(k, drop_tokens, F32).to(DEV), torch.randn(9, 12, device=DEV),
                               rtol=1e-6, atol=1e-6, custom_ops=KERNEL_OPS + ("grouped_mm",)[:not drop_tokens])


def test_grouped_mm_and_swiglu_opcheck():
    counts = torch.tensor([4, 0, 9, 1, 3], dtype=torch.int32, device=DEV)  # an empty group, 17 rows
    x = torch.randn(17, 8, device=DEV, requires_grad=True)
    w = torch.randn(5, 8, 16, device=DEV, requires_grad=True)
    for offs in (None, row_offsets(counts)):
        torch.library.opcheck(custom_ops._grouped_mm, (x, w, counts, offs, "triton"))
    torch.library.opcheck(custom_ops._grouped_mm, (x, w.detach(), counts, None, "triton"))  # dx only
    for rows in (7, 0):
        torch.library.opcheck(custom_ops._swiglu, (torch.randn(rows, 2 * 9, device=DEV, requires_grad=True),))
        torch.library.opcheck(custom_ops._swiglu, (torch.randn(rows, 2 * 9, device=DEV, requires_grad=True),
                                                   torch.rand(rows, device=DEV, requires_grad=True)))
