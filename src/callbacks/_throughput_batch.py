"""Throughput's batch and loader facts: tokens and samples of a batch, its sequence length, and a
one-line description of the train loader (for the data-wait finding)."""

from __future__ import annotations

from typing import Any

import torch


def _batch_size(batch: Any) -> tuple[int, int]:
    t = batch.get("input_ids") if isinstance(batch, dict) else batch[0] if isinstance(batch, (list, tuple)) else batch
    return (int(t.numel()), int(t.shape[0])) if isinstance(t, torch.Tensor) and t.dim() else (0, 0)


def _seq_len(batch: Any) -> int:
    t = batch.get("input_ids") if isinstance(batch, dict) else batch[0] if isinstance(batch, (list, tuple)) else batch
    return int(t.shape[-1]) if isinstance(t, torch.Tensor) and t.dim() else 0


def _describe_loader(trainer: Any) -> str:
    loader = trainer.train_dataloader
    while isinstance(loader, (list, tuple, dict)) and loader:
        loader = next(iter(loader.values())) if isinstance(loader, dict) else loader[0]
    collate = getattr(loader, "collate_fn", None)
    return (f"data.num_workers={getattr(loader, 'num_workers', '?')}, data.pin_memory="
            f"{getattr(loader, 'pin_memory', '?')}, data.batch_size={getattr(loader, 'batch_size', '?')}, "
            f"collate_fn={getattr(collate, '__name__', type(collate).__name__)}")
