"""The corpus cache (turbomoe/data/cache.py, the recipe's data.cache): a text corpus tokenized once into
a file that later calls and other processes map; the same tokens, dtype and digest as in memory; a new
entry for anything the tokens depend on; incomplete entries rebuilt; ranks starting together tokenize
once; a directory that cannot be written costs a warning, not the run."""
import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from test_data import word_tokenizer
from turbomoe.data import ByteTokenizer, load_stream
from turbomoe.data import cache as corpus_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def corpus(tmp_path, name="docs", docs=("def f(x):\n    return x\n", "", "héllo wörld\n" * 50, "w1 w2 w3")):
    d = tmp_path / name
    d.mkdir()
    for i, text in enumerate(docs):
        (d / f"{i:02d}.txt").write_text(text)
    return str(d)


def entries(cache_dir):
    return sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(cache_dir, "*.json")))


def tokenizers(tmp_path):
    pytest.importorskip("transformers")
    from turbomoe.data import HFTokenizer
    return ByteTokenizer(), HFTokenizer(word_tokenizer(tmp_path / "words", [f"w{i}" for i in range(70000)]))  # uint32 ids


@pytest.mark.parametrize("max_tokens", [0, 7, 10 ** 6])
def test_cached_stream_is_the_in_memory_stream(tmp_path, max_tokens):
    """Same tokens, dtype and digest (the resume's check) from the first call, which writes the entry,
    and from a later one, which maps it without tokenizing; text and jsonl, bytes and a word vocabulary."""
    docs = corpus(tmp_path)
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps({"body": t}) for t in ("a b", "", "w5 w69999 é")) + "\n")
    cache_dir = str(tmp_path / "cache")
    for tok in tokenizers(tmp_path):
        for source, paths, key in (("text", [docs], "text"), ("jsonl", [str(jl)], "body")):
            want = load_stream(source, paths, key, max_tokens, tok)
            first = load_stream(source, paths, key, max_tokens, tok, cache_dir)
            encode = tok.encode_batch
            tok.encode_batch = None  # a second call must not tokenize
            try:
                second = load_stream(source, paths, key, max_tokens, tok, cache_dir)
            finally:
                tok.encode_batch = encode
            for got in (first, second):
                assert isinstance(got.tokens, np.memmap) and got.tokens.dtype == want.tokens.dtype
                assert np.array_equal(got.tokens, want.tokens) and got.digest == want.digest
    assert len(entries(cache_dir)) == 4


def test_what_makes_a_new_entry(tmp_path):
    """The documents' bytes, the split into documents, max_tokens and the tokenizer name an entry; the
    files' names and places do not."""
    cache_dir = str(tmp_path / "cache")
    docs = corpus(tmp_path)
    load_stream("text", [docs], cache_dir=cache_dir)
    moved = str(tmp_path / "moved")
    os.rename(docs, moved)
    load_stream("text", [moved], cache_dir=cache_dir)
    assert len(entries(cache_dir)) == 1
    with open(os.path.join(moved, "02.txt"), "a") as f:
        f.write("x")  # an edit: another entry, its own tokens
    edited = load_stream("text", [moved], cache_dir=cache_dir)
    assert len(entries(cache_dir)) == 2 and np.array_equal(edited.tokens, load_stream("text", [moved]).tokens)
    # The same bytes cut into other files are other documents (end-of-document ids between them).
    a, b = corpus(tmp_path, "a", ["ab", "c"]), corpus(tmp_path, "b", ["a", "bc"])
    assert load_stream("text", [a], cache_dir=cache_dir).tokens.tolist() != \
        load_stream("text", [b], cache_dir=cache_dir).tokens.tolist()
    load_stream("text", [a], max_tokens=2, cache_dir=cache_dir)
    jl = tmp_path / "j.jsonl"
    jl.write_text(json.dumps({"text": "x", "body": "y"}) + "\n")
    assert load_stream("jsonl", [str(jl)], cache_dir=cache_dir).tokens.tolist() == [ord("x"), 256]
    assert load_stream("jsonl", [str(jl)], "body", cache_dir=cache_dir).tokens.tolist() == [ord("y"), 256]
    assert len(entries(cache_dir)) == 7
    with open(os.path.join(cache_dir, entries(cache_dir)[0] + ".json")) as f:
        about = json.load(f)
    assert {"dtype", "tokens", "source", "files", "tokenizer", "written"} <= set(about)


def test_incomplete_entries_are_rebuilt(tmp_path):
    """A description missing, tokens cut short, a builder's temporary file left: the next call rebuilds
    the entry and removes what the builder left."""
    cache_dir = str(tmp_path / "cache")
    docs = corpus(tmp_path)
    want = load_stream("text", [docs]).tokens
    load_stream("text", [docs], cache_dir=cache_dir)
    (key,) = entries(cache_dir)
    base = os.path.join(cache_dir, key)
    for damage in ("description", "tokens", "format"):
        if damage == "description":
            os.remove(base + ".json")
        elif damage == "tokens":
            with open(base + ".tokens", "r+b") as f:
                f.truncate(10)
        else:
            with open(base + ".json") as f:
                about = json.load(f)
            with open(base + ".json", "w") as f:
                json.dump({**about, "format": 0}, f)
        with open(f"{base}.999999.tmp", "wb") as f:
            f.write(b"left by a killed builder")
        assert corpus_cache.read_entry(base) is None
        assert np.array_equal(load_stream("text", [docs], cache_dir=cache_dir).tokens, want), damage
        assert not glob.glob(base + ".*.tmp") and corpus_cache.read_entry(base) is not None


def test_errors_of_the_corpus_leave_no_entry(tmp_path):
    cache_dir = str(tmp_path / "cache")
    with pytest.raises(ValueError, match=r"the text corpus \(2 files\) holds no documents"):
        load_stream("text", [corpus(tmp_path, docs=("", ""))], cache_dir=cache_dir)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_stream("jsonl", [str(bad)], cache_dir=cache_dir)
    assert [os.path.splitext(f)[1] for f in os.listdir(cache_dir)] == [".lock", ".lock"]


def test_a_cache_that_cannot_be_written_warns_and_tokenizes_in_memory(tmp_path, monkeypatch):
    docs = corpus(tmp_path)
    want = load_stream("text", [docs]).tokens
    (tmp_path / "a_file").write_text("")
    with pytest.warns(UserWarning, match="cannot be written"):
        got = load_stream("text", [docs], cache_dir=str(tmp_path / "a_file" / "cache"))
    assert np.array_equal(got.tokens, want) and not isinstance(got.tokens, np.memmap)

    def full(*args):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(corpus_cache, "write_entry", full)
    with pytest.warns(UserWarning, match="No space left on device"):
        got = load_stream("text", [docs], cache_dir=str(tmp_path / "cache"))
    assert np.array_equal(got.tokens, want)
    monkeypatch.undo()
    monkeypatch.setattr(corpus_cache.fcntl, "flock", full)  # a file system without locks
    with pytest.warns(UserWarning, match="cannot be locked"):
        got = load_stream("text", [docs], cache_dir=str(tmp_path / "cache"))
    assert np.array_equal(got.tokens, want) and isinstance(got.tokens, np.memmap)


def test_processes_starting_together_tokenize_once(tmp_path):
    """Four processes (as a launcher's ranks) at once: one tokenizes, the others wait and map its
    entry; all read the same tokens."""
    docs = corpus(tmp_path, docs=[f"document {i} " * 2000 for i in range(200)])
    cache_dir = str(tmp_path / "cache")
    code = ("import sys, hashlib; from turbomoe.data import load_stream; "
            "s = load_stream('text', [sys.argv[1]], cache_dir=sys.argv[2]); print(s.digest['sha256'])")
    env = {**os.environ, "PYTHONPATH": ROOT}
    procs = [subprocess.Popen([sys.executable, "-c", code, docs, cache_dir], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(4)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sum("tokenizing the text corpus (200 files)" in err for _, err in outs) == 1, outs
    assert len({out for out, _ in outs}) == 1
    assert outs[0][0].strip() == load_stream("text", [docs]).digest["sha256"]


def test_default_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("TURBOMOE_CACHE", str(tmp_path / "t"))
    assert corpus_cache.default_dir() == str(tmp_path / "t" / "corpora")
    monkeypatch.delenv("TURBOMOE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert corpus_cache.default_dir() == str(tmp_path / "x" / "turbomoe" / "corpora")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert corpus_cache.default_dir() == str(tmp_path / "home" / ".cache" / "turbomoe" / "corpora")


def test_a_start_finds_its_entry_by_the_files_stat(tmp_path, monkeypatch):
    """After the first call, the same files (paths, sizes, times, inodes) find their entry without
    hashing the corpus; a same-size edit (its time moves) is hashed and makes its own entry; a pointer
    that names no entry, or holds anything else, is passed over."""
    cache_dir = str(tmp_path / "cache")
    docs = corpus(tmp_path)
    first = load_stream("text", [docs], cache_dir=cache_dir)
    hashed = []
    entry_key = corpus_cache.entry_key
    monkeypatch.setattr(corpus_cache, "entry_key", lambda *a: hashed.append(1) or entry_key(*a))
    assert np.array_equal(load_stream("text", [docs], cache_dir=cache_dir).tokens, first.tokens) and not hashed
    path = os.path.join(docs, "00.txt")
    text = open(path).read()
    with open(path, "w") as f:
        f.write(text.upper())
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10 ** 9))
    edited = load_stream("text", [docs], cache_dir=cache_dir)
    assert hashed and np.array_equal(edited.tokens, load_stream("text", [docs]).tokens)
    assert not np.array_equal(edited.tokens, first.tokens) and len(entries(cache_dir)) == 2
    assert len(glob.glob(os.path.join(cache_dir, "stat-*"))) == 2  # one a state of the files, no temporary left
    for content in ("0" * 64, "../../etc/passwd", ""):
        for p in glob.glob(os.path.join(cache_dir, "stat-*")):
            with open(p, "w") as f:
                f.write(content)
        hashed.clear()
        assert np.array_equal(load_stream("text", [docs], cache_dir=cache_dir).tokens, edited.tokens) and hashed


def test_parquet_entries_follow_the_column(tmp_path):
    """One Parquet file, two string columns: each its own entry and tokens (text_key is in the key)."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"a": ["first column"] * 3, "b": ["second"] * 3}), str(tmp_path / "t.parquet"))
    cache_dir = str(tmp_path / "cache")
    for column in ("a", "b", "a"):
        got = load_stream("parquet", [str(tmp_path / "t.parquet")], column, cache_dir=cache_dir)
        assert np.array_equal(got.tokens, load_stream("parquet", [str(tmp_path / "t.parquet")], column).tokens)
    assert len(entries(cache_dir)) == 2
