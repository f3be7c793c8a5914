"""turbomoe.inference: the CPU path (reference and dense modes) against a token-by-token fp64 oracle,
input errors, and on a GPU the CUDA index shuffling and the SparseMoE block in bf16, eager and
replayed from a CUDA graph."""
import json
import os

import pytest
import torch

from conftest import needs_cuda
from inference_cases import MOE_CASES, SHUFFLE_CASES, check_moe, check_shuffle
from turbomoe import csrc
from turbomoe.inference import SparseMoE, index_shuffling


@pytest.mark.parametrize("case", MOE_CASES)
@pytest.mark.parametrize("mode", ["auto", "dense"])
def test_sparse_moe_cpu(case, mode):
    check_moe(*case, mode)  # auto on the CPU: the reference path


def test_index_shuffling_reference_tables():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 1.0, 2.0], [float("nan"), 0.0, 0.0], [0.0, 5.0, 4.0]])
    r = index_shuffling(logits, 2, shared_expert=True)
    assert r.expert_ids.tolist() == [[1, 2, 3], [0, 2, 3], [-1, -1, 3], [1, 2, 3]]
    assert r.counts.tolist() == [1, 2, 3, 4]
    # expert 0: token 1; expert 1: tokens 0, 3; expert 2: tokens 0, 1, 3; shared (3): tokens 0..3
    assert r.slots.tolist() == [[1, 3, 6], [0, 4, 7], [-1, -1, 8], [2, 5, 9]]
    assert r.row_routes.tolist() == [3, 0, 9, 1, 4, 10, 2, 5, 8, 11, -1, -1]  # route t * 3 + j of each row
    assert r.scores[:, 2].tolist() == [1.0] * 4


@pytest.mark.parametrize("bad,match", [
    (dict(k=0), "k must be"), (dict(k=9), "k must be"), (dict(score_func="relu"), "score_func"),
])
def test_index_shuffling_errors(bad, match):
    args = dict(logits_TE=torch.randn(4, 16), k=2)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        index_shuffling(**args)


def test_sparse_moe_errors(monkeypatch):
    r, w1, w2 = torch.randn(4, 8), torch.randn(4, 8, 6), torch.randn(4, 3, 8)
    with pytest.raises(ValueError, match="router"):
        SparseMoE(r, w1, torch.randn(4, 4, 8), 2)
    with pytest.raises(ValueError, match="shared expert must have"):
        SparseMoE(r, w1, w2, 2, shared_w1_MN=torch.randn(8, 4), shared_w2_FM=torch.randn(2, 8))
    with pytest.raises(ValueError, match="both"):
        SparseMoE(r, w1, w2, 2, shared_w1_MN=torch.randn(8, 6))
    with pytest.raises(ValueError, match="prescale"):
        SparseMoE(r, w1, w2, 2, prescale=True)
    with pytest.raises(ValueError, match="mode"):
        SparseMoE(r, w1, w2, 2, mode="fast")
    with pytest.raises(ValueError, match=r"x must be \[T, 8\]"):
        SparseMoE(r, w1, w2, 2)(torch.randn(3, 7))
    with pytest.raises(ValueError, match="x is on meta, the experts on cpu"):
        SparseMoE(r, w1, w2, 2)(torch.randn(3, 8, device="meta"))
    with pytest.raises(ValueError, match="x is torch.bfloat16, the experts torch.float32"):
        SparseMoE(r, w1, w2, 2)(torch.randn(3, 8, dtype=torch.bfloat16))
    # The options are checked as the block is made, not at its first call.
    for bad, match in ((dict(k=0), r"k must be an int in \[1, E = 4\], got 0"), (dict(k=5), "got 5"),
                       (dict(k=2.0), "got 2.0"), (dict(k=True), "got True"),
                       (dict(score_func="relu"), "score_func must be one of"),
                       (dict(backend="cuda_c"), "backend must be one of"),
                       (dict(gmm_backend="cublas"), "gmm_backend must be one of"),
                       (dict(few_rows_per_expert=-1), "few_rows_per_expert must be a non-negative int, got -1"),
                       (dict(dense_max="8"), "dense_max must be a non-negative int, got '8'")):
        with pytest.raises(ValueError, match=match):
            SparseMoE(r, w1, w2, **{"k": 2, **bad})
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for mode in ("few_rows", "grouped"):  # Triton's modes: CUDA tensors or the interpreter
        with pytest.raises(RuntimeError, match=f"mode '{mode}' runs Triton kernels: it needs CUDA tensors"):
            SparseMoE(r, w1, w2, 2, mode=mode)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", SHUFFLE_CASES)
def test_index_shuffling_cuda(case):
    check_shuffle(csrc.index_shuffling, *case, "cuda", seed=7 * case[0] + case[1])


@pytest.mark.gpu
@needs_cuda
def test_index_shuffling_cuda_hot_expert_bf16_large():
    # one block at thousands of tokens (the kernel takes any T; the dispatcher only up to 8), hot experts
    check_shuffle(csrc.index_shuffling, 100, 16, 2, "softmax", True, True, "cuda", seed=3, hot=True)
    check_shuffle(csrc.index_shuffling, 4099, 32, 8, "softmax", True, False, "cuda", seed=6, hot=True)
    check_shuffle(csrc.index_shuffling, 2049, 5, 2, "sigmoid", True, True, "cuda", dtype=torch.bfloat16, seed=7)
    check_shuffle(csrc.index_shuffling, 33, 32, 4, "softmax", False, False, "cuda", dtype=torch.bfloat16, seed=4)
    check_shuffle(csrc.index_shuffling, 33, 33, 4, "softmax", False, False, "cuda", dtype=torch.bfloat16, seed=4)
    check_shuffle(csrc.index_shuffling, 3001, 1000, 8, "softmax", True, True, "cuda", seed=5)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", MOE_CASES)
@pytest.mark.parametrize("mode", ["few_rows", "grouped", "dense"])
def test_sparse_moe_cuda_bf16(case, mode):
    T, E, k, M, F_, *rest = case
    # bf16 sizes the GEMMs accept (K, N multiples of 8); tolerance of bf16 operands and outputs
    check_moe(T, E, k, 64, 32, *rest, mode, "cuda", torch.bfloat16, tol=2e-2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 16, 100])
def test_sparse_moe_cuda_graph(T):
    """The whole block captured in a CUDA graph (no host sync) and replayed on new inputs."""
    from inference_cases import moe_weights
    router, w1, w2, (sw1, sw2) = moe_weights(16, 128, 64, True, 0, "cuda", torch.bfloat16)
    moe = SparseMoE(router, w1, w2, 2, renormalize=True, shared_w1_MN=sw1, shared_w2_FM=sw2)
    x = torch.randn(T, 128, device="cuda", dtype=torch.bfloat16)
    moe(x)  # warm-up: builds and compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, moe(x), rtol=0, atol=0)


def test_tile_table_checked():
    """few_rows_tiles: Tiles or their fields (a JSON round trip), token counts as ints or their
    strings; anything else refused with the entry named."""
    from turbomoe.inference import SparseMoE
    from turbomoe.inference.tiling import check_tile_table
    from turbomoe.kernels.few_rows_gemm import Tiles
    table = {1: (Tiles(1, 64, 4, 64, 4, 2), Tiles(1, 64, 8, 64, 4, 2)),
             64: (Tiles(16, 128, 2, 64, 4, 2, False, True), Tiles(32, 128, 1, 128, 4, 2, True, True))}
    assert check_tile_table(json.loads(json.dumps(table))) == table
    assert check_tile_table({"3": [None, None]}) == {3: (None, None)}  # the rule's tilings at 3 tokens
    assert check_tile_table(None) == {}
    for bad, match in (([1, 2], "must be a dict"), ({0: table[1]}, "keys must be token counts >= 1"),
                       ({"x": table[1]}, "few_rows_tiles\\['x'\\]"), ({2: table[1][:1]}, "a pair of Tiles"),
                       ({2: ((16, 48, 1, 64, 4, 2), table[1][1])}, "invalid tiling"),
                       ({2: ((16, 64, 0, 64, 4, 2), table[1][1])}, "invalid tiling"),
                       ({2: ((8, 64, 1, 64, 4, 2, True), table[1][1])}, "swapped MMA operands need block_m >= 16")):
        with pytest.raises(ValueError, match=match):
            check_tile_table(bad)
    w1, w2 = torch.randn(3, 8, 12), torch.randn(3, 6, 8)
    with pytest.raises(ValueError, match="invalid tiling"):
        SparseMoE(torch.randn(3, 8), w1, w2, 1, few_rows_tiles={2: ((16, 48, 1, 64, 4, 2), table[1][1])})


def test_tile_file(tmp_path):
    """Tile files: a table per (GPU, layer shape, dtype), read back as written; writing updates that
    key's token counts and leaves other keys' tables; a missing file or key reads None; anything not a
    tile file is refused, naming the file."""
    from turbomoe.inference.tiling import read_tile_file, read_tile_tables, tile_key, write_tile_file
    from turbomoe.kernels.few_rows_gemm import Tiles
    path = str(tmp_path / "tiles.json")
    h200 = tile_key("NVIDIA H200", 128, 8, 2048, 768, torch.bfloat16)
    h100 = tile_key("NVIDIA H100 80GB HBM3", 128, 8, 2048, 768, torch.bfloat16)
    assert h200 == {"gpu": "NVIDIA H200", "experts": [128, 8, 2048, 768], "dtype": "bfloat16"}
    assert read_tile_file(path, h200) is None
    a = {8: (Tiles(16, 64, 1, 64, 4, 2), Tiles(16, 128, 8, 64, 4, 2)), 1: (None, None)}
    write_tile_file(path, h200, a)
    write_tile_file(path, h100, {8: (None, None)})
    assert read_tile_file(path, h200) == a and read_tile_file(path, h100) == {8: (None, None)}
    b = {8: (None, None), 64: (Tiles(16, 64, 1, 128, 4, 2, True, True), Tiles(16, 128, 1, 64, 4, 2, True, True))}
    write_tile_file(path, h200, b)
    assert read_tile_file(path, h200) == {1: (None, None), **b}
    assert read_tile_file(path, {**h200, "dtype": "float32"}) is None
    assert read_tile_file(path, h100) == {8: (None, None)}
    assert read_tile_tables(str(tmp_path / "none.json")) == []
    assert [e["for"] for e in read_tile_tables(path)] == [h200, h100]
    assert sorted(os.listdir(tmp_path)) == ["tiles.json"]  # no temporary file left
    for text in ("{", "[]", '{"tables": {}}', '{"tables": ["x"]}', '{"tables": [{"for": "x", "tiles": {}}]}',
                 '{"tables": [{"for": {}, "tiles": {"0": [null, null]}}]}'):
        with open(path, "w") as f:
            f.write(text)
        with pytest.raises(ValueError, match="tiles.json is not a turbomoe tile file"):
            read_tile_file(path, h200)
        with pytest.raises(ValueError, match="tiles.json is not a turbomoe tile file"):
            read_tile_tables(path)
        with pytest.raises(ValueError, match="tiles.json is not a turbomoe tile file"):
            write_tile_file(path, h200, a)
        assert open(path).read() == text  # not overwritten
