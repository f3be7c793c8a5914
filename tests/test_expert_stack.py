"""Stacked expert weights (turbomoe.integrations.expert_stack): weight gradients sent straight into
an optimizer's flat buffers (weight_grad_buffers), against autograd's own gradients."""
import pytest
import torch
from torch import nn

from turbomoe.integrations.deepspeed_experts import SwiGLUExpert, grouped_mlp
from turbomoe.integrations.expert_stack import EqualGroups, RowGroups, pack_expert_params, weight_grad_buffers

E, M, F = 4, 16, 24


def experts_and_rows(seed, counts=(9, 0, 20, 8)):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    experts = nn.ModuleList([SwiGLUExpert(M, F) for _ in range(E)])
    pack_expert_params(experts)
    x = torch.randn(sum(counts) + 3, M, generator=gen)  # 3 rows past the groups: no expert's
    return experts, x, torch.tensor(counts, dtype=torch.int32)


def flat_buffers(params, fill):
    """One flat buffer in parameter order (as DeepSpeed's BF16_Optimizer keeps fp32 gradients) and
    each parameter's slice of it."""
    flat = fill(sum(p.numel() for p in params))
    views, offset = {}, 0
    for p in params:
        views[p] = flat[offset:offset + p.numel()]
        offset += p.numel()
    return flat, views


def run(experts, x, counts, groups=None):
    x = x.clone().requires_grad_()
    y = grouped_mlp("swiglu", experts, x, groups or RowGroups(counts, x.shape[0]))
    (y[:int(counts.sum())] * torch.linspace(-1, 1, y.shape[1])).sum().backward()
    return x.grad


def with_and_without_buffers(params, run_fn, add, seed):
    """run_fn() -> the input gradient, through autograd and then within weight_grad_buffers over a
    flat buffer that starts random: (dx autograd, dx, autograd's flat gradients, start, flat, views)."""
    dx_want = run_fn()
    want = torch.cat([p.grad.reshape(-1) for p in params])
    for p in params:
        p.grad = None
    start = torch.randn(want.numel(), generator=torch.Generator().manual_seed(seed))
    flat, views = flat_buffers(params, lambda n: start.clone())
    with weight_grad_buffers(views, add):
        dx = run_fn()
    assert all(p.grad is None for p in params)
    return dx_want, dx, want, start, flat, views


@pytest.mark.parametrize("add", [False, True])
def test_weight_grad_buffers_match_autograd(add):
    """Written (one micro-batch a step) or added (accumulation): the buffers hold autograd's gradients
    (plus what they held), the parameters get none, the input gradient is unchanged; an expert with
    no rows gets zeros written, or its slice kept."""
    experts, x, counts = experts_and_rows(3)
    params = list(experts.parameters())
    dx_want, dx, want, start, flat, views = with_and_without_buffers(params, lambda: run(experts, x, counts), add, 4)
    torch.testing.assert_close(dx, dx_want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(flat, want + start if add else want, rtol=1e-5, atol=1e-5)
    for p in (experts[1].w1.weight, experts[1].w3.weight, experts[1].w2.weight):  # expert 1 has no rows
        o = views[p].storage_offset()
        assert torch.equal(views[p], start[o:o + p.numel()] if add else torch.zeros(p.numel()))
    # the context is gone: autograd's gradients again, the buffers untouched
    before = flat.clone()
    run(experts, x, counts)
    assert all(p.grad is not None for p in params) and torch.equal(flat, before)


@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("lead", [(), (2, )])
def test_weight_grad_buffers_take_the_capacity_experts_gradients(add, lead):
    """The capacity layout [.., E, C, M] (batched GEMMs; a leading dim of source ranks as the
    all-to-all leaves it): the buffers hold autograd's gradients (plus what they held), bit for bit
    (the same products, rounded as autograd's, then added), and the parameters get none."""
    experts, _, _ = experts_and_rows(7)
    x = torch.randn(*lead, E, 5, M, generator=torch.Generator().manual_seed(8))
    w_out = torch.randn(*lead, E, 5, M, generator=torch.Generator().manual_seed(9))

    def run_capacity():
        x_ = x.clone().requires_grad_()
        (grouped_mlp("swiglu", experts, x_, EqualGroups()) * w_out).sum().backward()
        return x_.grad
    dx_want, dx, want, start, flat, _ = with_and_without_buffers(list(experts.parameters()), run_capacity, add, 10)
    assert torch.equal(dx, dx_want)
    assert torch.equal(flat, start + want if add else want)


def test_weight_grad_buffers_need_every_parameter_at_one_stride():
    """A parameter of each stack without a buffer, or buffers not lying at one stride: the gradients
    go through autograd as usual and no buffer changes."""
    experts, x, counts = experts_and_rows(5)
    params = list(experts.parameters())
    run(experts, x, counts)
    want = [p.grad.clone() for p in params]
    cases = []
    flat, views = flat_buffers(params, torch.zeros)
    del views[experts[2].w3.weight], views[experts[0].w2.weight]  # one of each stack's
    cases.append((flat, views))
    flat, views = flat_buffers(params[::-1], torch.zeros)  # experts in reverse order: no common stride
    cases.append((flat, views))
    x_ECM = torch.randn(E, 5, M, generator=torch.Generator().manual_seed(1))
    for p in params:
        p.grad = None
    grouped_mlp("swiglu", experts, x_ECM.requires_grad_(), EqualGroups()).sum().backward()
    want_capacity = [p.grad.clone() for p in params]
    for flat, views in cases:
        for groups, grads in ((None, want), (EqualGroups(), want_capacity)):
            for p in params:
                p.grad = None
            with weight_grad_buffers(views, False):
                if groups is None:
                    run(experts, x, counts)
                else:
                    grouped_mlp("swiglu", experts, x_ECM, groups).sum().backward()
            assert torch.equal(flat, torch.zeros_like(flat))
            for p, g in zip(params, grads):
                torch.testing.assert_close(p.grad, g)


def test_weight_grad_buffers_not_reentrant():
    with weight_grad_buffers({}, True):
        with pytest.raises(RuntimeError, match="already active"):
            with weight_grad_buffers({}, True):
                pass
    with weight_grad_buffers({}, True):  # left cleanly
        pass


@pytest.mark.parametrize("lead", [(), (1, ), (2, ), (3, ), (2, 2)])
@pytest.mark.parametrize("C", [0, 1, 7])
def test_equal_groups_run_each_leading_block_in_place(lead, C):
    """x [.., E, C, K] (blocks of rows from each expert-parallel rank, as the all-to-all leaves them):
    expert e's weight on every block's x[.., e], forward and both gradients as the float64 einsum,
    fresh data each case; dw sums the blocks."""
    g = torch.Generator().manual_seed(hash((lead, C)) % 2**31)
    E, K, N = 3, 5, 4
    x = torch.randn(*lead, E, C, K, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(E, N, K, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(*lead, E, C, N, generator=g, dtype=torch.float64)
    y = EqualGroups().matmul(x, w)
    ref = torch.einsum("...eck,enk->...ecn", x, w)
    assert y.shape == ref.shape
    got, want = torch.autograd.grad(y, (x, w), dy), torch.autograd.grad(ref, (x, w), dy)
    for a, b in zip((y, ) + got, (ref, ) + want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
