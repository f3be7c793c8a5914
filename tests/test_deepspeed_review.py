"""The DeepSpeed drop-in's gate against stock's TopKGate at edges the fidelity tests do not reach:
a saturated router at unsampled top-2, capacity arguments in the types stock takes, a float
used_token, an empty batch through the rebuilt l_aux, top-1's random token selection and the random
draws it leaves to the rest of the model. float64 layers (stock's router runs in fp32 either way),
single process."""
import numpy as np
import pytest
import torch

pytest.importorskip("deepspeed")
from deepspeed.moe.sharded_moe import _capacity  # noqa: E402

from conftest import rel_err  # noqa: E402
from test_deepspeed_fidelity import E, M, assert_same, make_pair, run  # noqa: E402

D = torch.float64


def test_unsampled_top2_saturated_router_matches_stock():
    """top2_2nd_expert_sampling=False: stock's second expert is the argmax of the logits over the
    others. Where the router saturates (logit gaps past ~100) softmax rounds every other expert to 0;
    ranked by probability, ties to the lower id sent all those second routes to expert 0 (or 1),
    which took 17 routes where stock's got 5 and dropped other tokens' routes at its capacity."""
    stock, turbo = make_pair(dtype=D, k=2, capacity_factor=1.0, top2_2nd_expert_sampling=False)
    x_SM = torch.randn(32, M, dtype=D)
    x_SM[:16] *= 1200  # half the tokens saturate the router
    with torch.no_grad():
        probs_SE = torch.softmax(x_SM.float() @ stock.deepspeed_moe.gate.wg.weight.float().t(), 1)
    assert ((probs_SE[:16] == 0).sum(1) >= 2).all()  # ties among the candidates for second place
    want, got = run(stock, x_SM), run(turbo, x_SM)
    assert (want[2] > 8).any()  # C = 8: an expert over capacity, so the second routes' experts matter
    assert_same(want, got, 1e-5)


@pytest.mark.parametrize("kw", [
    dict(capacity_factor=np.float32(0.7)),
    dict(capacity_factor=torch.tensor(0.7)),
    dict(capacity_factor=0.3, min_capacity=np.int64(7)),
    dict(capacity_factor=0.3, min_capacity=6.7),  # truncated to 6, as stock's .to(int64)
    dict(capacity_factor=0.0, min_capacity=4),  # C = min_capacity
    dict(capacity_factor=-1.0, min_capacity=3),
])
@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")  # stock's torch.tensor(a tensor)
def test_capacity_arguments_stock_takes(kw, k):
    """Stock builds C with torch.tensor(capacity_factor) and torch.tensor(min_capacity): numpy and
    tensor scalars, a float min_capacity and a factor <= 0 all work there. The drop-in raised
    TypeError / ValueError at the first forward."""
    stock, turbo = make_pair(dtype=D, k=k, **kw)
    x_SM = torch.randn(32, M, dtype=D)
    want, got = run(stock, x_SM), run(turbo, x_SM)
    assert_same(want, got, 1e-5)
    factor, min_capacity = kw["capacity_factor"], kw.get("min_capacity", 0)
    C = _capacity(torch.empty(32, E), torch.as_tensor(factor * k), torch.tensor(min_capacity))
    assert (got[2] > C).any()  # capacity binds


def test_capacity_factor_not_finite_raises():
    _, turbo = make_pair(dtype=D, k=2, capacity_factor=float("nan"))
    with pytest.raises(ValueError, match="capacity_factor"):
        turbo(torch.randn(8, M, dtype=D))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.bool])
def test_used_token_counts_dtype_as_stock(dtype):
    """Stock's top-1 multiplies its one-hot mask by used_token: a float used_token gives float
    exp_counts (int64 before, whatever used_token was)."""
    stock, turbo = make_pair(dtype=D, k=1, capacity_factor=float(E))
    S = 48
    x_SM = torch.randn(S, M, dtype=D)
    used_S = (torch.randperm(S) % 3 != 0).to(dtype)
    want, got = run(stock, x_SM, used_token=used_S), run(turbo, x_SM, used_token=used_S)
    assert_same(want, got, 1e-5)
    assert got[2].sum() == int(used_S.sum())


@pytest.mark.parametrize("kw, used", [(dict(noisy_gate_policy="RSample"), False), ({}, True)])
def test_empty_batch_l_aux_is_zero_on_rebuilt_path(kw, used):
    """S = 0 gives l_aux 0 (tests/test_deepspeed_fidelity.py::test_empty_batch); with RSample or
    used_token the drop-in rebuilds l_aux, and that mean over no tokens was NaN."""
    _, turbo = make_pair(dtype=D, k=1, **kw)
    out, l_aux, counts, dx, grads = run(turbo, torch.randn(0, M, dtype=D), used_token=torch.ones(0) if used else None)
    assert out.shape == (0, M) and l_aux.item() == 0.0 and int(counts.sum()) == 0
    assert all(torch.isfinite(g).all() for g in grads.values())


@pytest.mark.parametrize("kw", [dict(), dict(noisy_gate_policy="RSample"), dict(use_residual=True)])
@pytest.mark.parametrize("used", [False, True])
def test_random_token_selection_keeps_stocks_tokens(kw, used):
    """use_rts (stock's default): stock keeps, of an over-full expert's tokens, those of the largest
    uniforms [S, E] it draws each forward. The drop-in kept a hashed subset seeded from one CPU draw:
    other tokens than stock's for the same seed (the outputs differed by ~50%)."""
    stock, turbo = make_pair(dtype=D, k=1, capacity_factor=0.5, **kw)
    S = 64
    x_SM = torch.randn(S, M, dtype=D) + 0.5  # skewed router: over-full experts
    used_S = (torch.randperm(S) % 4 != 0).long() if used else None
    want, got = run(stock, x_SM, used_token=used_S), run(turbo, x_SM, used_token=used_S)
    C = _capacity(torch.empty(S, E), torch.tensor(0.5), torch.tensor(0))
    assert (got[2] > C).any()  # something is dropped
    assert_same(want, got, 1e-5)


@pytest.mark.parametrize("kw", [dict(), dict(noisy_gate_policy="RSample"), dict(noisy_gate_policy="Jitter"),
                                dict(drop_tokens=False)])
def test_random_draws_follow_stocks_stream(kw):
    """k = 1 with use_rts (stock's defaults), nothing dropped: stock draws S x E uniforms every forward
    (eval and dropless too), the drop-in drew one int. So torch's generator moved on differently: from
    the second step RSample's and Jitter's noise differed from stock's (other routes), and any later
    draw in the model (dropout) differed from stock's from the first."""
    stock, turbo = make_pair(dtype=D, k=1, capacity_factor=float(E), **kw)
    xs_SM = [torch.randn(48, M, dtype=D) for _ in range(3)]
    for train in (True, False):
        seen = []
        for layer in (stock, turbo):
            layer.train(train)
            torch.manual_seed(0)
            outs = [layer(x_SM)[0] for x_SM in xs_SM]
            seen.append((outs, torch.rand(4)))  # the model's next draw, as a dropout after the layer
        for want, got in zip(seen[0][0], seen[1][0]):
            assert rel_err(got, want) < 1e-5
        assert torch.equal(seen[0][1], seen[1][1])
