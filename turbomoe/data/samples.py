"""Fixed-length training samples from a token stream: a seeded train/validation split and a
deterministic order, so that the batch of any step is a function of (seed, step) alone and a
resumed run reads exactly what an uninterrupted one would.

Sample i is the window of seq_len + 1 tokens at offset i * seq_len (inputs and shifted labels).
"""
import numbers
from typing import List

import numpy as np


class Samples:
    def __init__(self, stream, seq_len: int, valid_fraction: float, seed: int):
        if not isinstance(seq_len, numbers.Integral) or isinstance(seq_len, bool) or seq_len < 1:
            raise ValueError(f"data.seq_len must be a positive int, got {seq_len!r}")
        if (not isinstance(valid_fraction, numbers.Real) or isinstance(valid_fraction, bool)
                or not 0 < valid_fraction < 1):
            raise ValueError(f"data.valid_fraction must be in (0, 1), got {valid_fraction}")
        self.stream, self.seq_len, self.seed = stream, seq_len, seed
        n = (len(stream) - 1) // seq_len
        num_valid = max(1, int(round(n * valid_fraction)))
        if n - num_valid < 1:
            raise ValueError(f"the corpus has {len(stream)} tokens: too few for one training and one validation "
                             f"sample of {seq_len + 1} tokens")
        order = np.random.default_rng([seed, 0]).permutation(n)
        self.valid_ids = np.sort(order[:num_valid])
        self.train_ids = order[num_valid:]
        self._epoch, self._epoch_order = -1, None

    def sample(self, i: int) -> np.ndarray:
        return self.stream.read(int(i) * self.seq_len, self.seq_len + 1)

    def _train_sample_id(self, position: int) -> int:
        """The training sample at this position of the endless stream of reshuffled epochs."""
        epoch, index = divmod(position, len(self.train_ids))
        if epoch != self._epoch:
            perm = np.random.default_rng([self.seed, 1, epoch]).permutation(len(self.train_ids))
            self._epoch, self._epoch_order = epoch, self.train_ids[perm]
        return int(self._epoch_order[index])

    def train_batch(self, step: int, micro_step: int, grad_accum: int, rank: int, world: int, micro_batch: int):
        """tokens [micro_batch, seq_len + 1] of one rank's micro-batch at (step, micro_step)."""
        first = ((step * grad_accum + micro_step) * world + rank) * micro_batch
        return np.stack([self.sample(self._train_sample_id(first + j)) for j in range(micro_batch)])

    def valid_batches(self, rank: int, world: int, micro_batch: int, max_batches: int) -> List[np.ndarray]:
        """This rank's share of the validation samples: the same number of batches on every rank
        (expert parallelism needs every rank in every forward), samples that do not fill a round left out."""
        per_round = world * micro_batch
        rounds = min(max_batches, len(self.valid_ids) // per_round)
        if rounds < 1:
            raise ValueError(f"{len(self.valid_ids)} validation samples are fewer than one batch on every rank "
                             f"({per_round}); raise data.valid_fraction or use more data")
        return [np.stack([self.sample(self.valid_ids[(r * world + rank) * micro_batch + j])
                          for j in range(micro_batch)]) for r in range(rounds)]
