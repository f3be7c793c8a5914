"""tests/test_torch_func_review.py's checks on the Triton backend under TRITON_INTERPRET=1: ordinary autograd
through the kernels' once-differentiable backwards as before the torch.func change."""
import os

import pytest
import torch
import torch.utils.checkpoint as cp

from turbomoe.nn import MoELayer

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 set before triton kernels are defined")
M, F = 8, 6


def _layer(**kw):
    torch.manual_seed(0)
    layer = MoELayer(M, F, 5, 2, backend="triton", gmm_backend="triton", **kw)
    with torch.no_grad():
        for p in layer.parameters():  # biases (zeros at init) too
            p.add_(torch.randn_like(p), alpha=0.3)
    return layer


def _loss(layer, x):
    out, aux = layer(x)
    return (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum() + aux


def _input_grad(layer, checkpointed: bool):
    torch.manual_seed(1)
    x = torch.randn(7, M, requires_grad=True)
    loss = cp.checkpoint(_loss, layer, x, use_reentrant=False) if checkpointed else _loss(layer, x)
    return torch.autograd.grad(loss, x, create_graph=True)[0].detach()


@pytest.mark.parametrize("kw", [{}, dict(capacity_factor=1.0, activation="gelu", bias=True)], ids=["dropless", "capacity"])
def test_create_graph_through_non_reentrant_checkpoint(kw):
    """create_graph=True through checkpoint(use_reentrant=False): the kernels' backwards unpacked their saved
    tensors a second time (to tie their outputs to them), which the checkpoint refuses."""
    layer = _layer(**kw)
    assert torch.equal(_input_grad(layer, True), _input_grad(layer, False))
