"""A review of the inference path's few-rows GEMMs (turbomoe.kernels.few_rows_gemm: few_rows_up /
few_rows_down, the tile rule few_rows_tiles) and their tile tables (turbomoe.inference.tiling:
check_tile_table, the tile files) as SparseMoE's few_rows mode uses them, against the float64 oracle
and SparseMoE's reference mode.

Covers what test_inference_triton.py / test_fuzz_inference_triton.py / test_tiling*.py do not: fp16;
the GPU rule's own tilings (as a tune or a tile file stores them: 64- and 128-wide N and K tiles,
32-row swapped tiles, K split up to 16 ways) run under the interpreter; strided x rows,
weights in permuted storage, column slices and stride-0 (expanded) x and weights, with and without
TMA; tables made for another layer shape used on this one; more corrupt tile files; and the faults
found (fixed; their tests below): counts read at unit stride whatever their stride, a zero-width layer
(K = 0) dividing by zero before the kernels' own K = 0 branch, and tile tables that passed the check
but could not run.

Runs natively on a GPU; on the CPU under TRITON_INTERPRET=1 (set here where no GPU is, before
turbomoe's kernels are defined). bf16 is left out: the interpreter's bf16 tl.dot is wrong.
"""
import os

import torch

if not torch.cuda.is_available():  # the interpreter is read when kernels are defined: before turbomoe
    os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402

import pytest  # noqa: E402

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU, or TRITON_INTERPRET=1 on the CPU", allow_module_level=True)

from turbomoe import reference as ref  # noqa: E402
from turbomoe.autograd.swiglu import swiglu_reference  # noqa: E402
from turbomoe.inference import SparseMoE  # noqa: E402
from turbomoe.inference.tiling import (check_tile_table, read_tile_file, read_tile_tables, tile_key,  # noqa: E402
                                       write_tile_file)
from turbomoe.kernels import few_rows_gemm  # noqa: E402
from turbomoe.kernels.few_rows_gemm import (UP_MAX_SPLIT, Tiles, combine, few_rows_down, few_rows_tiles,  # noqa: E402
                                            few_rows_up)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 3e-3}


def rel_err(got, want):
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape, (got.shape, want.shape)
    return ((got - want).norm() / want.norm().clamp_min(1e-300)).item()


def shuffled(T, E, k, shared, seed, hot=False):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=gen)
    if hot:  # expert 0 first for every token, the last expert never chosen
        logits[:, 0] += 50
        logits[:, -1] -= 50
    return ref.index_shuffling(logits, k, "softmax", False, shared), gen


def oracle(x_TK, r, w1_GKN, w2_GFK):
    """The combine [T, K] of the shuffled rows in float64 (x read in its dtype, the SwiGLU rows rounded
    to it, as the kernels do)."""
    kk, n = r.slots.shape[1], int(r.counts.sum())
    route = r.row_routes[:n].long()
    group = torch.repeat_interleave(torch.arange(len(r.counts)), r.counts.long())
    a = x_TK.double().cpu()[route // kk]
    h = torch.einsum("rk,rkn->rn", a, w1_GKN.double().cpu()[group])
    y = torch.einsum("rk,rkn->rn", swiglu_reference(h).to(x_TK.dtype).double(), w2_GFK.double().cpu()[group])
    return ref.gather_tokens(y, r.slots, r.scores.double())


def chain(x, r, w1, w2, up_tiles, down_tiles, dtype, counts=None):
    counts = r.counts.to(DEV) if counts is None else counts
    kk = r.slots.shape[1]
    h = few_rows_up(x, r.row_routes.to(DEV), kk, w1, counts, x.shape[0], tiles=up_tiles)
    y = few_rows_down(h, w2, counts, x.shape[0], tiles=down_tiles)
    return combine(y, r.slots.to(DEV), r.scores.to(DEV), dtype)


def gpu_rule(T, kk, G, M, F, monkeypatch, sms=132):
    """few_rows_tiles' CUDA rule (what SparseMoE runs on a GPU with no table, and what a tune stores
    where the rule wins), computed for a GPU of sms SMs whatever this machine has."""
    monkeypatch.setattr(few_rows_gemm, "sm_count", lambda device: sms)
    cuda = torch.device("cuda")
    return (few_rows_tiles(T, T * kk, G, 2 * F, M, cuda, UP_MAX_SPLIT, True),
            few_rows_tiles(T, T * kk, G, M, F, cuda))


# ------------------------------------------------------------------------------ checked correct

def test_gpu_rule_tilings_are_valid_tables(monkeypatch):
    """The CUDA rule's tilings over decode shapes (T = 1 .. 384, E up to 128, k up to 8, Qwen3's and
    Scout's widths, odd widths) pass check_tile_table, so that a tune that keeps the rule can store
    them in a tile file (write_tile_file refuses an invalid one)."""
    seen = set()
    for T in (1, 2, 3, 8, 13, 16, 31, 64, 100, 256, 384):
        for E, k in ((1, 1), (16, 1), (17, 2), (128, 8)):
            for M, F in ((40, 6), (100, 24), (2048, 768), (5120, 8192)):
                for sms in (4, 78, 132):
                    pair = gpu_rule(T, k, E, M, F, monkeypatch, sms)
                    assert check_tile_table({T: pair}) == {T: pair}, (T, E, k, M, F)
                    seen.update(pair)
    assert {t.block_m for t in seen} == {1, 16, 32} and max(t.split for t in seen) >= 8


# (T, E, k, K, F, shared, hot): T = 1 (one-row tiles, K split), a few rows (16-row tiles, K split),
# many (32-row swapped tiles); K and F not multiples of 16; one expert holding every token
RULE_CASES = [(1, 6, 2, 520, 72, True, False), (5, 4, 2, 264, 40, False, True), (40, 3, 2, 200, 72, True, False),
              (33, 2, 1, 72, 24, False, True)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
@pytest.mark.parametrize("T,E,k,K,F,shared,hot", RULE_CASES)
def test_gpu_rule_tilings_under_the_interpreter(T, E, k, K, F, shared, hot, dtype, monkeypatch):
    """The three launches on the GPU rule's tilings for this layer (TMA where the weights allow, K split
    or not) against the float64 oracle, in fp64 / fp32 / fp16, twice to the same bits."""
    r, gen = shuffled(T, E, k, shared, seed=T * 10 + E, hot=hot)
    G, kk = E + shared, k + shared
    up_tiles, down_tiles = gpu_rule(T, kk, G, K, F, monkeypatch)
    x = torch.randn(T, K, generator=gen, dtype=torch.float64).to(dtype)
    w1 = (torch.randn(G, K, 2 * F, generator=gen, dtype=torch.float64) * K ** -0.5).to(dtype)
    w2 = (torch.randn(G, F, K, generator=gen, dtype=torch.float64) * F ** -0.5).to(dtype)
    want = oracle(x, r, w1, w2)
    got = chain(x.to(DEV), r, w1.to(DEV), w2.to(DEV), up_tiles, down_tiles, dtype)
    assert got.dtype == dtype and rel_err(got, want) < TOL[dtype], (up_tiles, down_tiles)
    assert torch.equal(got, chain(x.to(DEV), r, w1.to(DEV), w2.to(DEV), up_tiles, down_tiles, dtype))


# tilings of every kind: the rule's (None), CUDA-core rows 1 and 4 (K split 2 ways), tl.dot 16 rows
# with and without TMA, 32-row swapped tl.dot split 2 ways
KINDS = [None, Tiles(1, 16, 1, 16, 4, 1), Tiles(4, 32, 2, 16, 4, 1), Tiles(16, 16, 1, 16, 4, 1, False, False),
         Tiles(16, 32, 1, 32, 4, 1), Tiles(32, 16, 2, 16, 4, 1, True, True)]


def test_few_rows_strided_and_broadcast_operands():
    """x with rows strided in a wider buffer, and expanded (stride 0 rows); weights in permuted
    storage ([K, G, N] viewed as [G, K, N]), a column slice of wider weights, and an expanded single
    expert (stride 0 groups): the contiguous operands' output within fp32's rounding, for every
    tiling kind."""
    T, E, k, K, F = 9, 4, 2, 32, 16
    r, gen = shuffled(T, E, k, False, seed=11)
    x = torch.randn(T, K, generator=gen)
    w1 = torch.randn(E, K, 2 * F, generator=gen) * K ** -0.5
    w2 = torch.randn(E, F, K, generator=gen) * F ** -0.5
    wide_x = torch.randn(T, 2 * K + 3, generator=gen)
    wide_x[:, 5:5 + K] = x
    wide_w1 = torch.randn(E, K, 2 * F + 8, generator=gen)
    wide_w1[..., :2 * F] = w1
    layouts = {"strided x rows": (wide_x[:, 5:5 + K], w1, w2),
               "permuted weights": (x, w1.permute(1, 0, 2).contiguous().permute(1, 0, 2),
                                    w2.permute(1, 0, 2).contiguous().permute(1, 0, 2)),
               "column-sliced w1": (x, wide_w1[..., :2 * F], w2),
               "expanded x": (x[3:4].expand(T, K), w1, w2),
               "expanded weights": (x, w1[1:2].expand(E, K, 2 * F), w2[2:3].expand(E, F, K))}
    for name, (xs, w1s, w2s) in layouts.items():
        want = oracle(xs, r, w1s, w2s)
        for tiles in KINDS:
            got = chain(xs.to(DEV), r, w1s.to(DEV), w2s.to(DEV), tiles, tiles, torch.float32)
            assert rel_err(got, want) < 1e-5, (name, tiles)


# (T, E, k, M, F, shared, prescale, hot): T = 1, T not a multiple of the interpreter's 16-row tile,
# one expert (E = 1), a shared expert, Llama 4's prescale, one expert with every token
FP16_MOE = [(1, 6, 2, 24, 12, True, False, False), (7, 5, 1, 20, 10, True, True, False),
            (17, 1, 1, 20, 10, False, False, False), (33, 6, 2, 24, 12, True, False, True)]


@pytest.mark.parametrize("T,E,k,M,F,shared,prescale,hot", FP16_MOE)
def test_sparse_moe_few_rows_fp16(T, E, k, M, F, shared, prescale, hot):
    """SparseMoE's few_rows mode in fp16 (no other test runs fp16 through these kernels) against the
    reference mode, and with a table for T holding other tilings (a CUDA-core one and a swapped
    tl.dot one): the same result within fp16's rounding; deterministic."""
    gen = torch.Generator().manual_seed(T * 100 + E)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(torch.float16)
    router = rnd(E, M)
    x = rnd(T, M)
    if hot:
        router[0] = (x.double().sum(0) * 5).to(torch.float16)
        router[-1] = -router[0]
    w1, w2 = rnd(E, M, 2 * F, scale=M ** -0.5), rnd(E, F, M, scale=F ** -0.5)
    sw = (rnd(M, 2 * F, scale=M ** -0.5), rnd(F, M, scale=F ** -0.5)) if shared else (None, None)
    args = tuple(None if t is None else t.to(DEV) for t in (router, w1, w2)) + (k, "sigmoid" if prescale else "softmax",
                                                                                  False)
    args += tuple(None if t is None else t.to(DEV) for t in sw) + (prescale, )
    want = SparseMoE(*args, mode="reference", backend="reference")(x.to(DEV))
    for table in (None, {T: (Tiles(2, 16, 2, 16, 4, 1), Tiles(32, 16, 1, 16, 4, 1, True, True))}):
        moe = SparseMoE(*args, mode="few_rows", backend="triton", few_rows_tiles=table)
        got = moe(x.to(DEV))
        assert got.dtype == torch.float16 and rel_err(got, want) < 5e-3, table
        assert torch.equal(got, moe(x.to(DEV)))


def test_tables_for_other_shapes_and_missing_entries(monkeypatch, tmp_path):
    """A tile table from a file measured for another layer (the GPU rule's tilings for Qwen3-30B-A3B's
    shape, block_k 128 past this layer's K) used on a small fp32 layer: its output equals the
    reference mode's; a table with no entry for this T runs the rule; the table read back from the
    file gives the same bits as the table itself."""
    T, E, k, M, F = 8, 5, 2, 40, 12
    qwen = {t: gpu_rule(t, 8, 128, 2048, 768, monkeypatch) for t in (1, 8, 64)}
    path = str(tmp_path / "tiles.json")
    key = tile_key("NVIDIA H100 80GB HBM3", 128, 8, 2048, 768, torch.bfloat16)
    write_tile_file(path, key, qwen)
    table = read_tile_file(path, key)
    assert table == qwen
    gen = torch.Generator().manual_seed(3)
    router, x = torch.randn(E, M, generator=gen), torch.randn(T, M, generator=gen)
    w1, w2 = torch.randn(E, M, 2 * F, generator=gen) * M ** -0.5, torch.randn(E, F, M, generator=gen) * F ** -0.5
    args = (router.to(DEV), w1.to(DEV), w2.to(DEV), k)
    want = SparseMoE(*args, mode="reference", backend="reference")(x.to(DEV))
    outs = []
    for tiles in (table, qwen, {1: qwen[1]}, None):  # {1: ...}: no entry for T = 8, the rule
        got = SparseMoE(*args, mode="few_rows", few_rows_tiles=tiles)(x.to(DEV))
        assert rel_err(got, want) < 1e-5, tiles
        outs.append(got)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[2], outs[3])


@pytest.mark.parametrize("text", ["null", "3", '"tables"', '{"tables": null}',
                                  '{"tables": [{"for": {}, "tiles": {"8": [[16, 16, 1, 16, 4, 1]]}}]}',
                                  '{"tables": [{"for": {}, "tiles": {"8": [[16.0, 16, 1, 16, 4, 1], null]}}]}',
                                  '{"tables": [{"for": {}, "tiles": {"8": [[16, 16, 1, 16, 4, 1, true, true, 0], '
                                  'null]}}]}',
                                  '{"tables": [{"tiles": {}}]}', '{"tables": [{"for": [], "tiles": {}}]}'])
def test_corrupt_tile_files_refused_and_kept(text, tmp_path):
    """More files that are not tile files (other JSON values, a pair of one tiling, float or extra
    fields, an entry without its key or with a list for one): read and write refuse them naming the
    file, and a write leaves the file as it was."""
    path = tmp_path / "tiles.json"
    path.write_text(text)
    key = tile_key("NVIDIA H200", 16, 1, 5120, 8192, torch.bfloat16)
    for call in (lambda: read_tile_tables(str(path)), lambda: read_tile_file(str(path), key),
                 lambda: write_tile_file(str(path), key, {8: (None, None)})):
        with pytest.raises(ValueError, match="tiles.json is not a turbomoe tile file"):
            call()
    assert path.read_text() == text and sorted(os.listdir(tmp_path)) == ["tiles.json"]
    path.write_bytes(b"\xff\xfe{")  # not UTF-8
    with pytest.raises(ValueError, match="tiles.json is not a turbomoe tile file"):
        read_tile_tables(str(path))


# ---------------------------------------------------------------------------------- faults found

@pytest.mark.parametrize("tiles", [None, Tiles(2, 16, 1, 16, 4, 1)])
def test_few_rows_strided_counts(tiles):
    """counts as a strided view (a column of a [G, 2] table) must give the contiguous counts' output,
    or be refused with a ValueError."""
    T, E, k, K, F = 9, 4, 2, 32, 16
    r, gen = shuffled(T, E, k, False, seed=1)
    x = torch.randn(T, K, generator=gen).to(DEV)
    w1 = (torch.randn(E, K, 2 * F, generator=gen) * K ** -0.5).to(DEV)
    w2 = (torch.randn(E, F, K, generator=gen) * F ** -0.5).to(DEV)
    counts = r.counts.to(DEV)
    strided = torch.stack([counts, torch.full_like(counts, 5)], 1)[:, 0]  # made on DEV: .to() would copy it contiguous
    assert torch.equal(strided.cpu(), r.counts) and strided.stride() == (2, )
    n = int(r.counts.sum())
    want_h = few_rows_up(x, r.row_routes.to(DEV), k, w1, r.counts.to(DEV), T, tiles=tiles)
    want_y = few_rows_down(want_h, w2, r.counts.to(DEV), T, tiles=tiles)
    try:
        h = few_rows_up(x, r.row_routes.to(DEV), k, w1, strided, T, tiles=tiles)
        y = few_rows_down(want_h, w2, strided, T, tiles=tiles)
    except ValueError:
        return  # refused: fine
    assert torch.equal(h[..., :n, :], want_h[..., :n, :]), "few_rows_up read strided counts wrong"
    assert torch.equal(y[:, :n], want_y[:, :n]), "few_rows_down read strided counts wrong"


@pytest.mark.parametrize("M,F", [(8, 0), (0, 8)])
def test_sparse_moe_few_rows_zero_width(M, F):
    """A zero-width layer (F = 0: w1 [E, M, 0], w2 [E, 0, M]; or M = 0) through few_rows gives the
    reference mode's output (zeros, or [T, 0])."""
    T, E, k = 5, 3, 2
    gen = torch.Generator().manual_seed(M + F)
    args = (torch.randn(E, M, generator=gen).to(DEV), torch.randn(E, M, 2 * F, generator=gen).to(DEV),
            torch.randn(E, F, M, generator=gen).to(DEV), k)
    x = torch.randn(T, M, generator=gen).to(DEV)
    want = SparseMoE(*args, mode="reference", backend="reference")(x)
    assert want.shape == (T, M) and not want.any()
    got = SparseMoE(*args, mode="few_rows")(x)
    assert got.shape == (T, M) and torch.equal(got, want)


@pytest.mark.parametrize("fields", [[True, 16, 1, 16, 4, 1], [8, 512, 1, 512, 4, 1]])
def test_tile_file_tiling_that_cannot_run(fields, tmp_path):
    """A tile file holding a tiling the kernels cannot run (block_m `true`; 8 x 512 x 512 CUDA-core
    products, 2**21 elements) is refused when read, or the layer runs on it to the reference's
    output."""
    T, E, k, M, F = 5, 4, 2, 24, 12
    key = tile_key("NVIDIA H200", E, k, M, F, torch.float32)
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"tables": [{"for": key, "tiles": {str(T): [fields, None]}}]}))
    try:
        table = read_tile_file(str(path), key)
    except ValueError as e:
        assert "invalid tiling" in str(e)
        return
    gen = torch.Generator().manual_seed(5)
    args = (torch.randn(E, M, generator=gen).to(DEV), (torch.randn(E, M, 2 * F, generator=gen) * 0.2).to(DEV),
            (torch.randn(E, F, M, generator=gen) * 0.3).to(DEV), k)
    x = torch.randn(T, M, generator=gen).to(DEV)
    want = SparseMoE(*args, mode="reference", backend="reference")(x)
    got = SparseMoE(*args, mode="few_rows", few_rows_tiles=table)(x)
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("counts", [8, "8", None])
def test_tune_names_token_counts_that_are_no_sequence(counts):
    """moe.tune(8) failed with "'int' object is not iterable"; a string iterated as its characters."""
    gen = torch.Generator().manual_seed(9)
    moe = SparseMoE(torch.randn(4, 8, generator=gen), torch.randn(4, 8, 12, generator=gen),
                    torch.randn(4, 6, 8, generator=gen), 2)
    with pytest.raises(TypeError, match="token counts must be a sequence"):
        moe.tune(counts)
