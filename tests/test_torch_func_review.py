"""Review of the torch.func change (setup_context, the saved-tensor tie of once_differentiable): ordinary
autograd around turbomoe's Functions as before. On the reference backend; the DeepSpeed drop-in's
capacity path runs once-differentiable batched GEMMs on every backend."""
import pytest
import torch
import torch.utils.checkpoint as cp
from torch import nn

M, F = 8, 6


def _drop_in(expert: str):
    pytest.importorskip("deepspeed")
    from turbomoe.integrations import deepspeed as tds
    torch.manual_seed(0)
    make = {"mlp": lambda: nn.Sequential(nn.Linear(M, F), nn.GELU(), nn.Linear(F, M)),
            "swiglu": lambda: tds.SwiGLUExpert(M, F)}
    layer = tds.MoE(hidden_size=M, expert=make[expert](), num_experts=5, k=2, min_capacity=0)
    with torch.no_grad():
        for p in layer.parameters():  # each expert its own weights
            p.add_(torch.randn_like(p), alpha=0.3)
    return layer


def _loss(layer, x):
    out = layer(x)[0]
    return (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()


def _input_grad(layer, checkpointed: bool):
    torch.manual_seed(1)
    x = torch.randn(7, M, requires_grad=True)
    loss = cp.checkpoint(_loss, layer, x, use_reentrant=False) if checkpointed else _loss(layer, x)
    return torch.autograd.grad(loss, x, create_graph=True)[0].detach()


@pytest.mark.parametrize("expert", ["mlp", "swiglu"])
def test_create_graph_through_non_reentrant_checkpoint(expert, monkeypatch):
    """A first-order gradient with create_graph=True through checkpoint(use_reentrant=False): a kernel
    backward unpacked its saved tensors twice (once more to tie its outputs to them), which the
    checkpoint's hooks refuse ("Unpack is being triggered for a tensor that was already unpacked once")."""
    monkeypatch.setenv("TURBOMOE_BACKEND", "reference")
    layer = _drop_in(expert)
    assert torch.equal(_input_grad(layer, True), _input_grad(layer, False))
