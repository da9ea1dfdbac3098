"""Token-budget batching: batches of about ``max_tokens`` tokens with a variable number of sequences.

Fixed batches of variable-length sequences waste the step on padding (short batches) or run out of
memory (long ones). ``TokenBudgetBatchSampler`` groups sequences of similar length (sorted within
shuffled pools of ``pool`` sequences) so that each batch's padded size ``count x longest`` stays within
``max_tokens``; a sequence longer than the budget is a batch of its own.

Distributed: every rank builds the same batch list from the same seed and epoch, keeps the batches
``rank, rank + world, ...`` and the list is cut to a multiple of ``world`` first -- every rank runs the
same number of steps (a rank with one step more would wait in the gradient all-reduce forever).

The LR rule it implies (``lr_for_tokens``): the loss is a mean over a step's tokens, so a step with
fewer tokens has a noisier gradient of the same scale. The linear scaling rule scales the LR by
``tokens / reference_tokens`` (DeepSpeed's ``VariableBatchSizeLR`` does this with the batch size);
``sqrt`` is the rule usually taken for Adam; ``none`` keeps it. Not wired into ``LMDataModule`` yet
Nothing here calls a collective.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence

from torch.utils.data import Sampler

__all__ = ["TokenBudgetBatchSampler", "lr_for_tokens"]


class TokenBudgetBatchSampler(Sampler[list[int]]):
    def __init__(self, lengths: Sequence[int], max_tokens: int, num_replicas: int = 1, rank: int = 0,
                 seed: int = 0, shuffle: bool = True, pool: int = 1024) -> None:
        if max_tokens < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"need max_tokens >= 1 and 0 <= rank < num_replicas (got {max_tokens}, {rank}, "
                             f"{num_replicas})")
        self.lengths, self.max_tokens = list(lengths), max_tokens
        self.num_replicas, self.rank, self.seed, self.shuffle, self.pool = num_replicas, rank, seed, shuffle, pool
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def all_batches(self) -> list[list[int]]:
        """Every rank's batches of this epoch (the same list on every rank), cut to a multiple of the world."""
        order = list(range(len(self.lengths)))
        rng = random.Random(self.seed + self.epoch)
        if self.shuffle:
            rng.shuffle(order)
        batches: list[list[int]] = []
        for start in range(0, len(order), self.pool):
            chunk = sorted(order[start:start + self.pool], key=lambda i: self.lengths[i])
            batch: list[int] = []
            longest = 0
            for i in chunk:
                longer = max(longest, self.lengths[i])
                if batch and longer * (len(batch) + 1) > self.max_tokens:
                    batches.append(batch)
                    batch, longer = [], self.lengths[i]
                batch.append(i)
                longest = longer
            if batch:
                batches.append(batch)
        if self.shuffle:
            rng.shuffle(batches)
        return batches[:len(batches) - len(batches) % self.num_replicas]

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.all_batches()[self.rank::self.num_replicas]

    def __len__(self) -> int:
        return len(self.all_batches()) // self.num_replicas


def lr_for_tokens(base_lr: float, tokens: int, reference_tokens: int, rule: str = "linear") -> float:
    """The step's LR for a batch of ``tokens`` when ``base_lr`` was tuned at ``reference_tokens`` per step."""
    if rule == "none":
        return base_lr
    ratio = tokens / reference_tokens
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    raise ValueError(f"rule={rule!r} is invalid; valid: linear, sqrt, none")
