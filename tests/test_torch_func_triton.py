"""tests/test_torch_func.py's checks on the Triton backend and grouped GEMM: the kernels on the CPU
under TRITON_INTERPRET=1 (CI runs this file in a process of its own). torch.func.grad and vjp run
the kernels on the tensors beneath its wrappers, with autograd's bits; vmap (so jacrev), forward
mode and a second derivative refuse, saying so."""
import os

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import functional_call, grad, jacrev, jvp, vmap

from test_torch_func import (DS_CASES, LAYER_CASES, MEGATRON_CASES, OPS, M, _weighted, check_batched_gradients_raise,
                             check_deepspeed, check_idle_expert, check_layer, check_megatron, check_op, check_per_sample,
                             moe_layer, op_case)
from turbomoe import ops

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 set before triton kernels are defined")


@pytest.mark.parametrize("gmm_backend", ["triton", "reference"])
@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_layer(case, gmm_backend):
    check_layer(case, "triton", gmm_backend)


def test_layer_expert_with_no_tokens():
    check_idle_expert("triton", "triton")


def test_per_sample_gradients():
    check_per_sample("triton", "triton")


@pytest.mark.parametrize("name", [n for n in OPS if n != "swiglu"])  # (SwiGLU's kernel: CUDA tensors only)
def test_op(name):
    check_op(*op_case(name, "triton", "triton"))


@pytest.mark.parametrize("case", list(DS_CASES))
def test_deepspeed_drop_in(case, grads_in_place_taken, monkeypatch):
    monkeypatch.setenv("TURBOMOE_BACKEND", "triton")
    check_deepspeed(case, grads_in_place_taken)


@pytest.mark.parametrize("case", list(MEGATRON_CASES))
def test_megatron_layer(case, monkeypatch):
    monkeypatch.setenv("TURBOMOE_BACKEND", "triton")
    check_megatron(case)


def _layer_and_x():
    torch.manual_seed(7)
    return moe_layer(5, 2, "triton", "triton"), torch.randn(7, M)


def test_vmap_and_jacrev_raise_clearly():
    """vmap over a kernel's forward, and jacrev's vmap over a kernel's backward, name the Function."""
    layer, x = _layer_and_x()
    batched = "cannot batch turbomoe's {}: its kernels take one sample's tensors. Loop over the samples"
    with pytest.raises(RuntimeError, match=batched.format("Fp32Logits")):  # the router's logits come first
        vmap(lambda x: layer(x)[0])(x[None].expand(3, -1, -1))
    with pytest.raises(RuntimeError, match=batched.format("TopKGating")):
        vmap(lambda l: ops.topk_gating(l, 2, backend="triton").scores)(torch.randn(3, 7, 5))
    with pytest.raises(RuntimeError, match=batched.format(r"GatherTokens\.backward")):  # the last op runs first
        jacrev(lambda x: layer(x)[0])(x)
    with pytest.raises(RuntimeError, match=batched.format(r"TopKGating\.backward")):
        jacrev(lambda l: ops.topk_gating(l, 2, backend="triton").scores)(torch.randn(7, 5))


def test_batched_gradients_raise_clearly():
    check_batched_gradients_raise(*_layer_and_x())


def test_forward_mode_raises_clearly():
    layer, x = _layer_and_x()
    with pytest.raises(RuntimeError, match="must implement the jvp function"):
        jvp(lambda x: layer(x)[0], (x, ), (torch.ones_like(x), ))
    with pytest.raises(RuntimeError, match="must implement the jvp function"):
        with fwAD.dual_level():
            ops.topk_gating(fwAD.make_dual(torch.randn(7, 5), torch.ones(7, 5)), 2, backend="triton")


def test_second_derivative_through_kernels_raises():
    """grad of grad: the kernels' backward under torch.func is once differentiable, as under autograd."""
    layer, x = _layer_and_x()
    params = {n: p.detach() for n, p in layer.named_parameters()}

    def penalty(p):  # a gradient penalty: the squared norm of the input's gradient
        gx = grad(lambda x: _weighted(functional_call(layer, p, (x, ))[0]))(x)
        return gx.square().sum()
    with pytest.raises(RuntimeError, match="turbomoe's kernels cannot differentiate twice"):
        grad(penalty)(params)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph")
def test_fused_accumulation_stays_out_of_create_graph(grads_in_place_taken):
    """Ordinary autograd under create_graph=True (which torch.func always runs): the experts' weight
    gradients are not added into their .grad inside the Triton GEMM (autograd adds out of place there),
    as they were: the kernels' backward runs under no_grad, where the add's own check saw none."""
    pytest.importorskip("deepspeed")
    from turbomoe.integrations import deepspeed as tds
    kw = dict(hidden_size=M, num_experts=5, k=2, min_capacity=0, drop_tokens=False)
    torch.manual_seed(0)
    plain = tds.MoE(expert=tds.SwiGLUExpert(M, 6), **kw)
    fused = tds.MoE(expert=tds.SwiGLUExpert(M, 6), fused_grad_accumulation=True, **kw)
    fused.load_state_dict(plain.state_dict())
    for i, create_graph in enumerate((False, True)):  # the second adds into the first's .grad
        x = torch.randn(7, M, generator=torch.Generator().manual_seed(i))
        for layer in (plain, fused):
            torch.manual_seed(5)  # the sampled second expert's draws
            out, l_aux, _ = layer(x)
            (out.square().sum() + l_aux).backward(create_graph=create_graph)
    assert not grads_in_place_taken.gemm
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(fused.parameters(), plain.parameters()))
