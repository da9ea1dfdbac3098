"""Exact mid-epoch resume for map-style datasets.

LLM runs checkpoint mid-epoch (an epoch of the default corpus is ~1000 steps). Without
help, Lightning restarts the epoch's data from its first batch after a resume, so a resumed
run re-trains on batches it has seen and its loss curve departs from the uninterrupted one.

- `EpochShuffleSampler`: the permutation of epoch ``e`` is a pure function of ``(seed, e)``,
  so it is the same in the resumed process (a plain RandomSampler's generator is not).
  It subclasses RandomSampler so Lightning still injects a shuffling DistributedSampler
  under DDP/DeepSpeed (whose order is also a function of seed and epoch).
- `ResumableDataLoader`: skips the batches that a checkpoint recorded as consumed in the
  current epoch, once, on the first iteration after the restore. The skip count travels
  in a shared `ResumePosition` that Lightning's DataLoader re-instantiation (sampler
  injection) passes on as a constructor argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler


class EpochShuffleSampler(RandomSampler):
    def __init__(self, data_source: Any, seed: int = 0) -> None:
        super().__init__(data_source)
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:  # Lightning calls this at every epoch start
        self.epoch = int(epoch)

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.seed * 1_000_003 + self.epoch)
        yield from torch.randperm(len(self.data_source), generator=g).tolist()


@dataclass
class ResumePosition:
    """Batches of the current epoch to skip on the next iteration (set on restore)."""

    skip: int = 0

    def take(self) -> int:
        skip, self.skip = self.skip, 0
        return skip


class ResumableDataLoader(DataLoader):
    def __init__(self, *args: Any, position: ResumePosition | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.position = position if position is not None else ResumePosition()

    def __iter__(self):
        iterator = super().__iter__()
        for _ in range(min(self.position.take(), len(self))):
            next(iterator)
        return iterator


def batches_consumed_in_epoch(trainer: Any) -> int:
    """Training batches fetched and processed in the current epoch (at checkpoint time)."""
    if trainer is None:
        return 0
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)
