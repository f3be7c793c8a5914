"""Shared checks of the inference ops (index_shuffling, the few-rows GEMM, SparseMoE) against the
reference, used by the CPU, interpreter and GPU tests."""
import torch
import torch.nn.functional as F

from turbomoe import reference
from turbomoe.autograd.swiglu import swiglu_reference

# (T, E, k, score_func, renormalize, shared): T = 0 and 1, T not a multiple of anything, S < E,
# E not a power of two, one expert (E = 1).
SHUFFLE_CASES = [(0, 8, 2, "softmax", False, True), (1, 16, 1, "softmax", True, False), (1, 128, 8, "softmax", True, True),
                 (37, 16, 2, "softmax", True, False), (5, 127, 3, "sigmoid", False, True), (300, 8, 3, "softmax", False, True),
                 (211, 1, 1, "softmax", True, False), (70, 64, 6, "sigmoid", True, False)]


def shuffle_logits(T, E, seed, device="cpu", dtype=torch.float32, hot=False):
    """Fresh random logits; a NaN row and an Inf row where T allows; hot: expert 0 wins every row,
    and the last expert never does (an expert with all tokens and experts with none)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, E, generator=g, dtype=torch.float64)
    if hot:
        x[:, 0] += 100.0
        if E > 1:
            x[:, -1] -= 100.0
    if T > 4:
        x[2, E // 2] = float("nan")
        x[4, 0] = float("inf")
    return x.to(device=device, dtype=dtype)


def check_shuffle(fn, T, E, k, score_func, renormalize, shared, device, dtype=torch.float32, seed=0, hot=False, **kw):
    logits = shuffle_logits(T, E, seed, device, dtype, hot)
    got = fn(logits, k, score_func, renormalize, shared, **kw)
    want = reference.index_shuffling(logits.cpu(), k, score_func, renormalize, shared)
    for name, a, b in zip(want._fields, got, want):
        a = a.cpu()
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        if name == "scores":
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(a, b), (name, a, b)
    again = fn(logits, k, score_func, renormalize, shared, **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, again)), "not deterministic"


def naive_moe(x, logits, w1, w2, k, score_func, renormalize, shared_w1=None, shared_w2=None, prescale=False):
    """The MoE block token by token in float64 from the router's logits (the block's own: bf16 logits
    tie often, and a tie goes to the lower expert id): the oracle of SparseMoE."""
    def probs(v):
        return v.softmax(-1) if score_func == "softmax" else v.sigmoid()

    # Ranked in the kernels' compute dtype: bf16 logits above ~17 all have an fp32 sigmoid of 1.0,
    # a tie (to the lower id, as the spec) that fp64 would break.
    p_rank = probs(logits.to(reference.compute_dtype(logits.dtype)))
    x, p = x.double(), probs(logits.double())
    ids = torch.sort(p_rank, dim=-1, descending=True, stable=True).indices[:, :k]
    sc = p.gather(1, ids)
    if renormalize:
        sc = sc / sc.sum(-1, keepdim=True)

    def mlp(v, a, b):
        return swiglu_reference(v @ a.double()) @ b.double()

    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(k):
            e = ids[t, j]
            out[t] += mlp(x[t] * sc[t, j], w1[e], w2[e]) if prescale else sc[t, j] * mlp(x[t], w1[e], w2[e])
        if shared_w1 is not None:
            out[t] += mlp(x[t], shared_w1, shared_w2)
    return out


# (T, E, k, M, F, score_func, renormalize, shared, prescale)
MOE_CASES = [(1, 8, 2, 24, 16, "softmax", True, False, False), (13, 8, 3, 40, 24, "softmax", False, True, False),
             (5, 16, 1, 32, 16, "sigmoid", False, True, True), (0, 4, 2, 16, 16, "softmax", True, True, False),
             (21, 4, 4, 16, 8, "softmax", True, False, False)]


def moe_weights(E, M, F_, shared, seed, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    sw = (r(M, 2 * F_, scale=M ** -0.5), r(F_, M, scale=F_ ** -0.5)) if shared else (None, None)
    return r(E, M), r(E, M, 2 * F_, scale=M ** -0.5), r(E, F_, M, scale=F_ ** -0.5), sw


def check_moe(T, E, k, M, F_, score_func, renormalize, shared, prescale, mode, device="cpu", dtype=torch.float32,
              tol=1e-4, seed=0, **kw):
    from turbomoe.inference import SparseMoE
    router, w1, w2, (sw1, sw2) = moe_weights(E, M, F_, shared, seed, device, dtype)
    x = torch.randn(T, M, generator=torch.Generator().manual_seed(seed + 1)).to(device=device, dtype=dtype)
    moe = SparseMoE(router, w1, w2, k, score_func, renormalize, sw1, sw2, prescale, mode=mode, **kw)
    out = moe(x)
    want = naive_moe(x.cpu(), F.linear(x, router).cpu(), w1.cpu(), w2.cpu(), k, score_func, renormalize,
                     None if sw1 is None else sw1.cpu(), None if sw2 is None else sw2.cpu(), prescale)
    assert out.shape == x.shape and out.dtype == x.dtype
    if T:
        err = (out.cpu().double() - want).norm() / want.norm()
        assert err < tol, (mode, err)
    assert torch.equal(out, moe(x)), "not deterministic"


def check_few_rows(counts, K, F_, N, device="cpu", dtype=torch.float32, tol=1e-5, seed=0, prescale=False, tiles=None):
    """The decode experts' three kernels against the reference, each on fresh inputs: up (rows
    gathered from x through row_routes, optionally prescaled), down (SwiGLU of split partial sums)
    and combine (split sums, k weights a token, dropped routes skipped). Two routes a token; tokens
    and rows that no route uses are left over."""
    from turbomoe.kernels.few_rows_gemm import combine, few_rows_down, few_rows_up
    g = torch.Generator().manual_seed(seed)
    c = torch.tensor(counts, dtype=torch.int32)
    n, G, kk = int(c.sum()), len(counts), 2
    T = n // kk + 2
    R = n + 3  # rows past sum(counts) are neither read as groups nor compared
    routes = torch.randperm(T * kk, generator=g)[:n]
    row_routes = torch.cat([routes, torch.full((R - n, ), -1)]).to(torch.int32)
    group = torch.repeat_interleave(torch.arange(G), c)
    max_rows = max(max(counts), 1)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    def close(got, want):
        got, want = got.cpu().double(), want.cpu()
        if n:
            err = (got - want).norm() / want.norm().clamp_min(1e-30)
            assert err < tol, err

    def dev(t, dt=dtype):
        return t.to(device=device, dtype=dt)

    x, w1, scores = rnd(T, K), rnd(G, K, 2 * F_, scale=K ** -0.5), torch.rand(T, kk, generator=g, dtype=torch.float64)
    h = few_rows_up(dev(x), dev(row_routes, torch.int32), kk, dev(w1), dev(c, torch.int32), max_rows,
                    dev(scores, torch.float32) if prescale else None, tiles=tiles)
    a = dev(x).double()[routes // kk]  # x rounded to dtype, as the kernel reads it
    if prescale:
        a = (a * dev(scores, torch.float32).double()[..., None].reshape(-1, 1)[routes]).to(dtype).double()
    want = torch.einsum("rk,rkn->rn", a, dev(w1).double()[group])
    if h.dim() == 2:  # K not split: the SwiGLU applied in the GEMM's epilogue
        assert h.dtype == dtype and h.shape == (R, F_)
        close(h[:n], swiglu_reference(want))
    else:
        assert h.dtype == torch.float32 and h.shape[1:] == (R, 2 * F_)
        close(h.sum(0)[:n], want)
    again = few_rows_up(dev(x), dev(row_routes, torch.int32), kk, dev(w1), dev(c, torch.int32), max_rows,
                        dev(scores, torch.float32) if prescale else None, tiles=tiles)
    assert torch.equal(h[..., :n, :], again[..., :n, :]), "not deterministic"

    w2 = rnd(G, F_, N, scale=F_ ** -0.5)
    for hp in (dev(rnd(3, R, 2 * F_), torch.float32), dev(rnd(R, F_))):  # split partials, or SwiGLU rows
        y = few_rows_down(hp, dev(w2), dev(c, torch.int32), max_rows, tiles=tiles)
        assert y.dtype == torch.float32 and y.shape[1:] == (R, N)
        act = swiglu_reference(hp.sum(0).double()[:n]).to(dtype).double() if hp.dim() == 3 else hp.double()[:n]
        close(y.sum(0)[:n], torch.einsum("rk,rkn->rn", act, dev(w2).double()[group]))

    yp = rnd(2, R, N)
    slots = torch.full((T * kk, ), -1, dtype=torch.int32)
    slots[routes] = torch.arange(n, dtype=torch.int32)
    slots = slots.reshape(T, kk)
    for weights in (scores, None):
        out = combine(dev(yp, torch.float32), dev(slots, torch.int32),
                      None if weights is None else dev(weights, torch.float32), dtype)
        assert out.dtype == dtype and out.shape == (T, N)
        want = torch.zeros(T, N, dtype=torch.float64)
        for t, j in (slots >= 0).nonzero().tolist():
            want[t] += (1.0 if weights is None else weights[t, j].float().double()) * dev(yp, torch.float32).double().cpu()[:, slots[t, j]].sum(0)
        close(out, want)
