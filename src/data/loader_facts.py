"""One line about the train dataloader, for findings that blame the input pipeline (profiler's and
throughput's input-bound findings): its type, dataset, workers, pinning, batch size and collate."""

from __future__ import annotations

from typing import Any

__all__ = ["describe_train_loader"]


def describe_train_loader(trainer: Any) -> str:
    """``train dataloader (DataLoader over PackedBlocks, data.num_workers=0, data.pin_memory=False,
    data.batch_size=8, collate_fn=default_collate)`` (the first loader of a combined one)."""
    loader = trainer.train_dataloader
    while isinstance(loader, (list, tuple, dict)) and loader:
        loader = next(iter(loader.values())) if isinstance(loader, dict) else loader[0]
    collate = getattr(loader, "collate_fn", None)
    return (f"train dataloader ({type(loader).__name__} over {type(getattr(loader, 'dataset', None)).__name__}, "
            f"data.num_workers={getattr(loader, 'num_workers', '?')}, data.pin_memory={getattr(loader, 'pin_memory', '?')}, "
            f"data.batch_size={getattr(loader, 'batch_size', '?')}, "
            f"collate_fn={getattr(collate, '__name__', type(collate).__name__)})")
