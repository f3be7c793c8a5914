"""Pretraining data: corpora as token streams, a byte-level tokenizer, seeded samples."""
from .corpus import SOURCES, ArrayStream, IndexedStream, load_stream, stdlib_files, vocab_size_of
from .samples import Samples
from .tokenizer import ByteTokenizer

__all__ = ["SOURCES", "ArrayStream", "IndexedStream", "ByteTokenizer", "Samples", "load_stream", "stdlib_files",
           "vocab_size_of"]
