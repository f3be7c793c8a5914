"""A byte-level tokenizer: needs no download and no training, and covers any UTF-8 text."""
import functools
import hashlib
import json
import os
import shutil
import sys
from typing import Optional

import numpy as np


class ByteTokenizer:
    """Token i < 256 is byte i; 256 is end-of-document, appended after every document."""
    eos_id = 256
    vocab_size = 257
    eos_token = "<|endoftext|>"

    def encode(self, text) -> np.ndarray:
        """text (str, or bytes taken as they are) -> uint16 token ids [len(utf-8 bytes)] (no end-of-document)."""
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)

    def encode_batch(self, texts) -> list:
        return [self.encode(t) for t in texts]

    cache_id = "bytes"  # what its tokens are a function of, beside the text (cache.py's key)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

    def save_pretrained(self, out_dir: str, model_max_length: int):
        """tokenizer.json + tokenizer_config.json that transformers' AutoTokenizer loads with the same ids.

        The `tokenizers` library's byte-level BPE with no merges: its byte-to-unicode alphabet makes
        every byte one symbol, and vocabulary entry i is the symbol of byte i; end-of-document is a
        special token. No BOS/EOS is added on encoding, as ByteTokenizer.encode. One difference: the
        literal text "<|endoftext|>" encodes to the special token (256), not to its 13 bytes, unless
        the caller passes split_special_tokens=True.
        """
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
        vocab = {symbol: b for b, symbol in _byte_symbols().items()}
        assert set(vocab) == set(pre_tokenizers.ByteLevel.alphabet())  # the alphabet ByteLevel maps bytes to
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(self.eos_token, special=True, normalized=False)])
        assert tok.token_to_id(self.eos_token) == self.eos_id
        tok.save(os.path.join(out_dir, "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": self.eos_token,
                  "pad_token": self.eos_token, "model_max_length": model_max_length,
                  "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False}
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump(config, f, indent=2)


class HFTokenizer:
    """A Hugging Face tokenizer directory's tokenizer (transformers' AutoTokenizer) with ByteTokenizer's
    interface, for text corpora in a model's own vocabulary (a published checkpoint's, to fine-tune it):
    no special tokens added on encoding, and literal special-token text stays text; end-of-document is
    the tokenizer's EOS token."""

    def __init__(self, path: str):
        if not tokenizer_files(path):
            raise FileNotFoundError(f"{path}: no Hugging Face tokenizer files there (tokenizer.json, vocab.json, ...)")
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            raise ImportError(f"{path}'s tokenizer is read with transformers: pip install -e '.[transformers]' "
                              f"({e})") from e
        self.path = os.path.abspath(path)
        self.tok = AutoTokenizer.from_pretrained(self.path)
        # A document longer than the model's context is no error here (the stream is cut into samples):
        # not the tokenizer's warning that it is.
        self.tok.model_max_length = sys.maxsize
        self.eos_id = self.tok.eos_token_id
        if self.eos_id is None:
            raise ValueError(f"{path}'s tokenizer has no EOS token, which the corpus puts after every document")
        # the largest id + 1, not len(): a vocabulary may skip ids, and the stream's dtype and the model's
        # vocab_size must hold its largest
        self.vocab_size = max(self.tok.get_vocab().values()) + 1
        self.dtype = np.uint16 if self.vocab_size <= 1 << 16 else np.uint32

    def encode(self, text) -> np.ndarray:
        """text (str, or UTF-8 bytes; invalid bytes become U+FFFD) -> token ids (no end-of-document)."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts) -> list:
        """encode of each text, in one call: a fast tokenizer encodes them on all cores (1.9x one by one on
        two cores, the standard library's sources; notes/recipes.md)."""
        texts = [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t for t in texts]
        ids = self.tok(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return [np.asarray(i, dtype=self.dtype) for i in ids]

    @functools.cached_property
    def cache_id(self) -> str:
        """What its tokens are a function of, beside the text (cache.py's key): its files, and the versions
        of the libraries that read them. Read once: a cached load names it in both keys and the entry."""
        import tokenizers
        import transformers
        return (f"hf {tokenizer_digest(self.path)} transformers {transformers.__version__} "
                f"tokenizers {tokenizers.__version__}")

    def save_pretrained(self, out_dir: str, model_max_length: int):
        """Its directory's tokenizer files, as they are (model_max_length: the tokenizer's own)."""
        for name in tokenizer_files(self.path):
            shutil.copyfile(os.path.join(self.path, name), os.path.join(out_dir, name))


def tokenizer_files(path: str) -> list:
    """The Hugging Face tokenizer files in directory path."""
    from ..models.hf_checkpoint import TOKENIZER_FILES  # the names only: the models package is slow to import
    return [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(path, f))]


def tokenizer_digest(path: str) -> str:
    """sha256 of a directory's tokenizer files (names and contents): what a run records of the tokenizer
    it read its corpus with, so that an export can tell it is still that one."""
    h = hashlib.sha256()
    for name in tokenizer_files(path):
        with open(os.path.join(path, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()


def is_byte_tokenizer(path: str) -> bool:
    """Whether a Hugging Face directory's tokenizer is ByteTokenizer's (as save_pretrained writes it): the
    same ids, so the byte tokenizer itself can read the corpus (raw bytes, no decoding). Read with the
    `tokenizers` library alone (the export extra's), so that model.init_from of turbomoe's own exports
    needs no transformers."""
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        return False
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(file)
    tok.encode_special_tokens = True  # literal special-token text as text, as HFTokenizer reads the corpus
    symbols = _byte_symbols()
    # The vocabulary alone misses a normalizer or a prefix space: the probe's ids must be its bytes too.
    probe = "".join(map(chr, range(1, 128))) + " \u00e9\u20ac\U0001f600 " + ByteTokenizer.eos_token
    return (tok.get_vocab_size(with_added_tokens=True) == ByteTokenizer.vocab_size
            and tok.token_to_id(ByteTokenizer.eos_token) == ByteTokenizer.eos_id
            and [tok.id_to_token(i) for i in range(256)] == [symbols[b] for b in range(256)]
            and tok.encode(probe, add_special_tokens=False).ids == list(probe.encode()))


def corpus_tokenizer(spec: Optional[str], model_dir: Optional[str] = None):
    """(name, tokenizer) of a text corpus: spec "bytes" the byte tokenizer, a directory its Hugging Face
    tokenizer; None the model's: model_dir's tokenizer where it has one (a published checkpoint the
    weights start from), else the byte tokenizer. name is "bytes" or the directory's absolute path: what
    a run records. A directory holding the byte tokenizer is "bytes"."""
    if spec is None:
        spec = model_dir if model_dir is not None and tokenizer_files(model_dir) else "bytes"
    if spec == "bytes" or is_byte_tokenizer(spec):
        return "bytes", ByteTokenizer()
    tok = HFTokenizer(spec)
    return tok.path, tok


def _byte_symbols() -> dict:
    """GPT-2's byte -> printable unicode symbol map, which byte-level pre-tokenizers apply: printable
    Latin-1 bytes stand for themselves, the others for the code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}
