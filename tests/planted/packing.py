"""Planted bugs for the packing check (``data.packing=true``): each breaks one property of packed
documents, and tests/callbacks/test_cb_packing.py checks the finding names it (and only it).

- ``PositionsRunOn`` (``data._target_=tests.planted.packing.PositionsRunOn``): position_ids 0..T-1 along
  the whole row, as if the documents were one -- ``positions_not_reset``.
- ``PositionsRunOnRank1``: the same on rank 1 only (2 processes) -- ``positions_not_reset`` naming rank 1.
- ``LabelsCrossDocuments`` (``data._target_=...``): labels = input_ids on every real token, so each
  document's last token is trained to predict the next document's first -- ``labels_cross_documents``.
- ``MaskDroppedLM`` (``model._target_=tests.planted.packing.MaskDroppedLM``): the module calls the net
  with input_ids only (no document mask, no positions): documents attend to the earlier ones in their
  row -- ``cross_document_attention``.
"""

from __future__ import annotations

import torch

from dsdebug.data.datamodule import LMDataModule
from dsdebug.models.lm_module import CausalLMModule


class PositionsRunOn(LMDataModule):
    def _setup_documents(self, *args, **kwargs) -> None:
        super()._setup_documents(*args, **kwargs)
        for dataset in (self.train_dataset, self.val_dataset):
            rows = dataset.rows["position_ids"]
            rows[:] = torch.arange(rows.size(1))


class PositionsRunOnRank1(PositionsRunOn):
    """The same bug on rank 1 only (a rank-dependent data path): the finding must name rank 1."""

    def _setup_documents(self, *args, **kwargs) -> None:
        if self.trainer is not None and self.trainer.global_rank == 1:
            super()._setup_documents(*args, **kwargs)
        else:
            LMDataModule._setup_documents(self, *args, **kwargs)


class LabelsCrossDocuments(LMDataModule):
    def _setup_documents(self, *args, **kwargs) -> None:
        super()._setup_documents(*args, **kwargs)
        for dataset in (self.train_dataset, self.val_dataset):
            rows = dataset.rows
            real = rows["doc_ids"] >= 0
            rows["labels"][real] = rows["input_ids"][real]


class MaskDroppedLM(CausalLMModule):
    def net_inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"input_ids": batch["input_ids"]}
