"""Each decode step's token from its logits, as transformers' generate chooses it.

The repetition penalty (greedy or sampling), then, when sampling, temperature -> top-k -> top-p ->
min-p -> one draw: the formulas and order of transformers' RepetitionPenaltyLogitsProcessor (the prompt's
left padding ignored), TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper and MinPLogitsWarper
(tests/test_sampling.py checks them against those classes); min_new_tokens bars the EOS ids before
that many new tokens, as MinNewTokensLengthLogitsProcessor (Engine.generate applies it). With top_k,
top-p, min-p and the draw run over the k most likely tokens (torch.topk) instead of the whole vocabulary
(151,936 tokens a row for Qwen3, sorted each step for top-p): the same distribution, except that where
several tokens tie at the k-th logit, k of them stay where transformers keeps them all.

generation_defaults(model_dir) reads a directory's generation_config.json (without one, its
config.json) as transformers' generate would run it (its unset values taking transformers' global
defaults: top_k 50 among them), for Engine.generate(..., **generation_defaults(model_dir)): Qwen3's
chat models, for one, ask to be sampled (temperature 0.6, top_k 20, top_p 0.95), and repeat
themselves when decoded greedily. Settings of transformers' generate that this module does not
implement (beam search, typical-p, n-gram bans, ...) are named in a warning where the file turns them on.
"""
import json
import math
import numbers
import os
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

# transformers' GenerationConfig._get_default_generation_params() for these (min_p: None, off)
TRANSFORMERS_DEFAULTS = dict(do_sample=False, temperature=1.0, top_k=50, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                             min_new_tokens=0, num_return_sequences=1)
# The other settings by which transformers' generate changes a decoder's tokens, not implemented here,
# each with the values that leave it off, by when it acts: its warpers only when sampling, contrastive
# search only when not, the rest always
NOT_IMPLEMENTED = {
    "sampling": {"typical_p": (1.0, ), "epsilon_cutoff": (0.0, ), "eta_cutoff": (0.0, ), "top_h": ()},
    "greedy": {"penalty_alpha": (0.0, )},
    "always": {"num_beams": (1, ), "no_repeat_ngram_size": (0, ), "min_length": (0, ), "bad_words_ids": (),
               "suppress_tokens": (), "begin_suppress_tokens": (), "forced_bos_token_id": (),
               "forced_eos_token_id": (), "sequence_bias": (), "exponential_decay_length_penalty": (),
               "guidance_scale": (1, ), "watermarking_config": (), "stop_strings": (), "remove_invalid_values": (False, ),
               "force_words_ids": ()}}


def _number(value) -> Optional[float]:
    """A finite real (a Python or numpy number, a 0-d real tensor) as a float, else None."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.is_complex() or value.dtype == torch.bool:
            return None
        value = value.item()
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        return None
    return float(value)


def _count(value) -> Optional[int]:
    """An int >= 0 (a Python or numpy integer, a 0-d integer tensor) as an int, else None."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point():
        value = value.item()
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
        return None
    return int(value)


@dataclass(frozen=True)
class Sampling:
    """How a step's token is chosen; Sampling.checked(...) validates and normalises the arguments."""
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0  # EOS ids barred before this many new tokens (the engine applies it: it knows the step)
    num_return_sequences: int = 1  # samples a prompt (the engine repeats each prompt's row)

    @classmethod
    def checked(cls, do_sample, temperature, top_k, top_p, min_p, repetition_penalty, min_new_tokens=0,
                num_return_sequences=1) -> "Sampling":
        """ValueError naming the argument, before anything runs. The warpers' arguments are checked only
        when sampling (greedy decoding ignores them, as transformers' does); the others always."""
        # None, as in transformers' generate: the default (here: off)
        temperature, top_p, min_p = (1.0 if temperature is None else temperature, 1.0 if top_p is None else top_p,
                                     0.0 if min_p is None else min_p)
        repetition_penalty = 1.0 if repetition_penalty is None else repetition_penalty
        min_new_tokens = 0 if min_new_tokens is None else min_new_tokens
        if not isinstance(do_sample, (bool, type(None))):  # "False" would be true
            raise ValueError(f"do_sample must be True or False, got {do_sample!r}")
        penalty = _number(repetition_penalty)
        if penalty is None or penalty <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1: off), got {repetition_penalty!r}")
        min_new = _count(min_new_tokens)
        if min_new is None:
            raise ValueError(f"min_new_tokens must be an int >= 0, got {min_new_tokens!r}")
        n = _count(1 if num_return_sequences is None else num_return_sequences)
        if not n:
            raise ValueError(f"num_return_sequences must be an int >= 1, got {num_return_sequences!r}")
        if not do_sample:
            if n > 1:  # as transformers' generate: greedy rows of one prompt would all be the same
                raise ValueError(f"num_return_sequences {n} needs sampling (do_sample=True): greedy decoding gives "
                                 f"one sequence a prompt")
            return cls(repetition_penalty=penalty, min_new_tokens=min_new)
        t, p, m = _number(temperature), _number(top_p), _number(min_p)
        if t is None or t <= 0:
            raise ValueError(f"sampling needs a finite temperature > 0, got {temperature!r}")
        if p is None or not 0 < p <= 1:
            raise ValueError(f"sampling needs 0 < top_p <= 1 (1: off), got {top_p!r}")
        if m is None or not 0 <= m <= 1:
            raise ValueError(f"sampling needs 0 <= min_p <= 1 (0: off), got {min_p!r}")
        k = _count(0 if top_k is None else top_k)
        if k is None:
            raise ValueError(f"sampling needs an int top_k >= 0 (0: off), got {top_k!r}")
        return cls(True, t, k, p, m, penalty, min_new, n)

    def history(self, ids_BT: torch.Tensor, mask_BT: torch.Tensor, new_tokens: int) -> Optional["History"]:
        """The ids the penalty looks at (None without one)."""
        return None if self.repetition_penalty == 1 else History(ids_BT, mask_BT, new_tokens)

    def select(self, logits_BV: torch.Tensor, history: Optional["History"] = None,
               generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """[B] the next tokens, added to history."""
        if history is not None:  # over the B x L ids seen, not the B x V logits
            seen = logits_BV.gather(1, history.ids_BL)
            p = self.repetition_penalty
            logits_BV = logits_BV.scatter(1, history.ids_BL, torch.where(seen < 0, seen * p, seen / p))
        if not self.do_sample:
            tok_B = logits_BV.argmax(-1)
        else:
            scores = logits_BV / self.temperature if self.temperature != 1 else logits_BV
            k = self.top_k
            if 0 < k < scores.shape[-1]:
                scores, index_BK = scores.topk(k, -1)
                tok_B = index_BK.gather(1, self._draw(scores, generator)[:, None])[:, 0]
            else:
                tok_B = self._draw(scores, generator)
        if history is not None:
            history.add(tok_B)
        return tok_B

    def _draw(self, scores_BN: torch.Tensor, generator) -> torch.Tensor:
        """One index per row from softmax(scores) after top-p and min-p (transformers' formulas)."""
        if self.top_p < 1:
            ascending, order = scores_BN.sort(-1)
            remove = ascending.softmax(-1).cumsum(-1) <= 1 - self.top_p
            remove[:, -1] = False  # the most likely token stays
            scores_BN = scores_BN.masked_fill(remove.scatter(1, order, remove), -math.inf)
        probs = scores_BN.softmax(-1)
        if self.min_p > 0:  # the most likely token is never below min_p times itself
            probs = probs.masked_fill(probs < self.min_p * probs.amax(-1, keepdim=True), 0.0)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]


class History:
    """[B, L] the ids each row has seen, for the repetition penalty: its prompt, then the tokens chosen.
    Padding and the slots not yet filled hold the row's last prompt id: a repeated id is penalised once
    (scatter writes the same value for each of its copies)."""

    def __init__(self, ids_BT: torch.Tensor, mask_BT: torch.Tensor, new_tokens: int):
        last_B1 = ids_BT[:, -1:]  # left padding: the last column is real
        self.ids_BL = torch.cat([torch.where(mask_BT, ids_BT, last_B1), last_B1.expand(-1, new_tokens)], 1)
        self.filled = ids_BT.shape[1]

    def add(self, tok_B: torch.Tensor):
        if self.filled == self.ids_BL.shape[1]:
            raise ValueError(f"History: all {self.ids_BL.shape[1]} slots are filled")
        self.ids_BL[:, self.filled] = tok_B
        self.filled += 1


def generation_file(model_dir: str) -> tuple:
    """(path, its JSON object) of the file transformers' generate takes a directory's settings from:
    generation_config.json, or without one config.json (older checkpoints keep them there); ({} where
    neither exists). Bad JSON is a ValueError naming the file."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isdir(model_dir):  # a typo, or a Hub name: transformers' defaults would decode greedily
        raise FileNotFoundError(f"{model_dir} is not a directory (a model directory on this machine)")
    if not os.path.isfile(path):
        path = os.path.join(model_dir, "config.json")
    stored = {}
    if os.path.isfile(path):
        with open(path) as f:
            try:
                stored = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not JSON: {e}") from e
        if not isinstance(stored, dict):
            raise ValueError(f"{path} holds a {type(stored).__name__}, not an object")
    return path, stored


def file_settings(model_dir: str) -> tuple:
    """(the file, the TRANSFORMERS_DEFAULTS settings it sets, all it holds), from generation_file. Unchecked
    but for do_sample (named with the file here)."""
    path, stored = generation_file(model_dir)
    out = {name: stored[name] for name in TRANSFORMERS_DEFAULTS if stored.get(name) is not None}
    if not isinstance(out.get("do_sample", False), bool):
        raise ValueError(f"{path}: do_sample must be true or false, got {out['do_sample']!r}")
    return path, out, stored


def not_implemented(stored: dict, do_sample: bool) -> dict:
    """The NOT_IMPLEMENTED settings stored turns on that transformers' generate would apply, sampling or not."""
    acting = {**NOT_IMPLEMENTED["always"], **NOT_IMPLEMENTED["sampling" if do_sample else "greedy"]}
    return {k: stored[k] for k, off in acting.items() if stored.get(k) not in (None, [], {}, *off)}


def generation_defaults(model_dir: str) -> dict:
    """The TRANSFORMERS_DEFAULTS settings (do_sample, temperature, top_k, top_p, min_p, repetition_penalty,
    min_new_tokens, num_return_sequences) as transformers' generate runs the model of model_dir:
    file_settings' values, transformers' defaults for those it does not set (or without the file). A value
    of the wrong kind is a ValueError naming the file and field; settings the file turns on that turbomoe
    does not implement, a warning naming them."""
    path, settings, stored = file_settings(model_dir)
    out = {**TRANSFORMERS_DEFAULTS, **settings}
    ignored = not_implemented(stored, out["do_sample"])
    if ignored:
        warnings.warn(ignored_text(path, ignored), stacklevel=2)
    try:
        Sampling.checked(**out)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return out


def ignored_text(path: str, ignored: dict) -> str:
    settings = ", ".join(f"{k} {v!r}" for k, v in ignored.items())
    return f"{path} sets {settings}: not implemented by turbomoe.inference, ignored (transformers' generate would apply them)"
