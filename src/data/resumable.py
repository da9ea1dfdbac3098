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
- Excluded batches (``ResumePosition.excluded``, set by the loss_spike check on a resume
  after a rollback): per epoch, ranges of batch positions never trained on; the loader
  drops them and counts them in ``dropped``, so the position a checkpoint records stays
  the raw position in the epoch's batch order (``processed + dropped``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler

__all__ = ["EpochShuffleSampler", "ResumableDataLoader", "ResumePosition", "batches_consumed_in_epoch"]


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
    dropped_at_skip: int = 0  # excluded batches before `skip` (restored: raw position - processed)
    dropped: int = 0  # excluded batches dropped so far in the current epoch
    #: epoch -> [(first, last)] batch positions (per rank, inclusive) never to train on
    excluded: dict[int, list[tuple[int, int]]] = field(default_factory=dict)

    def take(self) -> int:
        skip, self.skip = self.skip, 0
        self.dropped, self.dropped_at_skip = self.dropped_at_skip, 0
        return skip


class ResumableDataLoader(DataLoader):
    def __init__(self, *args: Any, position: ResumePosition | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.position = position if position is not None else ResumePosition()

    def __iter__(self):
        iterator = super().__iter__()
        start = min(self.position.take(), len(self))
        for _ in range(start):
            next(iterator)
        ranges = self.position.excluded.get(int(getattr(self.sampler, "epoch", 0)))
        return self._drop_excluded(iterator, start, ranges) if ranges else iterator

    def _drop_excluded(self, iterator: Any, pos: int, ranges: list[tuple[int, int]]):
        for batch in iterator:
            if any(first <= pos <= last for first, last in ranges):
                self.position.dropped += 1
            else:
                yield batch
            pos += 1


def batches_consumed_in_epoch(trainer: Any) -> int:
    """Training batches fetched and processed in the current epoch (at checkpoint time)."""
    if trainer is None:
        return 0
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)
