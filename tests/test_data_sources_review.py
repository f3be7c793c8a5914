"""A review of the compressed JSON-lines and Parquet corpus sources (turbomoe/data/corpus.py): a cut-short
.zst is an error, not a quietly shorter corpus; upper-case extensions; zstd --long=31 frames; Parquet's
dictionary-encoded and string_view columns; a null past max_tokens' cut is not read; a corrupt data page
names its file; a row group is read a buffer at a time, not whole; a reader missing past the cut."""
import gzip
import io
import json
import sys
from unittest import mock

import numpy as np
import pytest

from turbomoe.data import load_stream
from turbomoe.data.corpus import _documents

zstandard = pytest.importorskip("zstandard")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

DOCS = ["héllo", "", "world " * 300, "\u20ac\U0001f600 <|endoftext|>", "last"]


def lines(docs):
    return "".join(json.dumps({"text": t}) + "\n" for t in docs).encode()


def plain(tmp_path, docs=DOCS):
    (tmp_path / "plain.jsonl").write_bytes(lines(docs))
    return load_stream("jsonl", [str(tmp_path / "plain.jsonl")]).tokens


@pytest.mark.parametrize("where", ["mid-frame", "frame boundary"])
def test_a_cut_short_zst_file_is_an_error(tmp_path, where):
    """zstandard's reader ends quietly where the file ends inside a frame (a download cut short): the
    corpus was a prefix of itself, without a word (cut at a later frame's start: every line whole)."""
    docs = [f"document {i} " * 5 for i in range(3000)]
    c = zstandard.ZstdCompressor()
    if where == "mid-frame":
        whole = c.compress(lines(docs))
        cut = whole[:len(whole) // 2]
    else:  # two frames (as cat a.zst b.zst, or a multi-frame writer), the second cut short
        second = c.compress(lines(docs[1500:]))
        cut = c.compress(lines(docs[:1500])) + second[:len(second) // 2]
    (tmp_path / "cut.jsonl.zst").write_bytes(cut)
    with pytest.raises(ValueError, match=r"cut.jsonl.zst: cannot be read to its end"):
        load_stream("jsonl", [str(tmp_path / "cut.jsonl.zst")])


def test_zst_frames_files_and_streams_read_whole(tmp_path):
    """Several frames, a streamed frame (no content size), a skippable frame, a --long=31 window."""
    want = plain(tmp_path)
    c, data = zstandard.ZstdCompressor(), lines(DOCS)
    skippable = (0x184D2A50).to_bytes(4, "little") + (3).to_bytes(4, "little") + b"abc"
    streamed = io.BytesIO()
    params = zstandard.ZstdCompressionParameters(window_log=31, enable_ldm=True, compression_level=3)
    with zstandard.ZstdCompressor(compression_params=params).stream_writer(streamed, closefd=False) as w:
        w.write(data)  # a window zstd -d reads only with --long=31 (or --memory): as datasets are shared
    for name, blob in (("frames", c.compress(data[:40]) + skippable + c.compress(data[40:])),
                       ("long", streamed.getvalue())):
        (tmp_path / f"{name}.jsonl.zst").write_bytes(blob)
        assert np.array_equal(load_stream("jsonl", [str(tmp_path / f"{name}.jsonl.zst")]).tokens, want), name
    (tmp_path / "empty.jsonl.zst").write_bytes(b"")
    assert np.array_equal(load_stream("jsonl", [str(tmp_path / "empty.jsonl.zst"), str(tmp_path / "plain.jsonl")]).tokens,
                          want)


def test_upper_case_extensions_named_explicitly(tmp_path):
    want = plain(tmp_path)
    (tmp_path / "A.JSONL.GZ").write_bytes(gzip.compress(lines(DOCS)))
    (tmp_path / "B.JSONL.ZST").write_bytes(zstandard.ZstdCompressor().compress(lines(DOCS)))
    for name in ("A.JSONL.GZ", "B.JSONL.ZST"):
        assert np.array_equal(load_stream("jsonl", [str(tmp_path / name)]).tokens, want), name


@pytest.mark.parametrize("kind", ["dictionary", "large dictionary", "string_view", "pandas categorical", "binary",
                                  "large binary"])
def test_parquet_string_columns_of_every_arrow_kind(tmp_path, kind):
    """A dictionary-encoded column (pandas' Categorical, or any table written dictionary-encoded),
    pyarrow's string_view and a binary column (older writers' text without its UTF-8 annotation) hold
    strings too: the same stream as the plain jsonl."""
    want = plain(tmp_path)
    if kind == "pandas categorical":
        pd = pytest.importorskip("pandas")
        pd.DataFrame({"text": pd.Categorical(DOCS)}).to_parquet(tmp_path / "t.parquet")
    else:
        if kind == "string_view" and not hasattr(pa, "string_view"):
            pytest.skip("pyarrow < 16")
        array = {"dictionary": lambda: pa.array(DOCS).dictionary_encode(),
                 "large dictionary": lambda: pa.array(DOCS, pa.large_string()).dictionary_encode(),
                 "string_view": lambda: pa.array(DOCS, pa.string_view()),
                 "binary": lambda: pa.array([d.encode() for d in DOCS], pa.binary()),
                 "large binary": lambda: pa.array([d.encode() for d in DOCS], pa.large_binary())}[kind]()
        pq.write_table(pa.table({"text": array}), str(tmp_path / "t.parquet"), row_group_size=2)
    assert np.array_equal(load_stream("parquet", [str(tmp_path / "t.parquet")]).tokens, want)
    assert load_stream("parquet", [str(tmp_path / "t.parquet")], max_tokens=7).tokens.tolist() == list("héllo".encode()) + [
        load_stream("parquet", [str(tmp_path / "t.parquet")]).tokens[6]]


def test_a_null_past_max_tokens_is_not_read(tmp_path):
    """As a bad jsonl line past the cut (test_corpus_cache_review): a null row after max_tokens' cut stays
    unread, though in the same batch of rows; before the cut it names its row (in a later batch too)."""
    pq.write_table(pa.table({"text": ["hello world"] * 1000 + [None]}), str(tmp_path / "n.parquet"))
    got = load_stream("parquet", [str(tmp_path / "n.parquet")], max_tokens=5)
    assert got.tokens.tolist() == list(b"hello")
    with pytest.raises(ValueError, match=r"n.parquet: row 1001: its 'text' is null"):
        load_stream("parquet", [str(tmp_path / "n.parquet")])
    pq.write_table(pa.table({"text": ["hello world"] * 3000 + [None]}), str(tmp_path / "m.parquet"))
    with pytest.raises(ValueError, match=r"m.parquet: row 3001: its 'text' is null"):
        load_stream("parquet", [str(tmp_path / "m.parquet")])


def test_a_corrupt_parquet_page_names_the_file(tmp_path):
    """A file whose footer reads but a data page does not (bytes damaged in the middle): a ValueError
    naming the file (a config error in the recipe), not pyarrow's bare OSError."""
    pq.write_table(pa.table({"text": [f"document number {i} " * 20 for i in range(5000)]}),
                   str(tmp_path / "good.parquet"), row_group_size=1000)
    blob = bytearray((tmp_path / "good.parquet").read_bytes())
    middle = len(blob) // 2
    blob[middle:middle + 200] = bytes(range(200))
    (tmp_path / "bad.parquet").write_bytes(bytes(blob))
    with pytest.raises(ValueError, match=r"bad.parquet: cannot be read to its end"):
        load_stream("parquet", [str(tmp_path / "bad.parquet")])


def test_two_parquet_columns_of_one_name(tmp_path):
    table = pa.Table.from_arrays([pa.array(["a"]), pa.array(["b"])], names=["text", "text"])
    pq.write_table(table, str(tmp_path / "dup.parquet"))
    with pytest.raises(ValueError, match=r"dup.parquet: 2 columns named 'text'"):
        load_stream("parquet", [str(tmp_path / "dup.parquet")])


def test_a_parquet_row_group_is_not_read_whole(tmp_path):
    """pyarrow's ParquetFile pre-buffers a row group's whole column chunk (memory: the row group's
    compressed size, GBs for a row group of a million documents; 201 MB of RSS for a 141 MB one): read a
    buffer at a time instead. Shown by the peak of pyarrow's memory pool over an 8 MB row group."""
    rng = np.random.default_rng(0)
    blob = bytes(rng.integers(97, 123, 40 * 200_000, dtype=np.uint8)).decode()
    docs = [blob[i * 40:(i + 1) * 40] for i in range(200_000)]
    pq.write_table(pa.table({"text": docs}), str(tmp_path / "one.parquet"), row_group_size=len(docs),
                   compression="none", use_dictionary=False)
    pool, peak, count = pa.default_memory_pool(), 0, 0
    for count, _ in enumerate(_documents("parquet", [str(tmp_path / "one.parquet")], "text"), 1):
        if count % 512 == 0:
            peak = max(peak, pool.bytes_allocated())
    assert count == len(docs)
    assert peak < 4 << 20, f"{peak / 2**20:.1f} MiB of arrow memory while reading an 8 MB row group"


def test_a_missing_reader_past_max_tokens(tmp_path):
    """The cut reached in the first file: a second file whose reader is not installed is never opened
    (an ImportError used to drop the batch read so far)."""
    (tmp_path / "a.jsonl").write_bytes(lines(["hello world", "more"]))
    (tmp_path / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines(["x"])))
    files = [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl.zst")]
    with mock.patch.dict(sys.modules, {"zstandard": None}):
        assert load_stream("jsonl", files, max_tokens=5).tokens.tolist() == list(b"hello")
        with pytest.raises(ImportError, match=r"pip install -e '.\[data\]'"):
            load_stream("jsonl", files)
