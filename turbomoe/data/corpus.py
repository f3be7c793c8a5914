"""Token streams: every document of a corpus, end to end, read by token offset.

Sources (the recipe's data.source):
  stdlib    the Python standard library's .py sources: on every machine, no download
  text      text files (each file one document; directories are searched for *.txt)
  jsonl     JSON-lines files, one document per line in the field data.text_key; .gz and .zst
            compressed files too (zstandard for .zst)
  parquet   Parquet files, one document per row in the string column data.text_key (pyarrow)
  megatron  Megatron .bin/.idx indexed datasets (already tokenized, e.g. by Megatron-DeepSpeed's
            tools/preprocess_data.py), read through megatron-core's IndexedDataset, never loaded whole
The four text sources are tokenized with the byte-level tokenizer, or a Hugging Face tokenizer
(tokenizer.HFTokenizer: a model's own vocabulary), end-of-document after every document (one of no
tokens adds nothing).
"""
import functools
import glob
import gzip
import hashlib
import io
import json
import os
import sysconfig
from typing import List, Optional

import numpy as np

from .tokenizer import ByteTokenizer

SOURCES = ("stdlib", "text", "jsonl", "parquet", "megatron")
# What a directory named in data.paths is searched for, by source (a file named there is read whatever
# its name).
PATTERNS = {"text": ("*.txt", ), "jsonl": ("*.jsonl", "*.jsonl.gz", "*.jsonl.zst"), "parquet": ("*.parquet", )}


class ArrayStream:
    """An in-memory token stream, tokens [N]."""

    def __init__(self, tokens_N: np.ndarray):
        self.tokens = tokens_N

    def __len__(self):
        return len(self.tokens)

    def read(self, start: int, length: int) -> np.ndarray:
        return self.tokens[start:start + length].astype(np.int64)

    @functools.cached_property
    def digest(self) -> dict:
        """What the stream is, for a resume to compare: its token count and a hash of every token (hashed
        in place, once: the resume's check and the run's markers share it)."""
        return {"tokens": len(self), "sha256": hashlib.sha256(np.ascontiguousarray(self.tokens)).hexdigest()}


class IndexedStream:
    """The sequences of Megatron indexed datasets, end to end, read lazily through IndexedDataset.get;
    max_tokens > 0 keeps only the first max_tokens."""

    def __init__(self, prefixes: List[str], max_tokens: int = 0):
        from megatron.core.datasets.indexed_dataset import IndexedDataset
        self.datasets = [IndexedDataset(p) for p in prefixes]
        lengths = [np.asarray(ds.sequence_lengths, dtype=np.int64) for ds in self.datasets]
        self.seq_dataset = np.concatenate([np.full(len(l), i) for i, l in enumerate(lengths)])
        self.seq_local = np.concatenate([np.arange(len(l)) for l in lengths])
        self.starts = np.concatenate([[0], np.cumsum(np.concatenate(lengths))])  # token offset of every sequence
        self.length = min(int(self.starts[-1]), max_tokens) if max_tokens else int(self.starts[-1])

    def __len__(self):
        return self.length

    @functools.cached_property
    def digest(self) -> dict:
        """Its token count and a hash of its documents' lengths: hashing the tokens would read the whole corpus."""
        lengths = np.diff(np.minimum(self.starts, self.length)).astype(np.int64)
        return {"tokens": len(self), "sha256": hashlib.sha256(lengths.tobytes()).hexdigest()}

    def read(self, start: int, length: int) -> np.ndarray:
        out, pos, end = [], start, start + length
        seq = int(np.searchsorted(self.starts, start, side="right")) - 1
        while pos < end:
            offset = pos - int(self.starts[seq])
            take = min(end, int(self.starts[seq + 1])) - pos
            if take > 0:
                ds = self.datasets[self.seq_dataset[seq]]
                out.append(ds.get(int(self.seq_local[seq]), offset=offset, length=take).astype(np.int64))
                pos += take
            seq += 1
        return np.concatenate(out)


def stdlib_files() -> List[str]:
    """The standard library's .py files, sorted, without its tests and site-packages."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "test", "tests",
                                                               "idle_test", "__pycache__"))
        files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return files


def _expand(paths: List[str], patterns) -> List[str]:
    """Files named in paths; directories are searched recursively for patterns. Missing paths raise."""
    if not paths:
        raise ValueError("data.paths is empty; name the files or directories to train on")
    files = []
    for p in paths:
        if os.path.isdir(p):
            found = sorted({f for pattern in patterns for f in glob.glob(os.path.join(p, "**", pattern), recursive=True)})
            if not found:
                raise FileNotFoundError(f"data path {p!r} is a directory with no {' / '.join(patterns)} files")
            files += found
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise FileNotFoundError(f"data path {p!r} does not exist")
    return files


def corpus_files(source: str, paths: List[str]) -> List[str]:
    """The files of a text source, in the order their documents are read."""
    if source == "stdlib":
        files = stdlib_files()
        if not files:
            raise FileNotFoundError(f"no Python standard library sources under {sysconfig.get_paths()['stdlib']}")
        return files
    return _expand(paths, PATTERNS[source])


def _open(path: str):
    """(path's bytes, decompressed where its name ends in .gz or .zst, in any case; what reading them
    raises where the file is corrupt or cut short)."""
    name = path.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb"), (OSError, EOFError)
    if name.endswith(".zst"):
        try:
            import zstandard
        except ImportError as e:
            raise ImportError(f"{path}: .zst files are read with zstandard: pip install -e '.[data]'") from e
        return io.BufferedReader(_ZstdFrames(path, zstandard), 1 << 20), (OSError, zstandard.ZstdError)  # lines
    return open(path, "rb"), (OSError, )


class _ZstdFrames(io.RawIOBase):
    """A zstandard file's bytes, frame after frame (skippable ones too). zstandard's own reader ends
    quietly where the file ends inside a frame, the corpus a prefix of itself: this raises ZstdError
    there, as gzip does. Windows up to 2 GiB (zstd --long=31), as zstd -d --long=31 reads."""
    READ = 1 << 16  # compressed bytes decompressed at once

    def __init__(self, path: str, zstandard):
        self._file, self._zstandard = open(path, "rb"), zstandard
        self._dctx = zstandard.ZstdDecompressor(max_window_size=1 << 31)
        self._frame = None  # the decompressor of the frame under way; None between frames
        self._out, self._pos = memoryview(b""), 0

    def readable(self):
        return True

    def readinto(self, b) -> int:
        while self._pos == len(self._out):
            data = self._file.read(self.READ)
            if not data:
                if self._frame is not None:
                    raise self._zstandard.ZstdError("the file ends inside a zstd frame: cut short")
                return 0
            out = []
            while data:
                if self._frame is None:
                    self._frame = self._dctx.decompressobj()
                out.append(self._frame.decompress(data))
                data = b""
                if self._frame.eof:  # the frame is whole; what follows it is the next one's
                    data, self._frame = self._frame.unused_data, None
            self._out, self._pos = memoryview(b"".join(out)), 0
        n = min(len(b), len(self._out) - self._pos)
        b[:n] = self._out[self._pos:self._pos + n]
        self._pos += n
        return n

    def close(self):
        self._file.close()
        super().close()


def _documents(source: str, files: List[str], text_key: str):
    for path in files:
        if source == "parquet":
            yield from _parquet_documents(path, text_key)
        elif source != "jsonl":
            with open(path, "rb") as f:  # the bytes as they are: the byte tokenizer needs no decoding
                yield f.read()
        else:
            yield from _jsonl_documents(path, text_key)


def _read_through(items, path: str, errors):
    """items, where an error of reading them (errors: a corrupt, cut-short or damaged file) becomes a
    ValueError naming path."""
    while True:
        try:
            item = next(items)
        except StopIteration:
            return
        except errors as e:
            raise ValueError(f"{path}: cannot be read to its end ({type(e).__name__}: {e})") from None
        yield item


def _jsonl_documents(path: str, text_key: str):
    f, errors = _open(path)
    with f:
        for lineno, line in _read_through(enumerate(f, 1), path, errors):
            if not line.strip():
                continue
            try:
                doc = json.loads(line.decode("utf-8"))[text_key]
                if not isinstance(doc, str):
                    raise TypeError(f"its {text_key!r} is {type(doc).__name__}")
                doc = doc.encode("utf-8")  # here, so that a lone surrogate (JSON's "\ud800") names its line
            except (UnicodeError, json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a UTF-8 JSON object with a {text_key!r} string field "
                                 f"({type(e).__name__}: {e})") from None
            yield doc


def _parquet_documents(path: str, text_key: str):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(f"{path}: Parquet files are read with pyarrow: pip install -e '.[data]'") from e
    try:
        # buffered, not pre-buffered: pyarrow otherwise reads a row group's whole column chunk at once
        # (memory: the row group's size, GBs for a row group of a million documents)
        file = pq.ParquetFile(path, buffer_size=1 << 20, pre_buffer=False)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not a Parquet file ({type(e).__name__}: {e})") from None
    schema = file.schema_arrow
    if text_key not in schema.names:
        raise ValueError(f"{path}: no column {text_key!r} (data.text_key); its columns: {schema.names}")
    if len(schema.get_all_field_indices(text_key)) > 1:
        raise ValueError(f"{path}: {len(schema.get_all_field_indices(text_key))} columns named {text_key!r}")
    kind = schema.field(text_key).type
    # strings: plain, large, string_view (pyarrow >= 16), or dictionary-encoded (pandas' Categorical); and
    # binary columns, as older writers (Hive, Impala) store text without its UTF-8 annotation
    value = kind.value_type if pa.types.is_dictionary(kind) else kind
    binary = {pa.string(): pa.binary(), pa.large_string(): pa.large_binary(), pa.binary(): pa.binary(),
              pa.large_binary(): pa.large_binary()}
    if hasattr(pa, "string_view"):
        binary.update({pa.string_view(): pa.binary_view(), pa.binary_view(): pa.binary_view()})
    if value not in binary:
        raise ValueError(f"{path}: column {text_key!r} is {kind}, not strings")
    row = 0
    # a damaged page: pyarrow's message does not name the file
    for batch in _read_through(file.iter_batches(columns=[text_key], batch_size=1024), path,
                               (pa.ArrowException, OSError)):
        docs = batch.column(0)
        if pa.types.is_dictionary(docs.type):
            docs = docs.dictionary_decode()
        # The rows before a null are documents: max_tokens' cut may come before it, which is then not read.
        first = next((i for i, valid in enumerate(docs.is_valid().to_pylist()) if not valid), None) \
            if docs.null_count else None
        # as bytes (a cast, no copy): the UTF-8 the byte tokenizer reads, without decoding it here
        yield from docs.slice(0, first).cast(binary[docs.type]).to_pylist()
        if first is not None:
            raise ValueError(f"{path}: row {row + first + 1}: its {text_key!r} is null")
        row += len(docs)


# Documents a tokenizer call takes at once (a Hugging Face tokenizer encodes a batch on all cores), and
# at most these bytes of them.
BATCH_DOCS, BATCH_BYTES = 1024, 16 << 20


def _batches(docs):
    batch, size = [], 0
    # A bad document raises once the stream gets to it: one past max_tokens' cut is never reached, as
    # when documents were tokenized one at a time.
    try:
        for doc in docs:
            batch.append(doc)
            size += len(doc)
            if len(batch) == BATCH_DOCS or size >= BATCH_BYTES:
                yield batch
                batch, size = [], 0
    except Exception:  # (a reader missing too: ImportError)
        if batch:
            yield batch
        raise
    if batch:
        yield batch


def token_chunks(source: str, files: List[str], text_key: str, tokenizer, max_tokens: int = 0):
    """The stream's tokens in order, a chunk at a time: each document's ids, then end-of-document; cut
    at max_tokens > 0. Raises where the corpus has no tokens."""
    total = 0
    for batch in _batches(_documents(source, files, text_key)):
        for ids in tokenizer.encode_batch(batch):
            # No tokens (an empty document, or blanks a tokenizer drops), so no end-of-document either: as
            # Megatron's preprocess_data.py.
            if not len(ids):
                continue
            ids = np.append(ids, np.array(tokenizer.eos_id, dtype=ids.dtype))
            if max_tokens and total + len(ids) >= max_tokens:
                yield ids[:max_tokens - total]
                return
            total += len(ids)
            yield ids
    if not total:
        raise ValueError(f"the {source} corpus ({len(files)} files) holds no documents, or only empty ones")


def check_megatron_prefixes(paths: List[str]) -> List[str]:
    """Prefixes as given, or with a trailing .bin/.idx removed; raises when a pair is missing."""
    if not paths:
        raise ValueError("data.paths is empty; name the Megatron dataset prefixes (path/to/name_text_document)")
    prefixes = []
    for p in paths:
        prefix = p[:-4] if p.endswith((".bin", ".idx")) else p
        missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
        if missing:
            raise FileNotFoundError(f"Megatron dataset {p!r}: missing {missing}")
        if os.path.getsize(prefix + ".bin") == 0:  # megatron-core cannot map it ("cannot mmap an empty file")
            raise ValueError(f"Megatron dataset {p!r}: {prefix}.bin is empty (no tokens)")
        prefixes.append(prefix)
    return prefixes


def load_stream(source: str, paths: Optional[List[str]] = None, text_key: str = "text", max_tokens: int = 0,
                tokenizer=None, cache_dir: Optional[str] = None):
    """The token stream of a corpus; max_tokens > 0 keeps only its first max_tokens. tokenizer: of the
    text sources (None: ByteTokenizer). cache_dir: where a text source's tokens are kept on disk, read
    from there by later calls on the same files and tokenizer (cache.py); None: in memory."""
    if source not in SOURCES:
        raise ValueError(f"data.source must be one of {SOURCES}, got {source!r}")
    if source == "megatron":
        return IndexedStream(check_megatron_prefixes(paths or []), max_tokens)
    tok = tokenizer or ByteTokenizer()
    files = corpus_files(source, paths or [])
    if cache_dir is not None:
        from .cache import cached_tokens
        return ArrayStream(cached_tokens(cache_dir, source, files, text_key, max_tokens, tok))
    return ArrayStream(np.concatenate(list(token_chunks(source, files, text_key, tok, max_tokens))))


def vocab_size_of(source: str, tokenizer=None) -> Optional[int]:
    """Tokens a text source can produce (tokenizer as load_stream's); None for pre-tokenized (megatron)
    data, checked batch by batch."""
    return None if source == "megatron" else (tokenizer or ByteTokenizer()).vocab_size
