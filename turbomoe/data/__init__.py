"""Pretraining data: corpora as token streams, the byte-level tokenizer or a Hugging Face one, seeded samples."""
from .corpus import SOURCES, ArrayStream, IndexedStream, load_stream, stdlib_files, vocab_size_of
from .samples import Samples
from .tokenizer import ByteTokenizer, HFTokenizer, corpus_tokenizer

__all__ = ["SOURCES", "ArrayStream", "IndexedStream", "ByteTokenizer", "HFTokenizer", "Samples", "corpus_tokenizer",
           "load_stream", "stdlib_files", "vocab_size_of"]
