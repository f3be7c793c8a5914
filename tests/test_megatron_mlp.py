"""The grouped path for Megatron's ParallelMLP experts (turbomoe/integrations/megatron_mlp.py) against
the one-by-one path (stock DeepSpeed's Experts calling each expert), on one rank.

The experts are tests/megatron_parallel_mlp.py's stand-in for Megatron-DeepSpeed's ParallelMLP, on
megatron-core's real Column/RowParallelLinear (a gloo group of one rank: no expert tensor
parallelism, as Megatron-DeepSpeed's default). Tensor parallelism over two ranks:
tests/test_megatron_mlp_tp.py. Forward and backward in float64 on fresh random data.
"""
import copy
import os
import tempfile

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("megatron.core")
import torch.distributed as dist  # noqa: E402
from deepspeed.moe.experts import Experts  # noqa: E402
import deepspeed.moe.layer as ds_layer  # noqa: E402

from conftest import rel_err  # noqa: E402
from megatron_parallel_mlp import ParallelMLP  # noqa: E402
from turbomoe.integrations import deepspeed as tds  # noqa: E402
from turbomoe.integrations.deepspeed_experts import fast_path_applies, fast_path_kind, run_experts  # noqa: E402

M, F = 12, 10
ACTS = ["bias_gelu", "gelu", "swiglu", "squared_relu"]


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    """megatron-core's linears need a process group: one gloo rank, removed after this module."""
    if dist.is_initialized():
        yield
        return
    path = tempfile.mktemp(prefix="turbomoe_gloo_")
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        if os.path.exists(path):
            os.remove(path)


def expert(act="bias_gelu", add_bias=True, **kw):
    return ParallelMLP(M, F, act=act, add_bias=add_bias, tp_group=dist.group.WORLD, **kw)


def forward_backward(fn, x, params):
    x = x.detach().clone().requires_grad_()
    y = fn(x)
    g = torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(3))  # not _like: y may be strided
    grads = torch.autograd.grad((y * g).sum(), [x] + params, allow_unused=True)
    return [y] + [torch.zeros_like(p) if d is None else d for d, p in zip(grads, [x] + params)]


# Megatron's fused bias-GELU needs the bias (ParallelMLP asserts add_bias).
@pytest.mark.parametrize("act,add_bias", [(a, b) for a in ACTS for b in (True, False) if b or a != "bias_gelu"])
@pytest.mark.parametrize("G,E,C", [(1, 3, 5), (2, 4, 1), (1, 5, 0)])
def test_grouped_matches_one_by_one(act, add_bias, G, E, C):
    torch.manual_seed(G * 100 + E * 10 + C)
    experts = Experts(expert(act, add_bias), num_local_experts=E)
    for p in experts.parameters():  # each expert its own weights (deepcopies start equal)
        with torch.no_grad():
            p.normal_(std=0.3)
    assert fast_path_kind(list(experts.deepspeed_experts)) == "megatron"
    tds.pack_expert_params(experts.deepspeed_experts)
    params = list(experts.parameters())
    x = torch.randn(G, E, C, M, dtype=torch.float64)
    assert fast_path_applies(experts, "megatron", x)
    stock = forward_backward(lambda t: experts(t.reshape(G, E * C, M)).reshape(G, E, C, M), x, params)
    turbo = forward_backward(lambda t: run_experts(experts, "megatron", t), x, params)
    names = ["out", "dx"] + [n for n, _ in experts.named_parameters()]
    for name, a, b in zip(names, turbo, stock):
        assert a.shape == b.shape, name
        assert rel_err(a, b) < 1e-12, (name, rel_err(a, b))


def test_not_understood_runs_one_by_one():
    """Experts the grouped path does not know: recognised as None, so the layer runs them as stock does."""
    assert fast_path_kind([expert(sequence_parallel=False), expert()]) == "megatron"
    assert fast_path_kind([expert("gelu"), expert("swiglu")]) is None  # two different shapes
    e = expert("gelu")
    e.activation_func = torch.tanh  # not one of Megatron's activations
    assert fast_path_kind([e]) is None
    e = expert()
    e.dense_h_to_4h.gradient_accumulation_fusion = True  # writes weight gradients into main_grad
    assert fast_path_kind([e]) is None
    e = expert()
    e.dense_h_to_4h.gather_output = True
    assert fast_path_kind([e]) is None
    e = expert()
    del e.dense_4h_to_h.sequence_parallel  # an attribute of the contract missing
    assert fast_path_kind([e]) is None

    class Subclass(ParallelMLP):  # its own forward: the contract may not hold
        def forward(self, x):
            out, bias = super().forward(x)
            return out * 2, bias

    assert fast_path_kind([Subclass(M, F, tp_group=dist.group.WORLD)]) is None


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("act", ["bias_gelu", "swiglu"])
def test_accumulated_gradients_match_one_by_one(grads_in_place_taken, act, fused):
    """Micro-batches accumulating into .grad (two blocks of source ranks): from the second on, the grouped
    path adds each weight's and bias's stacked gradient into the experts' .grad in place (with fusion,
    the weights' inside the GEMM), and the sums equal the one-by-one path's."""
    taken = grads_in_place_taken
    torch.manual_seed(11)
    experts = Experts(expert(act), num_local_experts=4)
    for p in experts.parameters():
        with torch.no_grad():
            p.normal_(std=0.3)
    stock = copy.deepcopy(experts)
    tds.pack_expert_params(experts.deepspeed_experts)
    gen = torch.Generator().manual_seed(12)
    for i in range(3):
        x = torch.randn(2, 4, 3, M, dtype=torch.float64, generator=gen)
        dy = torch.randn(2, 4, 3, M, dtype=torch.float64, generator=gen)
        run_experts(experts, "megatron", x, fused).backward(dy)
        stock(x.reshape(2, 12, M)).reshape(2, 4, 3, M).backward(dy)
        assert len(taken) == 4 * i and len(taken.gemm) == (2 * i if fused else 0)  # two weights, two biases
    for (name, a), b in zip(experts.named_parameters(), stock.parameters()):
        assert rel_err(a.grad, b.grad) < 1e-12, name


def make_layers(kw, act="bias_gelu"):
    torch.manual_seed(7)
    kw = dict(hidden_size=M, num_experts=5, min_capacity=0, **kw)
    stock = ds_layer.MoE(expert=expert(act), **kw).double()  # the residual MLP and coefficient too
    for p in stock.parameters():
        with torch.no_grad():
            p.normal_(std=0.3)
    turbo = tds.MoE(expert=expert(act), **kw).double()
    turbo.load_state_dict(stock.state_dict())
    return stock, turbo


@pytest.mark.parametrize("kw", [dict(k=2, capacity_factor=1.5), dict(k=2, capacity_factor=0.5),
                                dict(k=2, drop_tokens=False), dict(k=1, drop_tokens=False, use_residual=True)],
                         ids=["top2_capacity", "top2_drops", "top2_dropless_rows", "top1_dropless_residual"])
def test_layer_matches_stock(kw):
    """Megatron-DeepSpeed's MoE(hidden, ParallelMLP, ...) both ways: output, l_aux, counts, input and
    every parameter's gradient; the state dict keeps stock's keys and values (per-expert files)."""
    stock, turbo = make_layers(kw)
    assert turbo.deepspeed_moe.expert_fast_path == "megatron"
    assert list(turbo.state_dict()) == list(stock.state_dict())
    for (n, a), b in zip(stock.state_dict().items(), turbo.state_dict().values()):
        assert a is None and b is None or torch.equal(a, b), n
    x = torch.randn(3, 7, M, dtype=torch.float64)
    results = []
    for layer in (stock, turbo):
        xi = x.clone().requires_grad_()
        torch.manual_seed(5)
        out, l_aux, counts = layer(xi)
        (out.square().sum() + l_aux).backward()
        results.append((out, l_aux, counts, xi.grad, {n: p.grad for n, p in layer.named_parameters()}))
    (o1, l1, c1, dx1, g1), (o2, l2, c2, dx2, g2) = results
    assert torch.equal(c1, c2)
    # The experts run in float64; stock's gate (and so the combine weights) in float32.
    for name, a, b in [("out", o2, o1), ("l_aux", l2, l1), ("dx", dx2, dx1)]:
        assert rel_err(a, b) < 1e-5, name
    assert g1.keys() == g2.keys()
    for n in g1:
        if g1[n] is None:
            assert g2[n] is None or not g2[n].any(), n
        else:
            assert rel_err(g2[n], g1[n], floor=1e-12) < 1e-5, n
    # After training steps, the packed parameters still save under stock's names.
    stock.load_state_dict(turbo.state_dict())
