"""A byte-level tokenizer: needs no download and no training, and covers any UTF-8 text."""
import numpy as np


class ByteTokenizer:
    """Token i < 256 is byte i; 256 is end-of-document, appended after every document."""
    eos_id = 256
    vocab_size = 257

    def encode(self, text: str) -> np.ndarray:
        """text -> uint16 token ids [len(utf-8 bytes)] (no end-of-document)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")
