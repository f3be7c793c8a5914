"""Pretraining data: byte tokenizer, text/jsonl/stdlib corpora, Megatron .bin/.idx datasets read
through megatron-core's IndexedDataset, and the seeded train/validation samples."""
import json

import numpy as np
import pytest
import torch

from turbomoe.data import ArrayStream, ByteTokenizer, IndexedStream, Samples, load_stream, stdlib_files

EOS = ByteTokenizer.eos_id


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo' # ✓"
    ids = tok.encode(text)
    assert ids.max() < 256 and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(list(ids) + [EOS]) == text


def test_text_and_jsonl(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.txt").write_text("bb")
    (tmp_path / "docs" / "a.txt").write_text("a")
    (tmp_path / "docs" / "skip.md").write_text("not read")
    stream = load_stream("text", [str(tmp_path / "docs")])
    assert stream.read(0, len(stream)).tolist() == [97, EOS, 98, 98, EOS]  # sorted files, EOS after each
    jl = tmp_path / "d.jsonl"
    jl.write_text(json.dumps({"body": "xy"}) + "\n\n" + json.dumps({"body": "z"}) + "\n")
    stream = load_stream("jsonl", [str(jl)], text_key="body")
    assert stream.read(0, 5).tolist() == [120, 121, EOS, 122, EOS]
    assert len(load_stream("jsonl", [str(jl)], text_key="body", max_tokens=2)) == 2
    # Text files are read as bytes: bytes that are not UTF-8 reach the byte tokenizer unchanged.
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "latin1.txt").write_bytes(b"caf\xe9 \xff")
    stream = load_stream("text", [str(tmp_path / "raw")])
    assert stream.read(0, len(stream)).tolist() == list(b"caf\xe9 \xff") + [EOS]


def test_bad_paths_and_records(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_stream("text", [str(tmp_path / "missing.txt")])
    with pytest.raises(FileNotFoundError, match=r"no \*.jsonl / \*.jsonl.gz / \*.jsonl.zst files"):
        load_stream("jsonl", [str(tmp_path)])
    with pytest.raises(ValueError, match="data.paths is empty"):
        load_stream("text", [])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"content": "no text field"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_stream("jsonl", [str(bad)])
    for i, line in enumerate([b'{"text": null}', b'{"text": 3}', b'{"text": "caf\xe9"}']):
        bad = tmp_path / f"bad{i}.jsonl"
        bad.write_bytes(b'{"text": "ok"}\n' + line + b"\n")
        with pytest.raises(ValueError, match=f"bad{i}.jsonl:2: not a UTF-8 JSON object with a 'text' string field"):
            load_stream("jsonl", [str(bad)])
    with pytest.raises(FileNotFoundError, match="missing"):
        load_stream("megatron", [str(tmp_path / "nothing_text_document")])
    with pytest.raises(ValueError, match="data.source"):
        load_stream("csv", [])


def test_stdlib_corpus():
    files = stdlib_files()
    assert len(files) > 100 and all(f.endswith(".py") for f in files)
    assert not any("/test/" in f or "site-packages" in f for f in files)
    stream = load_stream("stdlib", max_tokens=10_000)
    assert len(stream) == 10_000
    assert ByteTokenizer().decode(stream.read(0, 10_000)).count("def ") > 0


def build_megatron(prefix, docs, dtype=np.int32):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in docs:
        builder.add_item(torch.tensor(doc))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


def test_megatron_indexed_dataset(tmp_path):
    rng = np.random.default_rng(0)
    docs_a = [rng.integers(0, 50_000, n).tolist() for n in (5, 1, 17, 3)]
    docs_b = [rng.integers(0, 50_000, n).tolist() for n in (9, 2)]
    build_megatron(tmp_path / "a_text_document", docs_a)
    build_megatron(tmp_path / "b_text_document", docs_b, dtype=np.uint16)
    flat = np.concatenate([np.array(d) for d in docs_a + docs_b])
    stream = load_stream("megatron", [str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document.bin")])
    assert isinstance(stream, IndexedStream) and len(stream) == len(flat)
    for start, length in [(0, len(flat)), (3, 4), (5, 1), (4, 20), (24, 9), (len(flat) - 1, 1)]:
        got = stream.read(start, length)
        assert got.dtype == np.int64 and got.tolist() == flat[start:start + length].tolist(), (start, length)
    samples = Samples(stream, seq_len=4, valid_fraction=0.2, seed=0)
    assert samples.sample(2).tolist() == flat[8:13].tolist()


def toy_samples(seed=0):
    """100 samples of 10 tokens over the stream 0, 1, 2, ...: sample i starts with token 10 * i."""
    return Samples(ArrayStream(np.arange(1001)), seq_len=10, valid_fraction=0.1, seed=seed)


def test_samples_split_and_windows():
    s = toy_samples()
    assert len(s.train_ids) + len(s.valid_ids) == 100 and len(s.valid_ids) == 10
    assert not set(s.train_ids) & set(s.valid_ids)
    assert s.sample(7).tolist() == list(range(70, 81))  # inputs and next-token labels overlap by one


def test_samples_deterministic_order_covers_every_sample_once_per_epoch():
    a, b, other = toy_samples(seed=5), toy_samples(seed=5), toy_samples(seed=6)
    world, micro, accum = 2, 3, 2
    per_step = world * micro * accum
    seen = []
    for step in range(len(a.train_ids) // per_step):
        for m in range(accum):
            for rank in range(world):
                batch = a.train_batch(step, m, accum, rank, world, micro)
                assert np.array_equal(batch, b.train_batch(step, m, accum, rank, world, micro))
                seen += [int(row[0]) // 10 for row in batch]
    assert len(seen) == len(set(seen)) and set(seen) <= set(a.train_ids.tolist())
    assert not np.array_equal(a.train_batch(0, 0, 1, 0, 1, 4), other.train_batch(0, 0, 1, 0, 1, 4))
    # The next epoch is reshuffled.
    n = len(a.train_ids)
    assert [a._train_sample_id(i) for i in range(n)] != [a._train_sample_id(n + i) for i in range(n)]


def test_validation_batches_and_small_corpora():
    s = toy_samples()
    v0, v1 = s.valid_batches(0, 2, 2, 8), s.valid_batches(1, 2, 2, 8)
    assert len(v0) == len(v1) == 2  # 10 samples: 2 full rounds of 2 ranks x 2
    rows = {tuple(r) for b in v0 + v1 for r in b}
    assert len(rows) == 8
    with pytest.raises(ValueError, match="fewer than one batch"):
        s.valid_batches(0, 4, 4, 1)
    with pytest.raises(ValueError, match="too few"):
        Samples(load_stream("stdlib", max_tokens=15), 10, 0.5, 0)


@pytest.mark.parametrize("seq_len", [0, -4, 2.0, True])
def test_samples_bad_seq_len_is_a_clear_error(seq_len):
    """Before, seq_len 0 raised ZeroDivisionError and a negative one a 'too few tokens' error."""
    with pytest.raises(ValueError, match="data.seq_len must be a positive int"):
        Samples(ArrayStream(np.arange(1000)), seq_len, 0.1, 0)


def word_tokenizer(path, words, eos="<eos>"):
    """A Hugging Face tokenizer directory (transformers' PreTrainedTokenizerFast) over whitespace words:
    id i is words[i], then [UNK] and eos (None: no EOS token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {w: i for i, w in enumerate([*words, "[UNK]", *([eos] if eos else [])])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token=eos).save_pretrained(str(path))
    return str(path)


def test_corpus_in_a_hugging_face_tokenizer(tmp_path):
    """Text corpora in a model's own vocabulary (data.tokenizer): each document's ids, then the
    tokenizer's EOS; ids past uint16 kept (a 70,002-word vocabulary); a directory holding the byte
    tokenizer reads as bytes (same ids, raw bytes); no tokenizer there, or one without EOS: errors."""
    from turbomoe.data import HFTokenizer, corpus_tokenizer
    from turbomoe.data.tokenizer import is_byte_tokenizer
    words = [f"w{i}" for i in range(70000)]
    path = word_tokenizer(tmp_path / "tok", words)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("w1 w69999 nope")
    (tmp_path / "docs" / "b.txt").write_bytes(b"w65536 \xff w7")  # not UTF-8: U+FFFD, an unknown word
    name, tok = corpus_tokenizer(path)
    assert name == str(tmp_path / "tok") and isinstance(tok, HFTokenizer) and tok.vocab_size == 70002
    unk, eos = 70000, 70001
    stream = load_stream("text", [str(tmp_path / "docs")], tokenizer=tok)
    assert stream.tokens.dtype == np.uint32
    assert stream.read(0, len(stream)).tolist() == [1, 69999, unk, eos, 65536, unk, 7, eos]
    assert corpus_tokenizer(None, path)[0] == name  # a model directory's own tokenizer by default
    # The byte tokenizer, saved as transformers reads it: the byte tokenizer itself.
    (tmp_path / "bytes").mkdir()
    ByteTokenizer().save_pretrained(str(tmp_path / "bytes"), model_max_length=64)
    assert is_byte_tokenizer(str(tmp_path / "bytes")) and not is_byte_tokenizer(path)
    for spec, model_dir in (("bytes", path), (None, None), (None, str(tmp_path / "docs")), (str(tmp_path / "bytes"), None)):
        name, got = corpus_tokenizer(spec, model_dir)
        assert name == "bytes" and isinstance(got, ByteTokenizer), (spec, model_dir)
    with pytest.raises(FileNotFoundError, match="no Hugging Face tokenizer files"):
        corpus_tokenizer(str(tmp_path / "docs"))
    # Without transformers (model.init_from needs only the export extra): the byte tokenizer is still
    # found; another one names the extra it needs.
    import sys
    from unittest import mock
    with mock.patch.dict(sys.modules, {"transformers": None}):
        assert corpus_tokenizer(None, str(tmp_path / "bytes"))[0] == "bytes"
        with pytest.raises(ImportError, match=r"pip install -e '.\[transformers\]'"):
            corpus_tokenizer(None, path)
    with pytest.raises(ValueError, match="has no EOS token"):
        corpus_tokenizer(word_tokenizer(tmp_path / "no_eos", words[:5], eos=None))


DOCS = ["héllo", "", "world " * 300, "\u20ac\U0001f600 <|endoftext|>", "last"]


def test_compressed_json_lines_and_parquet(tmp_path):
    """.jsonl.gz, .jsonl.zst and Parquet (a row a document, row groups of two) give the plain jsonl's
    stream; a directory is searched for the three jsonl kinds; other columns are not read."""
    zstandard = pytest.importorskip("zstandard")
    pa = pytest.importorskip("pyarrow")
    import gzip

    import pyarrow.parquet as pq
    lines = "".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(DOCS)).encode()
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "a.jsonl").write_bytes(lines)
    want = load_stream("jsonl", [str(tmp_path / "j" / "a.jsonl")]).tokens
    assert len(want) == sum(len(t.encode()) + 1 for t in DOCS if t)
    (tmp_path / "j" / "b.jsonl.gz").write_bytes(gzip.compress(lines))
    (tmp_path / "j" / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    for name in ("b.jsonl.gz", "c.jsonl.zst"):
        assert np.array_equal(load_stream("jsonl", [str(tmp_path / "j" / name)]).tokens, want), name
    assert np.array_equal(load_stream("jsonl", [str(tmp_path / "j")]).tokens, np.concatenate([want] * 3))
    for large in (False, True):
        table = pa.table({"id": list(range(len(DOCS))),
                          "body": pa.array(DOCS, pa.large_string() if large else pa.string())})
        pq.write_table(table, str(tmp_path / f"p{large}.parquet"), row_group_size=2)
        got = load_stream("parquet", [str(tmp_path / f"p{large}.parquet")], text_key="body")
        assert np.array_equal(got.tokens, want) and len(load_stream(
            "parquet", [str(tmp_path / f"p{large}.parquet")], text_key="body", max_tokens=7)) == 7


def test_compressed_and_parquet_errors_name_the_file(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    pa = pytest.importorskip("pyarrow")
    import gzip

    import pyarrow.parquet as pq
    whole = gzip.compress(b'{"text": "ok"}\n' * 1000)
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[:-20])
    (tmp_path / "bad.jsonl.zst").write_bytes(b"not zstandard")
    (tmp_path / "line.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b'{"text": "ok"}\n{"text": 3}\n'))
    for name, message in (("cut.jsonl.gz", "cut.jsonl.gz: cannot be read to its end"),
                          ("bad.jsonl.zst", "bad.jsonl.zst: cannot be read to its end"),
                          ("line.jsonl.zst", "line.jsonl.zst:2: not a UTF-8 JSON object")):
        with pytest.raises(ValueError, match=message):
            load_stream("jsonl", [str(tmp_path / name)])
    (tmp_path / "not.parquet").write_bytes(b"PAR1 but not really")
    pq.write_table(pa.table({"text": ["a", None, "c"]}), str(tmp_path / "null.parquet"))
    pq.write_table(pa.table({"text": [1, 2]}), str(tmp_path / "ints.parquet"))
    for name, message in (("not.parquet", "not.parquet: not a Parquet file"),
                          ("null.parquet", r"null.parquet: row 2: its 'text' is null"),
                          ("ints.parquet", "ints.parquet: column 'text' is int64, not strings")):
        with pytest.raises(ValueError, match=message):
            load_stream("parquet", [str(tmp_path / name)])
    with pytest.raises(ValueError, match=r"no column 'body' \(data.text_key\); its columns: \['text'\]"):
        load_stream("parquet", [str(tmp_path / "null.parquet")], text_key="body")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no \*.parquet files"):
        load_stream("parquet", [str(tmp_path / "empty_dir")])
    import sys
    from unittest import mock
    with mock.patch.dict(sys.modules, {"zstandard": None, "pyarrow": None, "pyarrow.parquet": None}):
        with pytest.raises(ImportError, match=r"pip install -e '.\[data\]'"):
            load_stream("jsonl", [str(tmp_path / "line.jsonl.zst")])
        with pytest.raises(ImportError, match=r"pip install -e '.\[data\]'"):
            load_stream("parquet", [str(tmp_path / "null.parquet")])


def test_recipe_reads_a_parquet_corpus(tmp_path, monkeypatch):
    """data.source parquet through the recipe's prepare (the corpus cache on): the stream load_stream
    reads in memory; pyarrow missing is a config error naming the extra."""
    pa = pytest.importorskip("pyarrow")
    pytest.importorskip("deepspeed")
    import os
    import sys

    import pyarrow.parquet as pq
    from launching import ROOT
    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    import pretrain
    from recipe_config import ConfigError
    pq.write_table(pa.table({"content": [f"def f{i}(x):\n    return x * {i}\n" * 20 for i in range(1000)]}),
                   str(tmp_path / "c.parquet"), row_group_size=64)
    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = ["--config", os.path.join(ROOT, "recipes", "configs", "tiny-cpu.yaml"), "--set", "data.source=parquet",
            "--set", f"data.paths=[{tmp_path / 'c.parquet'}]", "--set", "data.text_key=content",
            "--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", f"log.dir={tmp_path / 'log'}",
            "--set", "moe.ep_size=1"]
    samples = pretrain.prepare(pretrain.parse_args(argv))[2]
    assert isinstance(samples.stream.tokens, np.memmap)
    assert np.array_equal(samples.stream.tokens, load_stream("parquet", [str(tmp_path / "c.parquet")], "content").tokens)
    from unittest import mock
    with mock.patch.dict(sys.modules, {"pyarrow": None, "pyarrow.parquet": None}):
        with pytest.raises(ConfigError, match=r"pip install -e '.\[data\]'"):
            pretrain.prepare(pretrain.parse_args([*argv, "--set", "data.cache=false"]))
