"""A byte-level tokenizer: needs no download and no training, and covers any UTF-8 text."""
import json
import os

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


def _byte_symbols() -> dict:
    """GPT-2's byte -> printable unicode symbol map, which byte-level pre-tokenizers apply: printable
    Latin-1 bytes stand for themselves, the others for the code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}
