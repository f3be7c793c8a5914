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


def check_few_rows(counts, K, NW, swiglu, device="cpu", dtype=torch.float32, tol=1e-5, tail=3, seed=0):
    from turbomoe.autograd.grouped_gemm import _reference_mm
    from turbomoe.kernels.few_rows_gemm import few_rows_mm
    g = torch.Generator().manual_seed(seed)
    c = torch.tensor(counts, dtype=torch.int32)
    R = int(c.sum()) + tail  # rows past sum(counts) are neither read as groups nor compared
    x = torch.randn(R, K, generator=g)
    w = torch.randn(len(counts), K, NW, generator=g) / K ** 0.5
    y = few_rows_mm(x.to(device, dtype), w.to(device, dtype), c.to(device), max(max(counts), 1), swiglu=swiglu)
    want = _reference_mm(x.double(), w.double(), c)
    if swiglu:
        want = swiglu_reference(want)
    n = int(c.sum())
    assert y.shape == (R, NW // 2 if swiglu else NW)
    if n:
        err = (y[:n].cpu().double() - want[:n]).norm() / want[:n].norm()
        assert err < tol, err
