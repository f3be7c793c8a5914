"""Tokenized text corpora kept on disk: a corpus is tokenized once, then every rank of that run and of
later ones maps the tokens from the file. Without it, every rank tokenizes the whole corpus at every
start (a Hugging Face tokenizer: minutes a GB of text) and holds its own copy in memory; mapped, the
tokens are one copy in the page cache however many ranks read them.

An entry is named by a sha256 of everything its tokens are a function of: the documents' bytes in
order (not the files' names or times: an edited file makes another entry, a moved one finds its own),
how files split into documents (jsonl's lines, Parquet's rows, and their text_key), max_tokens, and the
tokenizer (its cache_id: its files and the libraries' versions). Its files: KEY.tokens (the ids, in the
tokenizer's dtype) and KEY.json (what the entry is; written last, so a key without it is incomplete).
Ranks that start together wait on KEY.lock while the first tokenizes. turbomoe never deletes an entry:
remove the directory's files to reclaim the space.

Hashing reads the whole corpus (about a second a GB), so a start finds the entry first by the files'
paths, sizes, modification and status-change times and inodes: stat-STATKEY names the entry those
files had (written once their entry is read). The status-change time (ctime), which no program can
set, is what makes a same-size file whose modification time was set back (cp -p, tar and unzip give
it the archived one) another state, as git's index does; only a rewrite within the file system's
timestamp granularity of the previous one would go unseen.
"""
import contextlib
import datetime
import fcntl
import glob
import hashlib
import json
import os
import re
import sys
import time
import uuid
import warnings
from typing import List, Optional

import numpy as np

FORMAT = 1


def default_dir() -> str:
    """$TURBOMOE_CACHE/corpora, else $XDG_CACHE_HOME/turbomoe/corpora, else ~/.cache/turbomoe/corpora."""
    base = os.environ.get("TURBOMOE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "turbomoe")
    return os.path.join(base, "corpora")


def _spec(source: str, text_key: str, max_tokens: int, tokenizer) -> bytes:
    keyed = source in ("jsonl", "parquet")  # documents are a field of each line or a column of each row
    return json.dumps({"format": FORMAT, "documents": {"jsonl": "lines", "parquet": "rows"}.get(source, "files"),
                       "text_key": text_key if keyed else None, "max_tokens": max_tokens,
                       "tokenizer": tokenizer.cache_id}, sort_keys=True).encode()


def stat_key(source: str, files: List[str], text_key: str, max_tokens: int, tokenizer) -> str:
    key = hashlib.sha256(_spec(source, text_key, max_tokens, tokenizer))
    for path in files:
        st = os.stat(path)
        key.update(json.dumps([os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino,
                               st.st_dev]).encode())
    return key.hexdigest()


def entry_key(source: str, files: List[str], text_key: str, max_tokens: int, tokenizer) -> str:
    key = hashlib.sha256(_spec(source, text_key, max_tokens, tokenizer))
    for path in files:  # a digest a file: fixed-size pieces, so the files' boundaries are part of the key
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
        key.update(digest.digest())
    return key.hexdigest()


def cached_tokens(cache_dir: str, source: str, files: List[str], text_key: str, max_tokens: int,
                  tokenizer) -> np.ndarray:
    """The stream's tokens (corpus.token_chunks', end to end), mapped from cache_dir's entry, which is
    written first where there is none. Where the directory cannot be written (or locked), a warning says
    so and the tokens are made in memory (or written without the lock): never an error of its own."""
    pointer = os.path.join(cache_dir, "stat-" + stat_key(source, files, text_key, max_tokens, tokenizer))
    try:
        with open(pointer) as f:
            key = f.read()
        tokens = read_entry(os.path.join(cache_dir, key)) if re.fullmatch("[0-9a-f]{64}", key) else None
    except OSError:
        tokens = None
    if tokens is None:
        key = entry_key(source, files, text_key, max_tokens, tokenizer)
        tokens = _entry_tokens(cache_dir, key, source, files, text_key, max_tokens, tokenizer)
        if isinstance(tokens, np.memmap):  # the entry is complete: point these files' stat at it
            tmp = f"{pointer}.{uuid.uuid4().hex}.tmp"
            try:
                with open(tmp, "x") as f:
                    f.write(key)
                os.replace(tmp, pointer)
            except OSError:  # a cache this process cannot write: the next start hashes again
                with contextlib.suppress(OSError):
                    os.remove(tmp)
    return tokens


def _entry_tokens(cache_dir: str, key: str, source: str, files: List[str], text_key: str, max_tokens: int,
                  tokenizer) -> np.ndarray:
    from .corpus import token_chunks

    def in_memory(why: str) -> np.ndarray:
        warnings.warn(f"the corpus cache {cache_dir} {why}: tokenizing in memory")
        return np.concatenate(list(token_chunks(source, files, text_key, tokenizer, max_tokens)))

    base = os.path.join(cache_dir, key)
    # A complete entry needs no lock (its description is renamed into place last): a cache this process
    # cannot write (a read-only mount, another user's directory) is still read.
    tokens = read_entry(base)
    if tokens is not None:
        return tokens
    try:
        os.makedirs(cache_dir, exist_ok=True)
        lock = open(base + ".lock", "a")
    except OSError as e:
        return in_memory(f"cannot be written ({e})")
    with lock:
        try:
            waited, locked = _lock(lock), True  # released when the file closes
        except OSError as e:  # a file system without locks: ranks may tokenize side by side, each its own file
            warnings.warn(f"the corpus cache {cache_dir} cannot be locked ({e}): each rank may tokenize")
            waited, locked = False, False
        tokens = read_entry(base)
        if tokens is not None:
            return tokens
        if waited:  # the build this process waited for wrote no entry (a full disk, or killed): ranks
            # trying again one after another would each take as long to fail
            return in_memory("has no entry after another process's build")
        if locked:  # what a builder killed before it finished left
            for stale in glob.glob(glob.escape(base) + ".*.tmp"):
                os.remove(stale)
        try:
            write_entry(base, token_chunks(source, files, text_key, tokenizer, max_tokens),
                        {"source": source, "files": files, "text_key": text_key, "max_tokens": max_tokens,
                         "tokenizer": tokenizer.cache_id})
        except OSError as e:  # a full or read-only disk: the tokens are still made, in memory
            return in_memory(f"cannot be written ({e})")
        return read_entry(base)


def _lock(f) -> bool:
    """flock f exclusively; whether another process held it (this one waited)."""
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        fcntl.flock(f, fcntl.LOCK_EX)
        return True


def write_entry(base: str, chunks, about: dict):
    """base.tokens from the chunks, then base.json; each written under a temporary name and renamed."""
    # A name of its own: a process id is not (ranks of two hosts on a shared directory, in containers)
    tmp = f"{base}.{uuid.uuid4().hex}.tmp"
    start, count, dtype = time.time(), 0, None
    print(f"turbomoe: tokenizing the {about['source']} corpus ({len(about['files'])} files) into {base}.tokens, "
          f"once", file=sys.stderr, flush=True)
    try:
        with open(tmp, "xb") as f:
            for chunk in chunks:
                dtype = dtype or chunk.dtype
                f.write(np.ascontiguousarray(chunk, dtype=dtype).tobytes())
                count += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, base + ".tokens")
        meta = {"format": FORMAT, "dtype": np.dtype(dtype).name, "tokens": count, **about,
                "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "seconds": round(time.time() - start, 1)}
        with open(tmp, "x") as f:
            json.dump(meta, f, indent=1)
        os.replace(tmp, base + ".json")
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_entry(base: str) -> Optional[np.ndarray]:
    """base's tokens mapped read-only; None where the entry is missing, incomplete or not what its
    description says (a later write replaces it)."""
    try:
        with open(base + ".json") as f:
            meta = json.load(f)
        dtype, count = np.dtype(meta["dtype"]), int(meta["tokens"])
        if meta["format"] != FORMAT or count < 1 or os.path.getsize(base + ".tokens") != count * dtype.itemsize:
            return None
        return np.memmap(base + ".tokens", dtype=dtype, mode="r", shape=(count,))
    except (OSError, ValueError, KeyError, TypeError):
        return None
