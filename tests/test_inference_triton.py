"""The inference kernels (Triton index shuffling, few-rows grouped GEMM, SparseMoE on them) against
the reference; on the CPU through the Triton interpreter (TRITON_INTERPRET=1, see scripts/test.sh),
natively on a GPU."""
import os

import pytest
import torch

from inference_cases import (MOE_CASES, SHUFFLE_CASES, check_few_rows, check_moe, check_shuffle, moe_weights,
                             naive_moe)

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 set before triton kernels are defined, or a GPU")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("case", SHUFFLE_CASES)
@pytest.mark.parametrize("one_block_tiles", [0, 4])  # the two-launch path, and one program where T allows
def test_index_shuffling(case, one_block_tiles):
    from turbomoe.kernels.shuffling import index_shuffling
    check_shuffle(index_shuffling, *case, DEVICE, seed=7 * case[0] + case[1], one_block_tiles=one_block_tiles)


@pytest.mark.parametrize("one_block_tiles", [0, 4])
def test_index_shuffling_one_hot_expert_and_bf16(one_block_tiles):
    from turbomoe.kernels.shuffling import index_shuffling
    check_shuffle(index_shuffling, 50, 16, 2, "softmax", True, True, DEVICE, seed=3, hot=True,
                  one_block_tiles=one_block_tiles)
    check_shuffle(index_shuffling, 33, 32, 4, "softmax", False, False, DEVICE, dtype=torch.bfloat16, seed=4,
                  one_block_tiles=one_block_tiles)


@pytest.mark.parametrize("case", SHUFFLE_CASES)
@pytest.mark.parametrize("parts_dtype", [
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="the interpreter rounds fp32 to bf16 toward zero (a GPU: to nearest)")),
    torch.float32])
def test_index_shuffling_from_logit_parts(case, parts_dtype):
    """The shuffle fed the split router's fp32 partial sums: the routes of their sum, in order,
    rounded to parts_dtype (non-finite parts included: the row routes nowhere)."""
    from turbomoe import reference
    from turbomoe.kernels.shuffling import index_shuffling
    T, E, k, score_func, renormalize, shared = case
    g = torch.Generator().manual_seed(T + 3 * E + k)
    parts = torch.randn(5, T, E, generator=g) * 2
    if T > 3:
        parts[2, 3, 0] = float("nan")
    want_logits = parts[0].clone()
    for p in parts[1:]:
        want_logits += p
    want = reference.index_shuffling(want_logits.to(parts_dtype), k, score_func, renormalize, shared)
    for one_block_tiles in (0, 4):
        got = index_shuffling(parts.to(DEVICE), k, score_func, renormalize, shared, one_block_tiles,
                              parts_dtype=parts_dtype)
        for name, a, b in zip(want._fields, got, want):
            if name == "scores":
                torch.testing.assert_close(a.cpu(), b, rtol=1e-6, atol=1e-7)
            else:
                assert torch.equal(a.cpu(), b), (name, one_block_tiles)
    with pytest.raises(ValueError, match="fp32 \\[S, T, E\\]"):
        index_shuffling(parts[0].to(DEVICE), k, parts_dtype=parts_dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 tl.dot: a GPU (the interpreter's bf16 dot is wrong)")
@pytest.mark.parametrize("T, E, M", [(1, 16, 5120), (17, 20, 300), (40, 128, 2048), (70, 16, 130)])
def test_router_logit_parts(T, E, M):
    from turbomoe.kernels.router import router_logit_parts
    g = torch.Generator(device="cuda").manual_seed(T + E + M)
    x = torch.randn(T, M, generator=g, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, M, generator=g, device="cuda", dtype=torch.bfloat16)
    parts = router_logit_parts(x, w)
    assert parts.dtype == torch.float32 and parts.shape[1:] == (T, E)
    torch.testing.assert_close(parts.sum(0), x.float() @ w.float().t(), rtol=1e-4, atol=1e-3 * M ** 0.5)
    assert torch.equal(parts, router_logit_parts(x, w)), "not deterministic"
    with pytest.raises(ValueError, match="bf16 or fp16"):
        router_logit_parts(x.float(), w.float())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the split router runs for 16-bit inputs on a GPU")
@pytest.mark.parametrize("T, E, k, shared", [(16, 16, 1, True), (40, 128, 8, False), (100, 16, 1, True)])
def test_sparse_moe_split_router(T, E, k, shared):
    """From 16 tokens the few-rows block routes on the split router's parts summed in the shuffle:
    its output against the float64 oracle on the logits those parts sum to."""
    from turbomoe.inference import SparseMoE
    from turbomoe.kernels.router import router_logit_parts
    router, w1, w2, (sw1, sw2) = moe_weights(E, 256, 64, shared, seed=T, device="cuda", dtype=torch.bfloat16)
    moe = SparseMoE(router, w1, w2, k, shared_w1_MN=sw1, shared_w2_FM=sw2, mode="few_rows")
    x = torch.randn(T, 256, device="cuda", dtype=torch.bfloat16)
    logits = router_logit_parts(x, router).sum(0).to(torch.bfloat16)
    want = naive_moe(x.cpu(), logits.cpu(), w1.cpu(), w2.cpu(), k, "softmax", False,
                     None if sw1 is None else sw1.cpu(), None if sw2 is None else sw2.cpu())
    out = moe(x)
    assert (out.cpu().double() - want).norm() / want.norm() < 2e-2
    assert torch.equal(out, moe(x)), "not deterministic"


# (T, E, M): no tokens, one token, T not a multiple of the 8-token tile, one expert, M of one
# partial K tile and of several (on the GPU: 8192-wide tiles at T = 1)
@pytest.mark.parametrize("T, E, M", [(0, 4, 40), (1, 16, 5120), (3, 1, 37), (13, 5, 700), (8, 128, 96), (1, 3, 9000)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_router_logits(T, E, M, dtype):
    from turbomoe.kernels.router import router_logits
    g = torch.Generator().manual_seed(T * 31 + E + M)
    x, w = (torch.randn(n, M, generator=g, dtype=torch.float64) for n in (T, E))
    got = router_logits(x.to(DEVICE, dtype), w.to(DEVICE, dtype))
    want = x.to(dtype).double() @ w.to(dtype).double().t()
    assert got.dtype == dtype and got.shape == (T, E)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(got.cpu().double(), want, rtol=tol, atol=tol * M ** 0.5)
    assert torch.equal(got, router_logits(x.to(DEVICE, dtype), w.to(DEVICE, dtype))), "not deterministic"


def test_router_logits_errors():
    from turbomoe.kernels.router import router_logits
    with pytest.raises(ValueError, match="x \\[T, M\\] and w \\[E, M\\]"):
        router_logits(torch.zeros(2, 8, device=DEVICE), torch.zeros(4, 9, device=DEVICE))
    with pytest.raises(ValueError, match="share dtype"):
        router_logits(torch.zeros(2, 8, device=DEVICE), torch.zeros(4, 8, device=DEVICE, dtype=torch.float64))
    assert router_logits(torch.zeros(2, 0, device=DEVICE), torch.zeros(4, 0, device=DEVICE)).abs().sum() == 0


# (counts, K, F, N): empty groups, one group with every row, no rows at all, one group, K not a
# multiple of the K tile, more rows than a row tile (on the interpreter: 16)
FEW_ROWS_CASES = [([0, 3, 0, 1], 40, 12, 24), ([5, 0, 0, 2, 1], 600, 24, 40), ([0, 0, 0], 40, 12, 8), ([1], 700, 16, 32),
                  ([17, 0, 3], 64, 20, 24), ([0, 0, 9], 33, 7, 16),
                  ([1] * 9 + [0, 40], 48, 16, 24),  # many one-row groups and a long one (a shared expert)
                  ([2, 0, 3], 8, 6, 8)]  # F = 6: the up half's columns start 24 bytes in (no TMA: an H100 faulted)


@pytest.mark.parametrize("case", FEW_ROWS_CASES)
@pytest.mark.parametrize("prescale", [False, True])
def test_few_rows_kernels(case, prescale):
    check_few_rows(*case, DEVICE, seed=len(case[0]) + case[1], prescale=prescale)


# the CUDA-core path (one and two rows a tile), tl.dot, and tl.dot with the weights as its M side
@pytest.mark.parametrize("block_m, swap", [(1, False), (2, False), (16, False), (16, True), (32, True)])
@pytest.mark.parametrize("split", [1, 3])  # 1: the first GEMM's SwiGLU epilogue; 3: split partials
@pytest.mark.parametrize("tma", [False, True])
def test_few_rows_kernels_tiles(block_m, swap, split, tma):
    from turbomoe.kernels.few_rows_gemm import Tiles
    check_few_rows([3, 0, 5, 1, 17], 96, 32, 48, DEVICE, seed=block_m + split,
                   tiles=Tiles(block_m, 16, split, 16, 4, 1 if DEVICE == "cpu" else 3, swap, tma))


@pytest.mark.parametrize("case", MOE_CASES)
@pytest.mark.parametrize("mode", ["few_rows", "grouped", "dense"])  # dense: the Triton router and gating
def test_sparse_moe_kernels(case, mode):
    check_moe(*case, mode, DEVICE, backend="triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="programmatic dependent launch runs on a GPU only")
@pytest.mark.parametrize("T", [1, 5, 40])
def test_dependent_launch_same_bits(T, monkeypatch):
    """The decode chain (router, shuffle, few-rows GEMMs, combine) with programmatic dependent launch
    (on Hopper: each kernel scheduled while its producer runs) gives the bits of plain launches,
    eagerly and replayed from a CUDA graph with fresh inputs; on older GPUs both are plain."""
    from turbomoe.inference import SparseMoE
    from turbomoe.kernels import launch
    router, w1, w2, (sw1, sw2) = moe_weights(16, 256, 128, True, seed=T, device="cuda", dtype=torch.bfloat16)
    moe = SparseMoE(router, w1, w2, 2, shared_w1_MN=sw1, shared_w2_FM=sw2, mode="few_rows")
    xs = [torch.randn(T, 256, device="cuda", dtype=torch.bfloat16) for _ in range(3)]

    def run(pdl):
        monkeypatch.setattr(launch, "PDL", pdl)
        eager = [moe(x) for x in xs]
        x_in = xs[0].clone()
        moe(x_in)  # compiled and warm before capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = moe(x_in)
        replays = []
        for x in xs:
            x_in.copy_(x)
            g.replay()
            replays.append(out.clone())
        return eager, replays

    plain_eager, plain_graph = run(False)
    pdl_eager, pdl_graph = run(True)
    for a, b, c, d in zip(plain_eager, plain_graph, pdl_eager, pdl_graph):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)


def _tune_case(T):
    from turbomoe.inference import SparseMoE
    router, w1, w2, (sw1, sw2) = moe_weights(5, 48, 32, True, seed=T, device=DEVICE)
    return SparseMoE(router, w1, w2, 2, shared_w1_MN=sw1, shared_w2_FM=sw2, mode="few_rows")


def _tune_candidates(T, K):
    from turbomoe.kernels.few_rows_gemm import Tiles
    stages = 1 if DEVICE == "cpu" else 2
    return [Tiles(16, 16, split, 16, 4, stages, swap) for split in (1, 2) for swap in (False, True)]


@pytest.mark.parametrize("T, rule_fastest, pair_block_us", [(1, True, None), (3, False, 1.0), (19, False, 2.0),
                                                           (6, False, 1.95)])
def test_tune_few_rows_keeps_the_fastest_pair(T, rule_fastest, pair_block_us, monkeypatch):
    """SparseMoE.tune times the rule and each candidate of both GEMMs (each run), keeps the pair of
    least summed time where the whole block is faster on it by more than the margin (3%: the rule's
    block takes 2.0 here; else the rule: None), reports the block's times, and the block then runs
    those tilings, against the float64 oracle."""
    from turbomoe.kernels import few_rows_gemm
    from turbomoe.kernels.few_rows_gemm import UP_MAX_SPLIT, few_rows_tiles
    moe = _tune_case(T)
    G, M, N1 = moe.w1.shape
    rules = {"up": few_rows_tiles(T, 3 * T, G, N1, M, moe.w1.device, UP_MAX_SPLIT, True),
             "down": few_rows_tiles(T, 3 * T, G, M, 32, moe.w1.device)}
    cost = {("up", _tune_candidates(T, M)[3]): 2.0, ("down", _tune_candidates(T, M)[1]): 1.0}
    timed = []

    def timer(op, tiles, fn):
        out = fn()
        assert torch.isfinite(out).all()
        timed.append((op, tiles))
        if op == "layer":
            return 2.0 if tiles is None else pair_block_us
        return 0.5 if rule_fastest and tiles == rules[op] else cost.get((op, tiles), 9.0)
    report = {}
    table = moe.tune([T], candidates=_tune_candidates, timer=timer, report=report)
    pair = (_tune_candidates(T, M)[3], _tune_candidates(T, M)[1])
    want = (rules["up"], rules["down"]) if rule_fastest else pair if pair_block_us == 1.0 else (None, None)
    assert table == {T: want} and moe.few_rows_tiles is table
    assert report == ({} if rule_fastest else {T: (2.0, pair_block_us)})
    assert [t for op, t in timed if op == "layer"] == ([] if rule_fastest else [None, pair] * 3)
    ups = [t for op, t in timed if op == "up"]
    assert set(ups) == {rules["up"], *_tune_candidates(T, M)} and len(ups) == len(set(ups))
    assert {t for op, t in timed if op == "down"} == {rules["down"], *_tune_candidates(T, 32)}
    used = []
    for name in ("few_rows_up", "few_rows_down"):
        kernel = getattr(few_rows_gemm, name)
        monkeypatch.setattr(few_rows_gemm, name, lambda *a, kernel=kernel, **kw: used.append(kw["tiles"]) or kernel(*a, **kw))
    check_moe(T, 5, 2, 48, 32, "softmax", False, True, False, "few_rows", DEVICE, seed=T, few_rows_tiles=table)
    assert used[:2] == list(want)  # None: the rule's, chosen in the kernels


def test_tune_few_rows_errors():
    moe = _tune_case(4)
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="on a GPU; the experts are on cpu"):
            moe.tune([4])
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="token counts must be positive ints"):
            moe.tune([bad], timer=lambda op, tiles, fn: 1.0)
    assert moe.few_rows_tiles == {}
    grouped = _tune_case(4)
    grouped.mode = "grouped"  # token counts that do not run few_rows are not tuned
    assert grouped.tune([4], timer=lambda op, tiles, fn: 1.0) == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times the kernels on a GPU")
def test_tune_few_rows_on_gpu():
    """The default timer on a GPU (CUDA graphs, cold L2) over every fourth tiling of the space (the
    whole space compiles for minutes): the chosen tilings run the block to the oracle's output, with
    the same bits on every call."""
    from turbomoe.inference import SparseMoE
    from turbomoe.inference.tiling import tile_space
    router, w1, w2, (sw1, sw2) = moe_weights(16, 512, 128, True, seed=5, device="cuda", dtype=torch.bfloat16)
    moe = SparseMoE(router, w1, w2, 1, "sigmoid", False, sw1, sw2, prescale=True)
    table = moe.tune([1, 7, 40, 100000], candidates=lambda T, K: list(tile_space(T, K))[::4])  # 100000: grouped
    assert sorted(table) == [1, 7, 40]
    for T in (1, 7, 40):
        check_moe(T, 16, 1, 512, 128, "sigmoid", False, True, True, "auto", "cuda", torch.bfloat16, tol=2e-2,
                  seed=5, few_rows_tiles=table)
