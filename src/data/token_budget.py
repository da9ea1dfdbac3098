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
``sqrt`` is the rule usually taken for Adam; ``none`` keeps it. Nothing here calls a collective.

Wired by ``data.token_budget=<tokens per rank per step>`` (``LMDataModule``): the train loader takes
``LightningTokenBudgetSampler``, a ``BatchSampler`` whose ``sampler`` argument Lightning replaces with its
``DistributedSampler`` under DDP/DeepSpeed -- the rank and world size are read from it (Lightning cannot
inject a sampler into any other kind of batch sampler). ``data.token_budget_lr`` applies ``lr_for_tokens``
per optimizer step in ``CausalLMModule``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence

from torch.utils.data import BatchSampler, DistributedSampler, Sampler

__all__ = ["TokenBudgetBatchSampler", "LightningTokenBudgetSampler", "lr_for_tokens", "LR_RULES"]

LR_RULES = ("none", "linear", "sqrt")


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


class LightningTokenBudgetSampler(BatchSampler):
    """``TokenBudgetBatchSampler`` in the form Lightning re-creates per rank: it passes its
    ``DistributedSampler`` as ``sampler`` and this reads ``rank``/``num_replicas`` from it (any other
    sampler: one process). ``batch_size``/``drop_last`` exist for Lightning's introspection only."""

    def __init__(self, sampler: Sampler, lengths: Sequence[int], max_tokens: int, seed: int = 0,
                 batch_size: int = 1, drop_last: bool = False) -> None:
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last
        rank, world = (sampler.rank, sampler.num_replicas) if isinstance(sampler, DistributedSampler) else (0, 1)
        self.lengths, self.max_tokens, self.seed = lengths, max_tokens, seed
        self.budget = TokenBudgetBatchSampler(lengths, max_tokens, num_replicas=world, rank=rank, seed=seed)

    def set_epoch(self, epoch: int) -> None:  # Lightning calls it on the loader's batch_sampler
        self.budget.set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.budget)

    def __len__(self) -> int:
        return len(self.budget)
