"""Document rows (src/data/document_rows.py) and their plumbing: the token cache split at EOS, one
document per row, a token-budget batch cut to its longest row, the rank and world that Lightning's
DistributedSampler hands to the token-budget batch sampler, and a resume under another world size."""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch.utils.data import DistributedSampler, SequentialSampler

from dsdebug.data.document_rows import DocumentRows, trim_collate
from dsdebug.data.packing import one_document_per_row, split_documents
from dsdebug.data.token_budget import LightningTokenBudgetSampler, TokenBudgetBatchSampler

EOS = 1


def test_split_at_eos_keeps_each_documents_eos():
    assert split_documents([5, 6, EOS, 7, EOS, 8, 9], EOS) == [[5, 6, EOS], [7, EOS], [8, 9]]
    assert split_documents(np.array([5, 6]), None) == [[5, 6]]


def test_one_document_per_row_pads_at_the_end_and_never_trains_on_padding():
    rows = one_document_per_row([[5, 6, 7], list(range(2, 12))], seq_len=4, pad_id=0)
    assert rows["input_ids"].tolist() == [[5, 6, 7, 0], [2, 3, 4, 5], [6, 7, 8, 9], [10, 11, 0, 0]]
    assert rows["labels"].tolist()[0] == [-100, 6, 7, -100]
    assert rows["doc_ids"].tolist()[3] == [0, 0, -1, -1]
    assert rows["position_ids"].tolist()[3] == [0, 1, 0, 0]


def test_rows_and_the_collate_that_cuts_a_batch_to_its_longest_row():
    tokens = [3, 4, EOS, 5, EOS, 6, 7, 8, EOS, 9, EOS]
    packed = DocumentRows(tokens, EOS, seq_len=6, packed=True)
    assert packed.num_documents == 4 and len(packed) == 2 and sorted(packed.lengths) == [5, 6]
    alone = DocumentRows(tokens, EOS, seq_len=6, packed=False)
    assert alone.lengths == [3, 2, 4, 2]
    batch = trim_collate([alone[1], alone[3]])
    assert batch["input_ids"].shape == (2, 2) and set(batch) == {"input_ids", "labels", "position_ids", "doc_ids"}
    assert trim_collate([alone[0], alone[2]])["input_ids"].shape == (2, 4)


def test_the_batch_sampler_takes_rank_and_world_from_lightnings_distributed_sampler():
    lengths = [int(x) for x in torch.randint(5, 120, (300,), generator=torch.Generator().manual_seed(0))]
    data = list(range(len(lengths)))
    per_rank = [list(LightningTokenBudgetSampler(DistributedSampler(data, num_replicas=2, rank=r), lengths, 256,
                                                 seed=3)) for r in range(2)]
    expected = [list(TokenBudgetBatchSampler(lengths, 256, num_replicas=2, rank=r, seed=3)) for r in range(2)]
    assert per_rank == expected and len(per_rank[0]) == len(per_rank[1])
    alone = LightningTokenBudgetSampler(SequentialSampler(data), lengths, 256, seed=3)
    assert list(alone) == list(TokenBudgetBatchSampler(lengths, 256, seed=3))


def test_a_token_budget_resume_under_another_world_size_says_it_restarts_the_epoch(caplog):
    from dsdebug.data.corpus import KJVCorpus
    from dsdebug.data.datamodule import LMDataModule

    dm = LMDataModule(KJVCorpus(), token_budget=512)
    with caplog.at_level(logging.WARNING):
        dm.load_state_dict({"batches_consumed_in_epoch": 7, "world_size": 2, "batch_size": 8})
    assert dm._position.skip == 0 and "cannot be carried over" in caplog.text
    dm.load_state_dict({"batches_consumed_in_epoch": 7, "world_size": 1, "batch_size": 4})
    assert dm._position.skip == 7  # same world: the same batch list, skipped exactly
