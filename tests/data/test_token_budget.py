"""Token-budget batching (src/data/token_budget.py): padded batch size within the budget, every sequence once
per epoch across the ranks, the same number of steps on every rank, and the LR rule."""

from __future__ import annotations

import random

import pytest

from dsdebug.data.token_budget import TokenBudgetBatchSampler, lr_for_tokens

_RNG = random.Random(3)
LENGTHS = [_RNG.randint(5, 120) for _ in range(500)] + [300]  # one longer than the budget


def test_batches_stay_within_the_budget_and_cover_every_sequence_once():
    sampler = TokenBudgetBatchSampler(LENGTHS, max_tokens=256, shuffle=True, pool=64)
    batches = list(sampler)
    assert sorted(i for b in batches for i in b) == list(range(len(LENGTHS)))
    over = [b for b in batches if len(b) * max(LENGTHS[i] for i in b) > 256]
    assert over == [[len(LENGTHS) - 1]]  # only the 300-token sequence, alone
    counts = {len(b) for b in batches}
    assert len(counts) > 3  # variable sequences per batch
    padded = sum(len(b) * max(LENGTHS[i] for i in b) for b in batches)
    assert sum(LENGTHS) / padded > 0.8  # length-sorted pools keep padding low


def test_ranks_split_one_list_and_run_the_same_number_of_steps():
    world = 3
    per_rank = [list(TokenBudgetBatchSampler(LENGTHS, 256, num_replicas=world, rank=r, seed=7)) for r in range(world)]
    assert len({len(b) for b in per_rank}) == 1 and len(per_rank[0]) == len(TokenBudgetBatchSampler(LENGTHS, 256, world, 0, 7))
    seen = [i for batches in per_rank for b in batches for i in b]
    assert len(seen) == len(set(seen))  # no sequence on two ranks
    full = TokenBudgetBatchSampler(LENGTHS, 256, num_replicas=world, rank=0, seed=7).all_batches()
    assert len(full) % world == 0 and sum(len(b) for b in full) == len(seen)


def test_epochs_reshuffle_and_a_seed_repeats():
    a = TokenBudgetBatchSampler(LENGTHS, 256, seed=1)
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first
    assert list(TokenBudgetBatchSampler(LENGTHS, 256, seed=1)) == first


def test_lr_rule():
    assert lr_for_tokens(1e-3, 2048, 4096) == pytest.approx(5e-4)
    assert lr_for_tokens(1e-3, 1024, 4096, "sqrt") == pytest.approx(5e-4)
    assert lr_for_tokens(1e-3, 1024, 4096, "none") == 1e-3
    with pytest.raises(ValueError, match="valid: linear, sqrt, none"):
        lr_for_tokens(1e-3, 1, 1, "cubic")
