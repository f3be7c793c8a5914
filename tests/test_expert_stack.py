"""Stacked expert weights (turbomoe.integrations.expert_stack): weight gradients sent straight into
an optimizer's flat buffers (weight_grad_buffers), or added into the experts' .grad in place when
micro-batches accumulate, against autograd's own gradients."""
import pytest
import torch
from torch import nn

from conftest import PoisonPast, check_rows_past_unread, rel_err
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


def kind_experts(kind, seed, device="cpu", dtype=torch.float64):
    """Packed experts: bias-free SwiGLU (two weight stacks) or Linear-GELU-Linear with biases (two
    weight and two bias stacks)."""
    torch.manual_seed(seed)
    if kind == "swiglu":
        experts = nn.ModuleList([SwiGLUExpert(M, F) for _ in range(E)])
    else:
        experts = nn.ModuleList([nn.Sequential(nn.Linear(M, F), nn.GELU(), nn.Linear(F, M)) for _ in range(E)])
    experts = experts.to(device, dtype)
    pack_expert_params(experts)
    return experts


def micro_batch(kind, experts, layout, seed, fused=False, **backward_kw):
    """One forward and backward of the grouped experts on fresh rows: expert-contiguous rows (an expert
    with none, 3 rows past the groups) or the capacity buffer with two blocks of source ranks -> (x, dy)."""
    gen = torch.Generator().manual_seed(seed)
    w = next(experts.parameters())
    shape = (40, M) if layout == "rows" else (2, E, 5, M)
    x = torch.randn(shape, generator=gen, dtype=torch.float64).to(w).requires_grad_()
    if layout == "rows":
        groups = RowGroups(torch.tensor([9, 0, 20, 8], dtype=torch.int32, device=w.device), x.shape[0], fused)
    else:
        groups = EqualGroups(fused)
    y = grouped_mlp(kind, experts, x, groups)
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(w)
    y.backward(dy, **backward_kw)
    return x, dy


def one_by_one(experts, layout, x, dy):
    """The same micro-batch through each expert module apart (autograd's own accumulation), in float64
    on the CPU."""
    x, dy = x.detach().cpu().double(), dy.cpu().double()
    if layout == "rows":
        rows = torch.split(x[:37], [9, 0, 20, 8])
        torch.cat([e(r) for e, r in zip(experts, rows)]).backward(dy[:37])
    else:
        torch.stack([e(x[:, i]) for i, e in enumerate(experts)], 1).backward(dy)


ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("device,dtype,tol", [("cpu", torch.float64, 1e-12),
                                              pytest.param("cuda", torch.bfloat16, 2e-2, marks=ON_GPU)])
@pytest.mark.parametrize("layout", ["rows", "capacity"])
@pytest.mark.parametrize("kind", ["swiglu", "mlp"])
@pytest.mark.parametrize("fused", [False, True])
def test_accumulating_gradients_added_in_place(grads_in_place_taken, fused, kind, layout, device, dtype, tol):
    """Micro-batches accumulating into .grad: from the second on, each stack's gradient is added into
    its experts' .grad at once, the same tensors; post-accumulate hooks still run for every parameter
    every micro-batch. Without fusion (one add per stack) the bits of autograd's adds per parameter
    (the same experts with a hook on every weight, which keeps autograd's way); with it (the weights'
    gradient added inside the GEMM) rounded once; both equal to autograd's sums one expert at a time
    (float64 on the CPU; on a GPU the bf16 kernels against that)."""
    taken = grads_in_place_taken
    experts, plain, ref = (kind_experts(kind, 5, device, dtype), kind_experts(kind, 5, device, dtype),
                           kind_experts(kind, 5))
    ref.load_state_dict({k: v.double().cpu() for k, v in experts.state_dict().items()})  # bf16's rounding too
    params, plain_params, ref_params = list(experts.parameters()), list(plain.parameters()), list(ref.parameters())
    after = []
    for p, q in zip(params, plain_params):
        p.register_post_accumulate_grad_hook(lambda p: after.append(p))
        q.register_hook(lambda g: None)
    stacks = 2 if kind == "swiglu" else 4
    for i in range(3):
        x, dy = micro_batch(kind, experts, layout, 10 + i, fused)
        micro_batch(kind, plain, layout, 10 + i)
        one_by_one(ref, layout, x, dy)
        if i == 0:
            first = [p.grad for p in params]
        assert len(taken) == stacks * i and len(after) == len(params) * (i + 1)
        assert len(taken.gemm) == (2 * i if fused else 0)  # the two weight stacks' GEMMs
        for p, q, r in zip(params, plain_params, ref_params):
            assert rel_err(p.grad.cpu().double(), r.grad) < tol
            assert fused or torch.equal(p.grad, q.grad)
    assert all(p.grad is g for p, g in zip(params, first))


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph")
def test_gradients_in_place_only_where_autograd_adds_in_place(grads_in_place_taken):
    """Not taken, and every gradient as autograd makes it: for a stack one of whose tensors has a hook
    of its own (it sees its gradient), for autograd.grad and backward(inputs=...) without the
    parameters (.grad untouched), under create_graph (autograd adds out of place), and where the
    .grad tensors are apart in memory or in one buffer at no one stride; taken where they lie in one
    buffer in parameter order."""
    taken = grads_in_place_taken
    experts, ref = kind_experts("mlp", 6), kind_experts("mlp", 6)
    params, ref_params = list(experts.parameters()), list(ref.parameters())
    for i in range(2):
        x, dy = micro_batch("mlp", experts, "rows", 20 + i)
        one_by_one(ref, "rows", x, dy)
    taken.clear()

    def check(want_taken):
        assert len(taken) == want_taken
        taken.clear()
        for p, q in zip(params, ref_params):
            assert rel_err(p.grad, q.grad) < 1e-12
    seen = []
    handle = experts[2][0].weight.register_hook(lambda g: seen.append(g.shape))
    x, dy = micro_batch("mlp", experts, "rows", 30)
    one_by_one(ref, "rows", x, dy)
    handle.remove()
    check(3)  # the other three stacks
    assert seen == [experts[2][0].weight.shape]

    before = [p.grad.clone() for p in params]
    x = torch.randn(40, M, dtype=torch.float64, requires_grad=True)
    y = grouped_mlp("mlp", experts, x, RowGroups(torch.tensor([9, 0, 20, 8], dtype=torch.int32), 40))
    torch.autograd.grad(y.sum(), [x], retain_graph=True)
    y.sum().backward(inputs=[x], retain_graph=True)
    got = torch.autograd.grad(y.sum(), params)  # the parameters' own: torch raised for the check there
    assert len(taken) == 0 and all(torch.equal(p.grad, b) for p, b in zip(params, before))
    rows = torch.split(x[:37].detach(), [9, 0, 20, 8])
    want = torch.autograd.grad(torch.cat([e(r) for e, r in zip(ref, rows)]).sum(), ref_params)
    assert all(rel_err(g, w) < 1e-12 for g, w in zip(got, want))

    x, dy = micro_batch("mlp", experts, "rows", 31, create_graph=True)
    one_by_one(ref, "rows", x, dy)
    check(0)

    for p in params:  # each .grad its own tensor
        p.grad = p.grad.clone()
    x, dy = micro_batch("mlp", experts, "rows", 32)
    one_by_one(ref, "rows", x, dy)
    check(0)

    def one_buffer(order):  # the .grad as views of one flat buffer, parameters in the given order
        flat = torch.cat([p.grad.reshape(-1) for p in order])
        offset = 0
        for p in order:
            p.grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
    one_buffer(params[::-1])  # experts in reverse order: the stacks' .grad at no one stride
    x, dy = micro_batch("mlp", experts, "rows", 33)
    one_by_one(ref, "rows", x, dy)
    check(0)
    one_buffer(params)  # in parameter order, as an optimizer's flat gradients: every stack
    x, dy = micro_batch("mlp", experts, "rows", 34)
    one_by_one(ref, "rows", x, dy)
    check(4)


@pytest.mark.parametrize("device,dtype", [("cpu", torch.float64), pytest.param("cuda", torch.bfloat16, marks=ON_GPU)])
@pytest.mark.parametrize("kind", ["swiglu", "mlp"])
@pytest.mark.parametrize("fused", [False, True])
def test_rows_past_the_counts_never_reach_the_results(monkeypatch, fused, kind, device, dtype):
    """Every grouped GEMM's input, output and their gradients NaN past the counts (the 3 rows no route
    fills), micro-batches accumulating: the routed rows' outputs and input gradients and every
    parameter's gradient the bits of the run without, finite (2026-11-29: the biases' gradients took
    NaN from there, bias_act)."""
    counts = torch.tensor([9, 0, 20, 8], dtype=torch.int32, device=device)

    def make():
        experts = kind_experts(kind, 5, device, dtype)
        return experts, lambda x: grouped_mlp(kind, experts, x, RowGroups(counts, x.shape[0], fused))

    def poison(monkeypatch):
        matmul = RowGroups.matmul

        def poisoned(self, x_RK, w_ENK, blocks=None):
            n = int(self.counts_E.sum())
            return PoisonPast.apply(matmul(self, PoisonPast.apply(x_RK, n), w_ENK, blocks), n)
        monkeypatch.setattr(RowGroups, "matmul", poisoned)
    check_rows_past_unread(monkeypatch, make, poison, M, device, dtype)
