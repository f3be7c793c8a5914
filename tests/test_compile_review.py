"""torch.compile(fullgraph=True) of MoELayer on the reference backend (float64) where the other compile
tests do not reach: a loss that leaves some outputs without a gradient or hands the layer a
non-contiguous one, activation checkpointing inside the compiled region, and inductor with a capacity over
changing token counts."""
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from turbomoe.nn import MoELayer

D = torch.float64


def grads_of(fn, layer, x):
    """fn's loss, and the input and every parameter gradient it gives (None where none)."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    torch.manual_seed(1)  # the same RTS draw in both runs
    loss = fn(x)
    loss.backward()
    return [loss.detach(), x.grad] + [p.grad for p in layer.parameters()]


def assert_same(got, ref):
    for g, r in zip(got, ref):
        assert (g is None) == (r is None)
        if r is not None:
            torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("loss_of", ["aux", "out_transposed"])
@pytest.mark.parametrize("capacity_factor", [None, 1.25])
def test_partial_and_strided_output_gradients(loss_of, capacity_factor):
    """aux alone (the combine gets no gradient), or the output's gradient transposed (non-contiguous
    into the gather's backward)."""
    torch._dynamo.reset()
    layer = MoELayer(12, 6, 5, 2, capacity_factor=capacity_factor, backend="reference", dtype=D, z_loss_coef=0.1)
    w_MS = torch.randn(12, 13, dtype=D)

    def loss(x_SM):
        out_SM, aux = layer(x_SM)
        return aux if loss_of == "aux" else (out_SM.t() * w_MS).sum()

    x_SM = torch.randn(13, 12, dtype=D)
    ref = grads_of(loss, layer, x_SM)
    assert_same(grads_of(torch.compile(loss, backend="aot_eager", fullgraph=True), layer, x_SM), ref)


@pytest.mark.parametrize("capacity_factor, drop_policy, recompute", [(None, "position", True), (0.5, "rts", False)])
def test_checkpoint_inside_the_compiled_region(capacity_factor, drop_policy, recompute):
    """The custom ops replayed by checkpoint's recompute inside the graph: the same gradients as eager
    (RTS drops the same routes), and the same expert_load. Dynamo refused this (Unsupported) while
    MoELayer.forward assigned a new expert_load tensor, a side effect inside a checkpoint; it now
    writes its buffer in place."""
    torch._dynamo.reset()
    layer = MoELayer(12, 6, 5, 2, capacity_factor=capacity_factor, drop_policy=drop_policy, recompute=recompute,
                     backend="reference", dtype=D).train()

    def loss(x_SM):
        out_SM, aux = checkpoint(layer, x_SM, use_reentrant=False)
        return out_SM.sin().square().sum() + aux

    x_SM = torch.randn(13, 12, dtype=D)
    ref = grads_of(loss, layer, x_SM)
    load_E = layer.expert_load.clone()
    layer.expert_load.zero_()
    assert_same(grads_of(torch.compile(loss, backend="aot_eager", fullgraph=True), layer, x_SM), ref)
    assert torch.equal(layer.expert_load, load_E)


def test_inductor_capacity_over_changing_token_counts():
    """With a capacity, the second token count (dynamic shapes) crashed inductor: the grouped GEMM's
    offsets are a cumsum of the counts, full_like(C) there, which inductor rewrites and cannot with a
    symbolic C. Compiled results equal eager at each count."""
    torch._dynamo.reset()
    layer = MoELayer(12, 6, 5, 2, capacity_factor=1.25, backend="reference", dtype=D)
    compiled = torch.compile(layer, fullgraph=True)
    for S in (13, 17, 29):
        x_SM = torch.randn(S, 12, dtype=D)
        ref = grads_of(lambda x: sum(t.square().sum() for t in layer(x)), layer, x_SM)
        got = grads_of(lambda x: sum(t.square().sum() for t in compiled(x)), layer, x_SM)
        assert_same(got, ref)
