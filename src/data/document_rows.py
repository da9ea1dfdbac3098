"""Rows of whole documents (``data.packing=true``, or ``data.token_budget`` set): the dataset
``LMDataModule`` serves instead of fixed blocks when documents must stay apart.

Each item is ``{"input_ids", "labels", "position_ids", "doc_ids"}`` of one row (``packing.py`` builds
them: positions restart per document, labels -100 on padding and on each document's first token,
``doc_ids`` -1 on padding). ``lengths`` (non-padding tokens per row; padding sits at a row's end) feed
the token-budget sampler, and ``trim_collate`` cuts a batch to its longest row, so a token-budget batch
of short rows carries no columns of padding. Nothing here calls a collective.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.data import Dataset
from torch.utils.data.dataloader import default_collate

from dsdebug.data.packing import one_document_per_row, pack_documents, split_documents

__all__ = ["DocumentRows", "trim_collate"]


class DocumentRows(Dataset):
    """The documents of ``tokens`` (EOS-terminated) packed several per row (``packed``) or one per row."""

    def __init__(self, tokens: Sequence[int], eos_id: int | None, seq_len: int, pad_id: int = 0,
                 packed: bool = True) -> None:
        self.docs = split_documents(tokens, eos_id)
        build = pack_documents if packed else one_document_per_row
        self.rows = build(self.docs, seq_len, pad_id)
        self.seq_len, self.packed = seq_len, packed
        self.lengths: list[int] = (self.rows["doc_ids"] >= 0).sum(dim=1).tolist()

    @property
    def num_documents(self) -> int:
        return len(self.docs)

    def __len__(self) -> int:
        return self.rows["input_ids"].size(0)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        return {k: v[i] for k, v in self.rows.items()}


def trim_collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack rows and drop the trailing columns that are padding in every row."""
    batch = default_collate(items)
    longest = int((batch["doc_ids"] >= 0).sum(dim=1).max()) if batch["doc_ids"].numel() else 0
    return {k: v[:, :max(longest, 1)] for k, v in batch.items()}
