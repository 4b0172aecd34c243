"""`EpochStreamSampler`: the training set's shuffled epochs one after another, as one stream the Trainer plans with.

Why: when gradient accumulation changes during the run (batch warmup, the thermal guard), the Trainer sizes its
loop for the accumulation it sees at train start (1) and plans `ceil(max_steps / batches_per_epoch)` epochs: too
few micro-batches once the accumulation grows, and the run would end early. `StableTrainer` gives such a run this
sampler instead, long enough for every micro-batch the guards' plan can ask for, so the Trainer sees one long epoch
and runs to `max_steps`. Inside the stream, data epoch `e` is a permutation drawn from `seed + e`: every sample
once per data epoch, a fresh order each time, the same stream on every rank (accelerate shards its batches), and a
pure function of the position, so a resume can skip straight to where the interrupted run stopped.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class EpochStreamSampler(Sampler[int]):
    """Indices of `epochs` reshuffled passes over `size` samples.

    Args:
        size: samples in the dataset.
        epochs: data epochs in the stream (the Trainer sees them as one epoch of `size * epochs` samples).
        seed: data epoch `e` is `torch.randperm(size)` from a generator seeded with `seed + e`.

    Example:
        >>> sampler = EpochStreamSampler.covering(size=100, samples=250, seed=42)   # 3 data epochs
        >>> len(sampler), sampler.epochs
        (300, 3)
    """

    def __init__(self, size: int, epochs: int, seed: int):
        if size <= 0 or epochs <= 0:
            raise ValueError(f"EpochStreamSampler needs size > 0 and epochs > 0, got size={size}, epochs={epochs}")
        self.size = int(size)
        self.epochs = int(epochs)
        self.seed = int(seed)
        self._offset = 0  # data epochs before this stream (a second Trainer epoch over it continues the sequence)

    @classmethod
    def covering(cls, size: int, samples: int, seed: int) -> EpochStreamSampler:
        """The shortest stream of whole data epochs holding at least `samples` samples."""
        return cls(size, max(1, math.ceil(samples / max(size, 1))), seed)

    def __len__(self) -> int:
        return self.size * self.epochs

    def permutation(self, epoch: int) -> list[int]:
        """The order of data epoch `epoch` (counted from the start of the run)."""
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.size, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        for e in range(self.epochs):
            yield from self.permutation(self._offset + e)

    def set_epoch(self, epoch: int) -> None:
        """Called by accelerate with the Trainer's epoch; a run planned with this sampler has only epoch 0."""
        self._offset = int(epoch) * self.epochs
