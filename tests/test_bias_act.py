"""bias_act (turbomoe.autograd.bias_act): act(y + b[expert of row]) over a grouped GEMM's rows, forward
and backward against the reference evaluated in float64. Here the Function's PyTorch form (the CPU's
path) and torch.compile's trace; test_bias_act_triton.py holds its Triton kernels to the same checks."""
import pytest
import torch

from turbomoe.autograd.bias_act import BiasAct, bias_act, bias_act_reference

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float64: 1e-12}
ACTS = ["none", "gelu_tanh", "gelu"]
# (counts, R, N): an empty expert; one expert holding every row with two rows past the counts, and
# two 1024-column blocks; one row each; no rows; one column.
ROW_CASES = [([3, 0, 5, 1], 9, 7), ([0, 11, 0], 13, 1030), ([1] * 9, 9, 33), ([0, 0], 0, 5), ([2, 3], 5, 1)]
# (blocks, G, C, N): the capacity buffer [blocks, G, C, N] (blocks: expert-parallel source ranks); C = 0.
EQUAL_CASES = [(1, 3, 5, 7), (2, 4, 3, 1030), (1, 1, 1, 1), (2, 3, 0, 9), (3, 2, 7, 64)]


def rel_err(a, b):
    return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm().clamp_min(1e-30)).item()


def groups_of(counts, R):
    """Rows in expert order by counts, then R - sum(counts) rows past them (group G)."""
    g = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    return torch.cat([g, torch.full((R - len(g), ), len(counts))])


def torch_form(y, b, g, C, act):
    return BiasAct.apply(y, b, g, C, act, False)


def check(R, N, G, dtype, act, groups_R=None, C=None, fn=torch_form, device="cpu"):
    """fn(y, b, groups_R, C, act) forward and backward against the fp64 reference, fresh random data."""
    gen = torch.Generator().manual_seed(R * 7919 + N * 31 + G + len(act))
    y = (torch.randn(R, N, generator=gen, dtype=torch.float64) * 3).to(device, dtype).requires_grad_()
    b = torch.randn(G, N, generator=gen, dtype=torch.float64).to(device, dtype).requires_grad_()
    dout = torch.randn(R, N, generator=gen, dtype=torch.float64).to(device, dtype)
    g = None if groups_R is None else groups_R.to(device)
    out = fn(y, b, g, C, act)
    out.backward(dout)
    yr, br = (t.detach().double().cpu().requires_grad_() for t in (y, b))
    ref = bias_act_reference(yr, br, groups_R, C, act)
    ref.backward(dout.double().cpu())
    assert out.dtype == dtype and y.grad.dtype == dtype and b.grad.dtype == dtype
    for got, want in ((out, ref), (y.grad, yr.grad), (b.grad, br.grad)):
        if want.numel():
            assert rel_err(got.detach(), want.detach()) < TOL[dtype]
        else:
            assert got.shape == want.shape and not got.abs().sum()
    return out, y.grad, b.grad


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("counts, R, N", ROW_CASES)
def test_row_groups(dtype, act, counts, R, N):
    check(R, N, len(counts), dtype, act, groups_R=groups_of(counts, R))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("blocks, G, C, N", EQUAL_CASES)
def test_equal_groups(dtype, act, blocks, G, C, N):
    check(blocks * G * C, N, G, dtype, act, C=C)


def test_reference_gradcheck():
    """The spec itself, and the Function's PyTorch form, by gradcheck in fp64."""
    y = torch.randn(12, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    g = groups_of([2, 0, 7], 12)
    for act in ACTS:
        assert torch.autograd.gradcheck(lambda y, b: bias_act_reference(y, b, g, None, act), (y, b))
        assert torch.autograd.gradcheck(lambda y, b: torch_form(y, b, g, None, act), (y, b))
        assert torch.autograd.gradcheck(lambda y, b: torch_form(y, b, None, 2, act), (y, b))


def test_no_bias_past_the_groups():
    """Rows past the counts (group G) are zero out and pass no gradient, to b or to y."""
    y = torch.zeros(4, 3, requires_grad=True)
    b = torch.ones(2, 3, requires_grad=True)
    out = bias_act(y, b, groups_of([1, 1], 4))
    out.sum().backward()
    assert torch.equal(out.detach(), torch.tensor([[1.0] * 3, [1.0] * 3, [0.0] * 3, [0.0] * 3]))
    assert torch.equal(b.grad, torch.ones(2, 3))
    assert torch.equal(y.grad, torch.tensor([[1.0] * 3, [1.0] * 3, [0.0] * 3, [0.0] * 3]))


def check_non_finite_past_the_groups(fn, device, dtype, act):
    """Rows past the counts hold what a grouped GEMM leaves there (any bits: NaN, Inf), and so may
    their output gradient: the grouped rows' output and gradients as with finite rows, zero past them
    (2026-11-29: a one-hot GEMM's 0 x NaN made b's gradient NaN, on a GPU now and then)."""
    counts, R, N = [3, 0, 4], 10, 37
    gen = torch.Generator().manual_seed(len(act) + 7)
    y = torch.randn(R, N, generator=gen, dtype=torch.float64)
    dout = torch.randn(R, N, generator=gen, dtype=torch.float64)
    b = torch.randn(len(counts), N, generator=gen, dtype=torch.float64)
    g = groups_of(counts, R)
    grads = []
    for past in (0.0, float("nan"), float("inf")):
        yp, dp = y.clone(), dout.clone()
        yp[7:, ::2], yp[7:, 1::2], dp[8:] = past, -past, past
        # copy=True: b.to() is b itself in fp64 on the CPU, whose .grad would then hold every run's sum,
        # each run's db the same tensor (compared with itself)
        yt, bt = yp.to(device, dtype).requires_grad_(), b.to(device, dtype, copy=True).requires_grad_()
        out = fn(yt, bt, g.to(device), None, act)
        out.backward(dp.to(device, dtype))
        grads.append((out.detach(), yt.grad, bt.grad))
    for out, dy, db in grads:
        assert torch.isfinite(db).all() and torch.equal(db, grads[0][2])
        assert torch.equal(out[:7], grads[0][0][:7]) and not out[7:].any()
        assert torch.equal(dy[:7], grads[0][1][:7]) and not dy[7:].any()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("act", ACTS)
def test_non_finite_rows_past_the_groups(dtype, act):
    check_non_finite_past_the_groups(torch_form, "cpu", dtype, act)
    check_non_finite_past_the_groups(lambda y, b, g, C, act: bias_act_reference(y, b, g, C, act), "cpu", dtype, act)


@pytest.mark.parametrize("bad, match", [
    (dict(act="relu"), "act must be one of"),
    (dict(groups_R=torch.zeros(6, dtype=torch.int32), rows_per_group=2), "either as groups_R or"),
    (dict(), "either as groups_R or"),
    (dict(rows_per_group=4), "R = blocks x G x C"),
    (dict(rows_per_group=0), "R = blocks x G x C"),
    (dict(groups_R=torch.zeros(5, dtype=torch.int32)), "groups_R must be an int"),
    (dict(groups_R=torch.zeros(6)), "groups_R must be an int"),
    (dict(b=torch.zeros(3, 4)), "y must be"),
    (dict(b=torch.zeros(3, 5, dtype=torch.float64), rows_per_group=2), "share one float dtype"),
])
def test_errors(bad, match):
    kw = dict(y=torch.zeros(6, 5), b=torch.zeros(3, 5))
    kw.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        bias_act(kw.pop("y"), kw.pop("b"), **kw)


def test_autocast_casts_the_bias_as_linear_does():
    """fp32 biases beside 16-bit rows under torch.autocast: the bias in the rows' dtype, its gradient
    back in fp32 (as F.linear's bias there); outside autocast a dtype mismatch is an error."""
    y = torch.randn(6, 5, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(3, 5, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = bias_act(y, b, rows_per_group=2, act="gelu")
    out.float().sum().backward()
    want = bias_act(y.detach(), b.detach().to(torch.bfloat16), rows_per_group=2, act="gelu")
    assert out.dtype == torch.bfloat16 and torch.equal(out.detach(), want)
    assert b.grad.dtype == torch.float32 and y.grad.dtype == torch.bfloat16
    with pytest.raises(TypeError, match="share one float dtype"):
        bias_act(y, b, rows_per_group=2)


def test_compiles_without_graph_breaks():
    """Under torch.compile bias_act traces as the reference's plain ops: the same values, no graph break
    (traced as the Function, its output was zero on torch 2.11)."""
    torch._dynamo.reset()
    g = groups_of([3, 0, 4], 9)
    fn = torch.compile(lambda y, b: bias_act(y, b, g, act="gelu_tanh"), fullgraph=True, backend="aot_eager")
    check(9, 6, 3, torch.float32, "gelu_tanh", groups_R=g, fn=lambda y, b, g, C, act: fn(y, b))
