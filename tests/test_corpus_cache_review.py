"""A review of the corpus cache (turbomoe/data/cache.py): a complete entry read where the directory
cannot be written; ranks wait for the one that tokenizes; a failed build is not retried rank after rank;
builders never share a temporary file; a bad jsonl line past max_tokens is not read."""
import builtins
import fcntl
import json
import os
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

from test_corpus_cache import ROOT, corpus
from turbomoe.data import ByteTokenizer, load_stream
from turbomoe.data import cache as corpus_cache
from turbomoe.data.corpus import corpus_files, token_chunks


def entry_base(cache_dir, docs):
    files = corpus_files("text", [docs])
    return os.path.join(cache_dir, corpus_cache.entry_key("text", files, "text", 0, ByteTokenizer())), files


def test_an_entry_is_read_where_the_cache_cannot_be_written(tmp_path, monkeypatch):
    """A cache prepared before, on a read-only mount or in another user's directory (its lock file not
    ours to open): the entry is mapped, no warning, no tokenizing."""
    docs, cache_dir = corpus(tmp_path), str(tmp_path / "cache")
    want = load_stream("text", [docs], cache_dir=cache_dir).tokens

    def read_only(path, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+"):
            raise PermissionError(13, "Permission denied", path)
        return builtins.open(path, mode, *args, **kwargs)
    monkeypatch.setattr(corpus_cache, "open", read_only, raising=False)
    monkeypatch.setattr(ByteTokenizer, "encode_batch", None)  # must not tokenize
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = load_stream("text", [docs], cache_dir=cache_dir)
    assert isinstance(got.tokens, np.memmap) and np.array_equal(got.tokens, want)


def start_ranks(docs, cache_dir, n, prelude=""):
    code = (f"import sys; from turbomoe.data import load_stream; from turbomoe.data import cache\n{prelude}\n"
            "s = load_stream('text', [sys.argv[1]], cache_dir=sys.argv[2]); "
            "print(s.digest['sha256'], type(s.tokens).__name__)")
    env = {**os.environ, "PYTHONPATH": ROOT}
    return [subprocess.Popen([sys.executable, "-c", code, docs, cache_dir], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env) for _ in range(n)]


def wait_until_blocked(procs, lock_path, timeout=120):
    """Until every process waits on the lock (Linux's /proc/locks: a waiter's line has "->") or one ended."""
    inode, deadline = f":{os.stat(lock_path).st_ino} ", time.time() + timeout
    while time.time() < deadline and any(p.poll() is None for p in procs):
        with open("/proc/locks") as f:
            if sum(" -> " in line and inode in line for line in f) == len(procs):
                return
        time.sleep(0.1)


def test_ranks_wait_for_the_builder_and_map_its_entry(tmp_path):
    """While one process holds the entry's lock (here the test, building it), the others wait: they
    neither tokenize nor finish; then they map what it wrote."""
    docs, cache_dir = corpus(tmp_path), str(tmp_path / "cache")
    os.makedirs(cache_dir)
    base, files = entry_base(cache_dir, docs)
    with open(base + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        procs = start_ranks(docs, cache_dir, 3)
        wait_until_blocked(procs, base + ".lock")
        assert [p.poll() for p in procs] == [None] * 3 and not os.path.exists(base + ".json")
        corpus_cache.write_entry(base, token_chunks("text", files, "text", ByteTokenizer()),
                                 {"source": "text", "files": files})
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    want = load_stream("text", [docs]).digest["sha256"]
    assert all(out.split() == [want, "memmap"] and "tokenizing" not in err for out, err in outs), outs


def test_a_failed_build_is_not_retried_rank_after_rank(tmp_path):
    """A full disk: the ranks that waited for the failed build tokenize in memory at once, not each in
    turn after trying (and failing) to write the entry again."""
    docs, cache_dir = corpus(tmp_path), str(tmp_path / "cache")
    os.makedirs(cache_dir)
    base, _ = entry_base(cache_dir, docs)
    full = ("def full(*a):\n    print('write attempt', file=sys.stderr)\n"
            "    raise OSError(28, 'No space left on device')\ncache.write_entry = full")
    with open(base + ".lock", "a") as lock:  # the first rank's failed build, from the ranks' side
        fcntl.flock(lock, fcntl.LOCK_EX)
        procs = start_ranks(docs, cache_dir, 3, full)
        wait_until_blocked(procs, base + ".lock")
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    want = load_stream("text", [docs]).digest["sha256"]
    assert all(out.split() == [want, "ndarray"] for out, _ in outs), outs
    assert sum(err.count("write attempt") for _, err in outs) == 0, outs


def test_builders_never_share_a_temporary_file(tmp_path, monkeypatch):
    """Two builders of one entry with the same process id (ranks of two hosts in containers, on a shared
    directory where locks do not reach): each writes its own file; the entry is whole."""
    docs, cache_dir = corpus(tmp_path), str(tmp_path / "cache")
    os.makedirs(cache_dir)
    base, files = entry_base(cache_dir, docs)
    about = {"source": "text", "files": files}

    def first():
        for i, chunk in enumerate(token_chunks("text", files, "text", ByteTokenizer())):
            if i == 1:  # the other host's builder starts and finishes meanwhile
                corpus_cache.write_entry(base, token_chunks("text", files, "text", ByteTokenizer()), about)
            yield chunk
    corpus_cache.write_entry(base, first(), about)
    got = corpus_cache.read_entry(base)
    assert got is not None and np.array_equal(got, load_stream("text", [docs]).tokens)


@pytest.mark.parametrize("cache", [False, True])
def test_a_bad_jsonl_line_past_max_tokens_is_not_read(tmp_path, cache):
    """max_tokens takes a prefix of the corpus: a malformed line after the cut stays unread (as before
    documents were tokenized in batches); before the cut it is still an error naming the line."""
    jl = tmp_path / "d.jsonl"
    jl.write_text(json.dumps({"text": "hello world"}) + "\n" + json.dumps({"text": "more"}) + "\n{broken\n")
    cache_dir = str(tmp_path / "cache") if cache else None
    got = load_stream("jsonl", [str(jl)], max_tokens=5, cache_dir=cache_dir)
    assert got.tokens.tolist() == list(b"hello")
    with pytest.raises(ValueError, match=r"d.jsonl:3: not a UTF-8 JSON object"):
        load_stream("jsonl", [str(jl)], max_tokens=50, cache_dir=cache_dir)
