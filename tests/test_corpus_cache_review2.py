"""A second review of the corpus cache (turbomoe/data/cache.py), its stat pointer: a new release of a
file in the same size, put in place by the tools that give it the archived modification time (cp -p,
tar), is another state of the files (its ctime), not the old entry's; unchanged files still find their
entry without hashing."""
import io
import os
import shutil
import tarfile

import numpy as np

from turbomoe.data import load_stream
from turbomoe.data import cache as corpus_cache

ARCHIVED = 1577836800 * 10 ** 9  # 2020-01-01: a reproducible archive's fixed time, say


def releases(tmp_path):
    """Two releases of one document, the same size, both with the archived time."""
    paths = []
    for name, text in (("v1.txt", "the first release of a document\n" * 3),
                       ("v2.txt", "THE FIRST RELEASE OF A DOCUMENT\n" * 3)):
        path = str(tmp_path / name)
        with open(path, "w") as f:
            f.write(text)
        os.utime(path, ns=(ARCHIVED, ARCHIVED))
        paths.append(path)
    assert os.path.getsize(paths[0]) == os.path.getsize(paths[1])
    return paths


def tar_of(path):
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w") as t:
        t.add(path, arcname="a.txt")
    data.seek(0)
    return data


def test_a_same_size_release_with_the_archived_time_is_not_the_old_entry(tmp_path, monkeypatch):
    v1, v2 = releases(tmp_path)
    docs, cache_dir = tmp_path / "docs", str(tmp_path / "cache")
    docs.mkdir()
    target = str(docs / "a.txt")

    def put_with_cp_p(src):
        shutil.copy2(src, target)  # cp -p: rewritten in place (the same inode), the source's time

    def put_with_tar(src):
        with tarfile.open(fileobj=tar_of(src)) as t:
            t.extractall(str(docs))  # the file replaced, its time the archived one

    for put in (put_with_cp_p, put_with_tar):
        put(v1)
        first = load_stream("text", [str(docs)], cache_dir=cache_dir).tokens
        assert np.array_equal(first, load_stream("text", [str(docs)]).tokens)
        put(v2)
        st = os.stat(target)
        assert (st.st_size, st.st_mtime_ns) == (os.path.getsize(v1), ARCHIVED)
        got = load_stream("text", [str(docs)], cache_dir=cache_dir).tokens
        want = load_stream("text", [str(docs)]).tokens
        assert not np.array_equal(want, first)
        assert np.array_equal(got, want), f"{put.__name__}: the old release's tokens, from the stat pointer"
        # unchanged since: found by the pointer, no hashing
        hashed = []
        entry_key = corpus_cache.entry_key
        monkeypatch.setattr(corpus_cache, "entry_key", lambda *a: hashed.append(1) or entry_key(*a))
        assert np.array_equal(load_stream("text", [str(docs)], cache_dir=cache_dir).tokens, want) and not hashed
        monkeypatch.undo()
