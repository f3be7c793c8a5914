"""Differential fuzz of the inference path's Triton kernels against the spec (turbomoe/reference.py)
and a float64 oracle, on edge inputs the other inference tests do not reach: index_shuffling on exact
ties (equal, integer-grid and saturated-sigmoid logits), +-Inf / NaN / all -Inf rows, a hot expert,
fp16 / bf16 / fp64 and strided logits, k up to MAX_K with a shared expert, E odd and past a power of
two; the few-rows GEMMs and combine from a real shuffle with NaN wherever nothing may be read (rows
past the counts, scores of unrouted routes, tokens that route nowhere), every tiling kind, fp64,
fp32 and bf16, strided tables; and SparseMoE's few_rows, grouped and dense modes against its
reference mode with a NaN token and an expert no token chooses whose output overflows.

Every case is fixed (seeded). Runs natively on a GPU; on the CPU under TRITON_INTERPRET=1 (set here
where no GPU is, before turbomoe's kernels are defined), where bf16 runs only the CUDA-core tiles
(the interpreter's bf16 tl.dot is wrong) and its fp32 -> bf16 cast truncates (inside bf16's tolerance).
"""
import os

import torch

if not torch.cuda.is_available():  # the interpreter is read when kernels are defined: before turbomoe
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU, or TRITON_INTERPRET=1 on the CPU", allow_module_level=True)

from test_fuzz_triton import layout  # noqa: E402 (t on DEV contiguous, transposed storage or strided rows)
from turbomoe import reference as ref  # noqa: E402
from turbomoe.autograd.swiglu import swiglu_reference  # noqa: E402
from turbomoe.inference import SparseMoE  # noqa: E402
from turbomoe.kernels.few_rows_gemm import Tiles, combine, few_rows_down, few_rows_up  # noqa: E402
from turbomoe.kernels.shuffling import index_shuffling  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
NAN, INF = float("nan"), float("inf")
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}


def assert_same(name, got, want, tol):
    """NaN and +-Inf in the same places, the finite rest within tol (norm-wise relative)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert torch.equal(got.isnan(), want.isnan()), f"{name}: NaN at {got.isnan().nonzero().tolist()}"
    inf = want.isinf()
    assert torch.equal(got.isinf(), inf) and torch.equal(got[inf], want[inf]), f"{name}: Inf differs"
    fin = want.isfinite()
    diff, scale = (got[fin] - want[fin]).norm().item(), want[fin].norm().item()
    assert diff <= tol * max(scale, 1e-30), f"{name}: relative error {diff / max(scale, 1e-30):.3g} > {tol}"


# --------------------------------------------------------------------------------- index_shuffling

def edge_logits(kind: str, T: int, E: int, gen: torch.Generator) -> torch.Tensor:
    """[T, E] fp64 logits of one edge kind; exact ties stay ties in every dtype tested."""
    if kind == "equal":
        return torch.full((T, E), 3.0, dtype=torch.float64)
    if kind == "int_ties":  # few distinct values: equal probabilities in every row
        return torch.randint(-2, 3, (T, E), generator=gen).double()
    if kind == "sat_sigmoid":  # sigmoid rounds to 1.0 or 1 - 2^-24 in fp32: ties among the saturated
        return 16.0 + torch.randint(0, 8, (T, E), generator=gen).double()
    x = torch.randn(T, E, generator=gen, dtype=torch.float64)
    if kind == "hot":  # one expert takes every first choice, the last none
        x[:, E // 2] += 100.0
        x[:, -1] -= 100.0
    elif kind == "nonfinite":  # rows that route nowhere: NaN, +Inf, -Inf, all -Inf; finite rows between
        at = torch.randint(0, T * E, (T * E // 4 + 1, ), generator=gen)
        x.view(-1)[at] = torch.tensor([NAN, INF, -INF], dtype=x.dtype)[torch.randint(0, 3, (len(at), ), generator=gen)]
        x[T // 2] = -INF
    return x


# (kind, T, E, k, dtype, layout): T = 1, T < E, T = 4 and 5 (one tile of 4 and one past it), E odd,
# E = 255 with a shared expert (256 count columns), E past a power of two, k up to MAX_K
SHUFFLE_EDGES = [("equal", 5, 6, 6, torch.float32, "T"), ("int_ties", 9, 7, 3, torch.float16, "strided"),
                 ("sat_sigmoid", 4, 12, 8, torch.float32, "contiguous"), ("hot", 13, 5, 2, torch.bfloat16, "T"),
                 ("nonfinite", 11, 9, 4, torch.float64, "strided"), ("int_ties", 1, 255, 8, torch.float64, "T"),
                 ("randn", 3, 129, 5, torch.float32, "strided"), ("nonfinite", 6, 1, 1, torch.float32, "contiguous")]


@pytest.mark.parametrize("kind,T,E,k,dtype,how", SHUFFLE_EDGES)
def test_index_shuffling_edges(kind, T, E, k, dtype, how):
    """ids, counts, slots and row_routes exactly as the spec (ties to the lower id, non-finite rows
    route nowhere, the shared expert's rows last), scores within fp32's rounding (exact in fp64), on
    the one-program path and the two-launch one, for both score functions, renormalised or not."""
    logits = edge_logits(kind, T, E, torch.Generator().manual_seed(T * 1000 + E)).to(dtype)
    for i, (score_func, renormalize, shared) in enumerate([("softmax", False, True), ("sigmoid", True, False),
                                                           ("softmax", True, False), ("sigmoid", False, True)]):
        want = ref.index_shuffling(logits, k, score_func, renormalize, shared)
        got = index_shuffling(layout(logits, how), k, score_func, renormalize, shared, one_block_tiles=i % 2 * 99)
        for name, a, b in zip(want._fields, got, want):
            case = (name, score_func, renormalize, shared)
            assert a.dtype == b.dtype and a.shape == b.shape, case
            if name == "scores":
                assert_same(str(case), a, b, 1e-6 if dtype != torch.float64 else 1e-15)
            else:
                assert torch.equal(a.cpu(), b), case


# ---------------------------------------------------------------------- few-rows GEMMs and combine

def oracle_moe(x_TK, r, w1_GKN, w2_GFK, prescale):
    """Float64 SwiGLU inputs [n, 2F] and expert outputs [n, K] of the n shuffled rows (x read in its
    dtype, prescaled rows and SwiGLU outputs rounded to it, as the kernels do), and the combine [T, K]."""
    kk, n = r.slots.shape[1], int(r.counts.sum())
    route_n = r.row_routes[:n].long()
    group_n = torch.repeat_interleave(torch.arange(len(r.counts)), r.counts.long())
    a_nK = x_TK.double()[route_n // kk]
    if prescale:
        a_nK = (a_nK * r.scores.reshape(-1)[route_n].double()[:, None]).to(x_TK.dtype).double()
    h_n2F = torch.einsum("rk,rkn->rn", a_nK, w1_GKN.double()[group_n])
    y_nK = torch.einsum("rk,rkn->rn", swiglu_reference(h_n2F).to(x_TK.dtype).double(), w2_GFK.double()[group_n])
    weights_TJ = torch.ones_like(r.scores) if prescale else r.scores
    return h_n2F, y_nK, ref.gather_tokens(y_nK, r.slots, weights_TJ.double())


CHAIN_TILES = [None, Tiles(1, 32, 1, 32, 4, 1), Tiles(2, 32, 3, 16, 4, 1), Tiles(16, 16, 1, 16, 4, 1, False, False),
               Tiles(32, 16, 2, 16, 4, 1, True, True)]  # the rule; CUDA cores 1 and 2 rows; tl.dot; swapped


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,E,k,K,F,shared,prescale,hot", [(12, 5, 2, 19, 7, False, False, False),
                                                          (9, 3, 1, 23, 5, True, True, True),
                                                          (5, 7, 3, 17, 20, True, False, False)])
def test_few_rows_chain(T, E, k, K, F, shared, prescale, hot, dtype):
    """up, down and combine, each on its producer's output, from a real shuffle (a token with NaN
    logits routes nowhere, or to the shared expert only; empty experts; with hot, one expert holds
    every token): against the float64 oracle, under every tiling kind (the rule's; CUDA-core rows,
    tl.dot, swapped tl.dot; K split or not). NaN where nothing may be read: x of tokens with no
    route, the buffers' rows past the counts, the scores of unrouted routes; row_routes past the
    counts far out of range. fp64 computes in fp64: the tl.dot tiles stored garbage (NaN in the
    block), the others were fp32-close."""
    gen = torch.Generator().manual_seed(T * 100 + E * 10 + k)
    logits_TE = torch.randn(T, E, generator=gen)
    logits_TE[1, 0] = NAN
    if hot:
        logits_TE[:, 0] += 50
    r = ref.index_shuffling(logits_TE.to(dtype), k, "softmax", False, shared)
    G, kk, n = E + shared, k + shared, int(r.counts.sum())
    x_TK = torch.randn(T, K, generator=gen, dtype=torch.float64).to(dtype)
    x_TK[(r.slots < 0).all(1)] = NAN
    w1_GKN = (torch.randn(G, K, 2 * F, generator=gen, dtype=torch.float64) * K ** -0.5).to(dtype)
    w2_GFK = (torch.randn(G, F, K, generator=gen, dtype=torch.float64) * F ** -0.5).to(dtype)
    r = r._replace(scores=r.scores.masked_fill(r.slots < 0, NAN),
                   row_routes=r.row_routes.masked_fill(torch.arange(T * kk) >= n, 2**30))
    h_n2F, y_nK, out_TK = oracle_moe(x_TK, r, w1_GKN, w2_GFK, prescale)
    x, w1, w2 = x_TK.to(DEV), w1_GKN.to(DEV), w2_GFK.to(DEV)
    counts, slots, scores, row_routes = (t.to(DEV) for t in (r.counts, r.slots, r.scores, r.row_routes))
    tol = TOL[dtype]
    for tiles in CHAIN_TILES:
        if dtype == torch.bfloat16 and DEV == "cpu" and (tiles is None or tiles.block_m >= 16):
            continue
        h = few_rows_up(x, row_routes, kk, w1, counts, T, scores if prescale else None, tiles=tiles)
        if h.dim() == 2:  # the SwiGLU rows
            assert h.dtype == dtype
            assert_same(f"{tiles} a", h[:n], swiglu_reference(h_n2F), tol)
        else:  # K split: the partial sums
            assert h.dtype == ref.compute_dtype(dtype)
            assert_same(f"{tiles} h", h[:, :n].sum(0), h_n2F, tol)
        h[..., n:, :] = NAN
        y = few_rows_down(h, w2, counts, T, tiles=tiles)
        assert y.dtype == ref.compute_dtype(dtype)
        assert_same(f"{tiles} y", y[:, :n].sum(0), y_nK, tol)
        y[:, n:] = NAN
        out = combine(y, slots, None if prescale else scores, dtype)
        assert out.dtype == dtype and torch.isfinite(out).all(), tiles
        assert_same(f"{tiles} out", out, out_TK, tol)


def test_few_rows_strided_tables():
    """A strided row_routes (few_rows_up) and transposed partial sums (combine) give the contiguous
    tables' bits: the kernels read a row's route at unit stride (a strided table's gaps: wrong rows,
    and a -7 there an out-of-bounds read of x) and y's columns at unit stride (wrong sums)."""
    gen = torch.Generator().manual_seed(5)
    T, E, k, K, F = 6, 4, 2, 16, 4
    r = ref.index_shuffling(torch.randn(T, E, generator=gen), k)
    x_TK, w1_GKN = torch.randn(T, K, generator=gen).to(DEV), torch.randn(E, K, 2 * F, generator=gen).to(DEV)
    counts, slots, scores = r.counts.to(DEV), r.slots.to(DEV), r.scores.to(DEV)
    gapped_R = torch.stack([r.row_routes, torch.full_like(r.row_routes, -7)], 1).to(DEV).reshape(-1)[::2]
    tiles = Tiles(2, 16, 1, 16, 4, 1)
    want = few_rows_up(x_TK, r.row_routes.to(DEV), k, w1_GKN, counts, T, tiles=tiles)
    assert torch.equal(few_rows_up(x_TK, gapped_R, k, w1_GKN, counts, T, tiles=tiles), want)
    y_SRK = torch.randn(2, K, T * k, generator=gen).to(DEV).transpose(1, 2)
    assert torch.equal(combine(y_SRK, slots, scores, torch.float32),
                       combine(y_SRK.contiguous(), slots, scores, torch.float32))


# ------------------------------------------------------------------------------------- SparseMoE

# (T, E, k, M, F, score_func, renormalize, shared, prescale); T = 12: 16-row tiles on the interpreter
MOE_FUZZ = [(5, 6, 2, 16, 8, "softmax", True, False, False), (9, 5, 1, 24, 6, "sigmoid", False, True, True),
            (12, 7, 3, 20, 5, "softmax", False, True, False)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mode", ["few_rows", "grouped", "dense"])
@pytest.mark.parametrize("case", MOE_FUZZ)
def test_sparse_moe_modes_match_reference(case, mode, dtype):
    """Each Triton mode's output equals the reference mode's (NaN and Inf in the same places, the rest
    within the dtype's tolerance) where expert 0 is nearly every token's first choice, the last is
    chosen by none and overflows on every input (weights above the square root of the dtype's
    largest value), and one token holds a NaN (it routes nowhere: 0 out, or the shared expert's NaN).
    dense summed every expert, the unchosen with weight 0: 0 x Inf = NaN in every token; and it
    combined fp64 in fp32 (1e-8 off), as few_rows did (garbage or NaN from 16-row tiles)."""
    T, E, k, M, F, score_func, renormalize, shared, prescale = case
    gen = torch.Generator().manual_seed(T * 10 + E)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    router_EM = rnd(E, M)
    router_EM[-1] = -4 * router_EM[0]  # logit -4 |router_0|^2: 15 standard deviations below the others
    x_TM = router_EM[0] + rnd(T, M, scale=0.3)
    x_TM[1, 2] = NAN
    w1_EMN, w2_EFM = rnd(E, M, 2 * F, scale=M ** -0.5), rnd(E, F, M, scale=F ** -0.5)
    w1_EMN[-1] *= torch.finfo(dtype).max ** 0.6
    shared_MN_FM = (rnd(M, 2 * F, scale=M ** -0.5), rnd(F, M, scale=F ** -0.5)) if shared else (None, None)
    router, w1, w2, sw1, sw2 = (None if t is None else t.to(DEV) for t in (router_EM, w1_EMN, w2_EFM, *shared_MN_FM))
    args = (router, w1, w2, k, score_func, renormalize, sw1, sw2, prescale)
    want = SparseMoE(*args, mode="reference", backend="reference")(x_TM.to(DEV))
    got = SparseMoE(*args, mode=mode, backend="triton")(x_TM.to(DEV))
    assert got.dtype == dtype and want[1].isnan().any() == shared
    assert_same(mode, got, want, TOL[dtype] * 10)
