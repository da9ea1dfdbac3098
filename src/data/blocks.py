"""Fixed-length blocks of a token array (the dataset ``LMDataModule`` serves) and the
dataloader workers' seeding; split from ``datamodule.py``."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ["PackedBlocks", "seed_worker"]


class PackedBlocks(Dataset):
    """Blocks ``tokens[start + i*seq_len : start + (i+1)*seq_len]`` for i < num_blocks."""

    def __init__(self, tokens: np.ndarray, seq_len: int, start: int, num_blocks: int):
        self.tokens, self.seq_len, self.start, self.num_blocks = tokens, seq_len, start, num_blocks

    @property
    def token_range(self) -> tuple[int, int]:
        """Half-open [first, last) token positions covered by this split."""
        return self.start, self.start + self.num_blocks * self.seq_len

    def __len__(self) -> int:
        return self.num_blocks

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.num_blocks:
            raise IndexError(i)
        a = self.start + i * self.seq_len
        ids = torch.from_numpy(np.asarray(self.tokens[a : a + self.seq_len], dtype=np.int64))
        return {"input_ids": ids, "labels": ids.clone()}


def seed_worker(worker_id: int) -> None:
    """Seed numpy/random per dataloader worker from torch's per-worker seed."""
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)
