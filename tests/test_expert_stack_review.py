"""Review of the grouped ParallelMLP experts (turbomoe/integrations/megatron_mlp.py, expert_stack.py)
against the one-by-one path, float64 on fresh random data: experts changed after the layer checked
them (attributes, which no module assignment tells); skip_bias_add both ways on both linears, odd
sizes, an empty and a hot expert in the dropless rows layout. The experts are
tests/megatron_parallel_mlp.py's stand-in."""
import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("megatron.core")
import torch.distributed as dist  # noqa: E402
from deepspeed.moe.experts import Experts  # noqa: E402

from conftest import rel_err  # noqa: E402
from megatron_parallel_mlp import ParallelMLP  # noqa: E402
from test_megatron_mlp import ACTS, forward_backward, make_layers, one_rank_group  # noqa: E402,F401 (the fixture)
from turbomoe.integrations import deepspeed as tds  # noqa: E402
from turbomoe.integrations.deepspeed_experts import fast_path_kind, grouped_mlp  # noqa: E402
from turbomoe.integrations.expert_stack import RowGroups  # noqa: E402

LAYOUTS = [dict(k=2, capacity_factor=1.5), dict(k=2, drop_tokens=False)]  # the capacity buffer; dropless rows


def check_layers_agree(stock, turbo, seed):
    """One forward and backward of both layers on the same tokens: output, input gradient and every
    parameter's gradient as test_megatron_mlp's layer test compares them (stock's gate runs in fp32)."""
    x = torch.randn(3, 7, stock.deepspeed_moe.gate.wg.weight.shape[1], dtype=torch.float64,
                    generator=torch.Generator().manual_seed(seed))
    results = []
    for layer in (stock, turbo):
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        torch.manual_seed(5)
        out, l_aux, _ = layer(xi)
        (out.square().sum() + l_aux).backward()
        results.append([out, xi.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*results):
        assert (a is None) == (b is None)
        if a is not None:
            assert rel_err(b, a, floor=1e-12) < 1e-5


def trained_pair(kw, act="gelu"):
    """Stock's layer and turbomoe's with the same weights, after a first step (turbomoe has then
    checked its experts)."""
    stock, turbo = make_layers(kw, act)
    check_layers_agree(stock, turbo, 0)
    assert turbo.deepspeed_moe.expert_fast_path == "megatron"
    return stock, turbo


@pytest.mark.parametrize("which", ["all", "one"])
@pytest.mark.parametrize("kw", LAYOUTS, ids=["capacity", "dropless_rows"])
def test_activation_set_after_the_check_runs_one_by_one(kw, which):
    """activation_func set on the experts after the layer's first step (an attribute: no module
    assignment tells the layer): the experts run as stock runs them. Before: an activation the grouped
    path does not know on every expert raised TypeError (unpacking the None signature); on one expert,
    expert 0's GELU ran for all (output 0.36 off)."""
    stock, turbo = trained_pair(kw)
    for layer in (stock, turbo):
        experts = layer.deepspeed_moe.experts.deepspeed_experts
        for e in experts if which == "all" else [experts[1]]:  # (a slice would be a new ModuleList: an assignment)
            e.activation_func = torch.tanh
    check_layers_agree(stock, turbo, 1)


@pytest.mark.parametrize("kw", LAYOUTS, ids=["capacity", "dropless_rows"])
def test_forward_set_on_the_instance_is_its_own(kw):
    """A forward set on a linear's instance before the layer's first step (a wrapper's, as accelerate's
    hooks and monkeypatching adapters set it) runs: such experts are not recognised and run one by one.
    Before: the class's math ran instead (output 0.5 off). (Set after the first step, no module
    assignment tells the layer: README, "Megatron-DeepSpeed".)"""
    def scale_output(lin):
        forward = lin.forward
        lin.forward = lambda h: (forward(h)[0] * 2, None)
    e = ParallelMLP(8, 6, tp_group=dist.group.WORLD)
    scale_output(e.dense_4h_to_h)
    assert fast_path_kind([e]) is None
    stock, turbo = make_layers(kw, "gelu")
    for layer in (stock, turbo):
        for e in layer.deepspeed_moe.experts.deepspeed_experts:
            scale_output(e.dense_4h_to_h)
    check_layers_agree(stock, turbo, 2)
    assert turbo.deepspeed_moe.expert_fast_path is None


def odd_experts(act, add_bias, col_skip, row_skip, E, seed):
    """E packed stand-in experts of odd sizes (hidden 7, ffn 5), each its own weights; skip_bias_add
    as given on each linear (column False: the linear adds its bias; row True: the bias is returned,
    and stock's Experts drops it)."""
    torch.manual_seed(seed)
    experts = Experts(ParallelMLP(7, 5, act=act, add_bias=add_bias, tp_group=dist.group.WORLD), num_local_experts=E)
    for p in experts.parameters():
        with torch.no_grad():
            p.normal_(std=0.3)
    for e in experts.deepspeed_experts:
        e.dense_h_to_4h.skip_bias_add, e.dense_4h_to_h.skip_bias_add = col_skip, row_skip
    assert fast_path_kind(list(experts.deepspeed_experts)) == "megatron"
    tds.pack_expert_params(experts.deepspeed_experts)
    return experts


CASES = [(a, b, c, r) for a in ACTS for b in (True, False) for c in (True, False) for r in (False, True)
         if a != "bias_gelu" or (b and c)]  # the fused bias-GELU takes the returned column bias


@pytest.mark.parametrize("act,add_bias,col_skip,row_skip", CASES)
@pytest.mark.parametrize("counts", [(4, 0, 9), (0, 6, 0)], ids=["empty_expert", "one_hot_expert"])
def test_dropless_rows_match_one_by_one(act, add_bias, col_skip, row_skip, counts):
    """The rows layout (RowGroups: expert-contiguous rows, 3 past the counts) against each expert on
    its rows: the routed rows' output, the input gradient and every parameter's."""
    experts = odd_experts(act, add_bias, col_skip, row_skip, len(counts),
                          CASES.index((act, add_bias, col_skip, row_skip)) + 100 * counts[0])
    params = list(experts.parameters())
    routed, R = sum(counts), sum(counts) + 3
    x = torch.randn(R, 7, dtype=torch.float64)
    groups = RowGroups(torch.tensor(counts, dtype=torch.int32), R)

    def routed_rows(y):  # rows past the counts are unspecified: not compared, and pass no gradient
        return torch.cat([y[:routed], torch.zeros_like(y[routed:])])
    turbo = forward_backward(lambda t: routed_rows(grouped_mlp("megatron", experts.deepspeed_experts, t, groups)),
                             x, params)
    stock = forward_backward(lambda t: routed_rows(torch.cat([e(r)[0] for e, r in zip(experts.deepspeed_experts,
                                                                                      t[:routed].split(counts))]
                                                             + [t[routed:]])), x, params)
    for a, b in zip(turbo, stock):
        assert rel_err(a, b) < 1e-12

