"""Review of the torch.func change (setup_context, the saved-tensor tie of once_differentiable): ordinary
autograd around turbomoe's Functions as before. On the reference backend."""
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


@pytest.mark.parametrize("drop_tokens", [True, False], ids=["capacity", "dropless"])
def test_drop_in_differentiates_twice_on_the_reference_backends(drop_tokens, monkeypatch):
    """The drop-in's capacity experts (batched GEMMs) under create_graph: autograd's ops, so with the
    reference backends a second derivative runs, equal to stock DeepSpeed's (experts one by one) in fp64
    (before: it raised, advising the reference backends it was already on). Top-1 in eval: stock draws
    no noise there; the gate's fp32 logits bound the agreement."""
    ds_layer = pytest.importorskip("deepspeed.moe.layer")
    from turbomoe.integrations import deepspeed as tds
    monkeypatch.setenv("TURBOMOE_BACKEND", "reference")
    monkeypatch.setenv("TURBOMOE_GMM_BACKEND", "reference")
    torch.manual_seed(0)
    kw = dict(hidden_size=M, num_experts=5, k=1, min_capacity=0, drop_tokens=drop_tokens)
    stock = ds_layer.MoE(expert=nn.Sequential(nn.Linear(M, F), nn.GELU(), nn.Linear(F, M)), **kw)
    with torch.no_grad():
        for p in stock.deepspeed_moe.experts.parameters():  # each expert its own weights
            p.add_(torch.randn_like(p), alpha=0.3)
    turbo = tds.MoE(expert=nn.Sequential(nn.Linear(M, F), nn.GELU(), nn.Linear(F, M)), **kw)
    turbo.load_state_dict(stock.state_dict())
    x0 = torch.randn(7, M, dtype=torch.float64)
    got = []
    for layer in (turbo.double().eval(), stock.double().eval()):
        x = x0.clone().requires_grad_()
        (g, ) = torch.autograd.grad(layer(x)[0].square().sum(), x, create_graph=True)
        got.append(torch.autograd.grad(g.square().sum(), [x, *layer.deepspeed_moe.experts.parameters()]))
    for a, b in zip(*got):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
    assert got[0][0].abs().sum() > 0


def _compiled_grads(fullgraph: bool):
    from torch.func import functional_call, grad
    from turbomoe.nn import MoELayer
    torch._dynamo.reset()  # (a frame compiled by another test would be reused)
    torch.manual_seed(0)
    layer = MoELayer(M, F, 4, 2, backend="reference", gmm_backend="reference")
    params = {n: p.detach() for n, p in layer.named_parameters()}
    x = torch.randn(5, M)

    def grads(p, x):
        return grad(lambda p: _loss_of(functional_call(layer, p, (x, ))))(p)
    return grads(params, x), lambda: torch.compile(grads, fullgraph=fullgraph, backend="aot_eager")(params, x)


def _loss_of(out):
    y, aux = out
    return (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum() + aux


def test_compiled_torch_func_grad_through_the_layer():
    """torch.compile of a function that calls torch.func.grad through MoELayer: the routing's custom op
    (assign_slots, integer, no autograd) met torch.func's wrappers and failed with torch's misleading
    "must override the setup_context staticmethod". Now dynamo falls back to eager there: its gradients."""
    want, compiled = _compiled_grads(fullgraph=False)
    got = compiled()
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_compiled_torch_func_grad_fullgraph_says_why():
    _, compiled = _compiled_grads(fullgraph=True)
    with pytest.raises(Exception, match="torch.compile does not trace torch.func.grad or vjp through turbomoe"):
        compiled()
