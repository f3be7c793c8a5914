"""A review of the decode chain's combine (turbomoe.kernels.few_rows_gemm._combine_kernel) against the spec
(turbomoe.reference.gather_tokens of the split sums, and SparseMoE's reference mode), directly and
through SparseMoE's few_rows path.

Covers what test_inference_triton.py / test_fuzz_inference_triton.py do not: k = 1..8 and S = 1..8
splits, M not a multiple of any column block (several column programs a token, the last partial),
T = 0 / 1 / a few thousand (past 4096 routes), tokens whose every route is dropped (-1, other
negative slots, slots past y's rows), NaN scores of dropped routes, NaN / Inf in rows no route reads, Inf in rows a route
does read (NaN / Inf where the spec has them), scores None vs given in fp64 / fp32 / bf16, int32 and
int64 slots, strided and broadcast inputs, the shared expert's route, and bit-determinism.

Runs natively on a GPU, or on the CPU under TRITON_INTERPRET=1 (scripts/test.sh). bf16 through
SparseMoE uses CUDA-core tiles (block_m < 16): the interpreter's bf16 tl.dot is wrong
(test_fuzz_inference_triton.py).
"""
import os
import zlib

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU, or TRITON_INTERPRET=1 on the CPU", allow_module_level=True)

from turbomoe import reference as ref  # noqa: E402
from turbomoe.inference import SparseMoE  # noqa: E402
from turbomoe.kernels import few_rows_gemm  # noqa: E402
from turbomoe.kernels.few_rows_gemm import Tiles, combine  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
NAN, INF = float("nan"), float("inf")
EPS = {torch.float64: 2.0 ** -52, torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7}  # -7: the interpreter truncates


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit pattern (NaN-safe equality)."""
    iview = {8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()]
    return t.contiguous().view(iview).cpu()


def spec(y_SRN, slots_TK, scores_TK):
    """The spec in fp64: reference.gather_tokens of the split sums (out of range slots route nowhere),
    the scores as the kernels read them (rounded to the accumulation dtype), and the elementwise
    magnitude sum_j |w_j| sum_s |y_s| that bounds the accumulation's rounding."""
    acc = ref.compute_dtype(y_SRN.dtype)
    y = y_SRN.detach().cpu().to(acc).double()
    S, R, N = y.shape
    y_RN = y.sum(0) if S else y.new_zeros(R, N)
    mag_RN = y.abs().sum(0) if S else y.new_zeros(R, N)
    sc = None if scores_TK is None else scores_TK.detach().cpu().to(acc).double()
    slots = slots_TK.detach().cpu()
    want = ref.gather_tokens(y_RN, slots, sc)
    with torch.no_grad():
        mag = ref.gather_tokens(mag_RN.nan_to_num(0, 0, 0), slots, None if sc is None else sc.abs().nan_to_num(0, 0, 0))
    return want, mag


def check_close(name, got, want, mag, y_dtype, out_dtype, S, k):
    """NaN and +-Inf exactly where the spec has them; finite elements within the accumulation's
    rounding (S + k + 2 roundings of the magnitude) plus one rounding to the output dtype."""
    got = got.detach().cpu().double()
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert torch.equal(got.isnan(), want.isnan()), f"{name}: NaN at {(got.isnan() != want.isnan()).nonzero()[:5].tolist()}"
    inf = want.isinf()
    assert torch.equal(got.isinf(), inf) and torch.equal(got[inf], want[inf]), f"{name}: Inf differs"
    fin = want.isfinite()
    eps_acc = EPS[ref.compute_dtype(y_dtype)]
    bound = eps_acc * (S + k + 2) * mag[fin] + EPS[out_dtype] * want[fin].abs() + 1e-300
    err = (got[fin] - want[fin]).abs()
    bad = err > bound
    assert not bad.any(), f"{name}: {int(bad.sum())} elements off, worst {(err / bound).max().item():.3g} x bound"


def routes(T, k, R, gen, drop=0.25, all_dropped=(), neg=(-1, )):
    """slots [T, k] int32: distinct rows of [0, R) for kept routes, dropped ones a negative value
    from neg; tokens in all_dropped route nowhere. Needs R >= T * k."""
    slots = torch.randperm(R, generator=gen)[:T * k].reshape(T, k).to(torch.int32)
    dropped = torch.rand(T, k, generator=gen) < drop
    for t in all_dropped:
        if t < T:
            dropped[t] = True
    negs = torch.tensor(neg, dtype=torch.int32)[torch.randint(0, len(neg), (T, k), generator=gen)]
    return torch.where(dropped, negs, slots)


def poison(y_SRN, scores_TK, slots_TK, gen):
    """NaN / +-Inf in every row no route reads, and NaN in every dropped route's score."""
    S, R, N = y_SRN.shape
    read = torch.zeros(R, dtype=torch.bool)
    kept = slots_TK[(slots_TK >= 0) & (slots_TK < R)].long()
    read[kept] = True
    unread = (~read).nonzero().flatten()
    if len(unread):
        vals = torch.tensor([NAN, INF, -INF], dtype=y_SRN.dtype)
        y_SRN[:, unread] = vals[torch.randint(0, 3, (S, len(unread), N), generator=gen)]
    if scores_TK is not None:
        scores_TK[slots_TK < 0] = NAN
    return y_SRN, scores_TK


# (T, k, S, N): k and S 1..8, N odd / past a column block (1024 at most; fewer, >= 128, where the
# tokens' programs fall short of 2x the SMs: several partial column blocks a token), T = 1
DIRECT = [(1, 1, 1, 1), (1, 8, 8, 1025), (3, 2, 3, 1025), (5, 3, 1, 129), (7, 4, 2, 17), (2, 5, 5, 300),
          (4, 6, 7, 65), (9, 7, 4, 33), (6, 8, 6, 200), (13, 1, 8, 3), (2, 2, 2, 2049)]
# (y dtype, out dtype): fp64 accumulates in fp64; fp32 partials into fp32 or bf16 (the decode chain's)
DTYPES = [(torch.float64, torch.float64), (torch.float32, torch.float32), (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("y_dtype,out_dtype", DTYPES)
@pytest.mark.parametrize("T,k,S,N", DIRECT)
def test_combine_direct_matches_spec(T, k, S, N, y_dtype, out_dtype):
    """combine == gather_tokens(sum_s y) for scores given and None, with some dropped routes (-1, -2,
    INT32_MIN), a token with every route dropped (0 out), NaN scores on dropped routes and NaN / Inf in
    every row no route reads (nothing of them reaches out); the same bits twice."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((T, k, S, N, y_dtype, out_dtype)).encode()))
    R = T * k + 5
    slots = routes(T, k, R, gen, all_dropped=(T // 2, ), neg=(-1, -2, -2**31))
    y = torch.randn(S, R, N, generator=gen, dtype=torch.float64).to(y_dtype)
    scores = torch.rand(T, k, generator=gen, dtype=torch.float64).to(torch.float32)
    y, scores = poison(y, scores, slots, gen)
    for sc in (scores, None):
        want, mag = spec(y, slots, sc)
        got = combine(y.to(DEV), slots.to(DEV), None if sc is None else sc.to(DEV), out_dtype)
        assert got.dtype == out_dtype and got.shape == (T, N)
        assert torch.isfinite(got).all(), "a dropped score or an unread row reached out"
        assert (got[T // 2] == 0).all(), "a token with every route dropped must be 0"
        check_close(f"scores={'None' if sc is None else 'given'}", got, want, mag, y_dtype, out_dtype, S, k)
        again = combine(y.to(DEV), slots.to(DEV), None if sc is None else sc.to(DEV), out_dtype)
        assert torch.equal(bits(got), bits(again)), "not deterministic"


@pytest.mark.parametrize("y_dtype,out_dtype", DTYPES)
def test_combine_empty_and_degenerate(y_dtype, out_dtype):
    """T = 0 (an empty [0, N]); N = 0; R = 0 with every route dropped (zeros, no read of the empty
    buffer); k = 0 and S = 0 (empty sums: zeros)."""
    gen = torch.Generator().manual_seed(7)
    y = torch.randn(2, 6, 10, generator=gen, dtype=torch.float64).to(y_dtype).to(DEV)
    none = torch.empty(0, 3, dtype=torch.int32, device=DEV)
    out = combine(y, none, torch.empty(0, 3, device=DEV), out_dtype)
    assert out.shape == (0, 10) and out.dtype == out_dtype
    out = combine(y[:, :, :0], torch.zeros(4, 3, dtype=torch.int32, device=DEV), None, out_dtype)
    assert out.shape == (4, 0)
    dropped = torch.full((3, 2), -1, dtype=torch.int32, device=DEV)
    for sc in (None, torch.full((3, 2), NAN, device=DEV)):
        out = combine(y[:, :0], dropped, sc, out_dtype)
        assert out.shape == (3, 10) and (out == 0).all() and not out.isnan().any()
    out = combine(y, torch.empty(3, 0, dtype=torch.int32, device=DEV), torch.empty(3, 0, device=DEV), out_dtype)
    assert out.shape == (3, 10) and (out == 0).all()
    slots = torch.tensor([[0, 3], [-1, 5], [2, -1]], dtype=torch.int32, device=DEV)
    out = combine(y[:0], slots, torch.rand(3, 2, generator=gen).to(DEV), out_dtype)
    assert out.shape == (3, 10) and (out == 0).all()


@pytest.mark.parametrize("y_dtype,out_dtype", DTYPES)
def test_combine_nonfinite_in_read_rows(y_dtype, out_dtype):
    """Where a kept route reads Inf or NaN, or a kept route's score is NaN, Inf or 0 against an Inf
    row, out has the spec's NaN / Inf (per column), and the other tokens stay finite."""
    gen = torch.Generator().manual_seed(11)
    S, R, N, k = 3, 12, 40, 3
    y = torch.randn(S, R, N, generator=gen, dtype=torch.float64).to(y_dtype)
    slots = torch.tensor([[0, 1, -1], [2, 3, 4], [5, -1, 6], [7, 8, 9], [10, -1, 11]], dtype=torch.int32)
    scores = torch.rand(5, k, generator=gen)
    y[1, 0, 3] = INF  # token 0 column 3: +Inf
    y[0, 2, 5], y[2, 3, 5] = INF, -INF  # token 1 column 5: Inf - Inf = NaN
    scores[2, 2] = NAN  # token 2: every column NaN
    y[0, 7, 9] = INF
    scores[3, 0] = 0.0  # token 3 column 9: 0 * Inf = NaN
    y[2, 11, 1] = -INF
    scores[4, 2] = INF  # token 4: Inf * row 11, -Inf at column 1
    scores[slots < 0] = NAN
    for sc in (scores, None):
        want, mag = spec(y, slots, sc)
        got = combine(y.to(DEV), slots.to(DEV), None if sc is None else sc.to(DEV), out_dtype)
        check_close(f"scores={'None' if sc is None else 'given'}", got, want, mag, y_dtype, out_dtype, S, k)


def test_combine_strided_and_other_dtypes():
    """Strided and broadcast y (column slice of a wider buffer, stride 0 splits, transposed), strided and
    transposed-storage slots, int64 slots, and fp64 / bf16 / strided scores: the bits of the same
    values passed contiguous (the wrapper copies what the kernel cannot stride), and the spec."""
    gen = torch.Generator().manual_seed(13)
    T, k, S, R, N = 7, 3, 4, 30, 70
    slots = routes(T, k, R, gen, all_dropped=(2, ))
    scores = torch.rand(T, k, generator=gen)
    wide = torch.randn(S, R, N + 9, generator=gen)
    wide[..., N:] = NAN
    y_cols = wide[..., :N]  # row stride N + 9
    y_bcast = torch.randn(1, R, N, generator=gen).expand(S, R, N)  # split stride 0
    y_trans = torch.randn(S, N, R, generator=gen).transpose(1, 2)  # column stride R: copied
    slots_T = slots.t().contiguous().t()  # transposed storage
    slots_gap = torch.stack([slots, torch.full_like(slots, 2**20)], -1)[..., 0]  # stride 2
    scores_gap = torch.stack([scores, torch.full_like(scores, NAN)], -1)[..., 0]
    scores[slots < 0] = NAN
    scores_gap[slots < 0] = NAN
    for y in (y_cols, y_bcast, y_trans):
        base = combine(y.contiguous().to(DEV), slots.to(DEV), scores.to(DEV), torch.float32)
        want, mag = spec(y, slots, scores)
        check_close("base", base, want, mag, torch.float32, torch.float32, S, k)
        assert torch.isfinite(base).all()
        for name, s, sc in (("y strided", slots, scores), ("slots transposed", slots_T, scores),
                            ("slots strided", slots_gap, scores_gap), ("slots int64", slots.long(), scores)):
            got = combine(y.to(DEV), s.to(DEV), sc.to(DEV), torch.float32)
            assert torch.equal(bits(got), bits(base)), name
        for sd in (torch.float64, torch.bfloat16):  # read in its dtype, rounded to the accumulation's
            sc = scores.to(sd)
            got = combine(y.to(DEV), slots.to(DEV), sc.to(DEV), torch.float32)
            want, mag = spec(y, slots, sc)
            check_close(f"scores {sd}", got, want, mag, torch.float32, torch.float32, S, k)


def test_combine_many_tokens():
    """A few thousand tokens (T * k = 4400 routes and rows, past any 4096 bound), a fifth of them
    with every route dropped, into bf16: the spec, finite, the same bits twice."""
    gen = torch.Generator().manual_seed(17)
    T, k, S, N = 2200, 2, 2, 9
    R = T * k + 3
    slots = routes(T, k, R, gen, drop=0.1, all_dropped=range(0, T, 5))
    y = torch.randn(S, R, N, generator=gen)
    scores = torch.rand(T, k, generator=gen)
    y, scores = poison(y, scores, slots, gen)
    got = combine(y.to(DEV), slots.to(DEV), scores.to(DEV), torch.bfloat16)
    want, mag = spec(y, slots, scores)
    check_close("T=2200", got, want, mag, torch.float32, torch.bfloat16, S, k)
    assert (got[::5] == 0).all() and torch.isfinite(got).all()
    again = combine(y.to(DEV), slots.to(DEV), scores.to(DEV), torch.bfloat16)
    assert torch.equal(bits(got), bits(again))


def test_combine_slot_past_rows_routes_nowhere():
    """A slot >= R (y's rows) routes nowhere in the spec; here y is a contiguous view whose storage
    continues with NaN rows, so a kernel that reads slot R shows NaN instead of faulting."""
    gen = torch.Generator().manual_seed(19)
    S, R, N = 2, 6, 8
    store = torch.full((S * (R + 2) * N, ), NAN)
    y = store[:S * R * N].view(S, R, N)
    y.copy_(torch.randn(S, R, N, generator=gen))
    assert y.is_contiguous()
    # y[1] continues into store[S*R*N:]: slot R of split 1 lies in the NaN tail
    slots = torch.tensor([[0, R], [R + 1, -1], [3, 4]], dtype=torch.int32)
    scores = torch.rand(3, 2, generator=gen)
    got = combine(y.to(DEV), slots.to(DEV), scores.to(DEV), torch.float32)
    want, mag = spec(y, slots, scores)
    check_close("slot >= R", got, want, mag, torch.float32, torch.float32, S, 2)


# ------------------------------------------------------------------------- through SparseMoE

# (T, E, k, M, F, shared, prescale, renormalize, down split S, dtype): k 1..8 with and without the
# shared expert (k + shared <= 8), S 1..8 (the interpreter's rule splits at most 4: forced here),
# a token with NaN logits (routes nowhere, or to the shared expert only), T = 0 and 1
MOE = [(1, 8, 2, 24, 48, False, False, True, 3, torch.float32),
       (5, 9, 8, 40, 128, False, False, False, 8, torch.float32),
       (6, 9, 7, 24, 80, True, False, True, 5, torch.float64),
       (4, 6, 1, 33, 48, True, True, False, 1, torch.float32),
       (7, 5, 3, 24, 64, True, False, False, 4, torch.bfloat16),
       (3, 4, 4, 17, 32, False, False, True, 2, torch.bfloat16),
       (0, 4, 2, 16, 32, True, False, False, 2, torch.float32)]
MOE_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("T,E,k,M,F_,shared,prescale,renorm,S,dtype", MOE)
def test_sparse_moe_few_rows_combine(T, E, k, M, F_, shared, prescale, renorm, S, dtype, monkeypatch):
    """SparseMoE's few_rows output against its reference mode (same weights): NaN where the reference
    has it, the rest within the dtype's tolerance, the same bits twice; the combine ran on S splits
    with scores (None with prescale) and k + shared routes a token."""
    gen = torch.Generator().manual_seed(T * 1000 + E * 10 + k)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    router, w1, w2 = r(E, M), r(E, M, 2 * F_, scale=M ** -0.5), r(E, F_, M, scale=F_ ** -0.5)
    sw1, sw2 = (r(M, 2 * F_, scale=M ** -0.5), r(F_, M, scale=F_ ** -0.5)) if shared else (None, None)
    x = r(T, M)
    if T > 2:
        x[2, 0] = NAN  # its logits are NaN: no routed expert (the shared one's output is NaN too)
    kw = dict(score_func="softmax", renormalize=renorm, shared_w1_MN=sw1, shared_w2_FM=sw2, prescale=prescale)
    tiles = (Tiles(2, 32, 1, 16, 4, 1, False, False), Tiles(2, 16, S, 16, 4, 1, False, False))
    moe = SparseMoE(router.to(DEV), w1.to(DEV), w2.to(DEV), k, mode="few_rows",
                    few_rows_tiles={T: tiles} if T else None,
                    **{n: (v.to(DEV) if torch.is_tensor(v) else v) for n, v in kw.items()})
    refm = SparseMoE(router, w1, w2, k, mode="reference", **kw)
    seen = []
    real = few_rows_gemm.combine

    def spy(y, slots, scores, out_dtype):
        seen.append((y.shape[0], slots.shape[1], scores is None))
        return real(y, slots, scores, out_dtype)

    monkeypatch.setattr(few_rows_gemm, "combine", spy)
    got = moe(x.to(DEV))
    want = refm(x)
    assert got.shape == x.shape and got.dtype == dtype
    if T:
        assert seen[0] == (S, k + shared, prescale), seen
    got_c, want_c = got.cpu().double(), want.double()
    assert torch.equal(got_c.isnan(), want_c.isnan())
    fin = want_c.isfinite()
    if fin.any():
        err = (got_c[fin] - want_c[fin]).norm() / want_c[fin].norm().clamp_min(1e-30)
        assert err < MOE_TOL[dtype], err.item()
    if T > 2 and not shared:
        assert (got_c[2] == 0).all(), "a token routed nowhere must be 0"
    assert torch.equal(bits(got), bits(moe(x.to(DEV)))), "not deterministic"
