"""A plain LightningModule (BoringModel-like) on random float tensors, or on token ids (``tokens=True``).

Planted bugs, all off by default: ``nan_at_step`` makes the loss NaN at that step;
``val_copies_train`` makes the validation set a copy of the training set.
"""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

VOCAB, DIM = 50, 32


class RandomFloats(Dataset):
    def __init__(self, n: int = 64, seed: int = 0) -> None:
        self.x = torch.randn(n, DIM, generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i]


class RandomTokens(Dataset):
    def __init__(self, n: int = 64, seq: int = 16, seed: int = 0) -> None:
        self.ids = torch.randint(0, VOCAB, (n, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class BoringModel(L.LightningModule):
    def __init__(self, tokens: bool = False, nan_at_step: int = -1, val_copies_train: bool = False) -> None:
        super().__init__()
        self.tokens, self.nan_at_step, self.val_copies_train = tokens, nan_at_step, val_copies_train
        self.shifts_labels = True  # tells DataInspector that the loss shifts labels itself (token variant)
        self.embed = torch.nn.Embedding(VOCAB, DIM) if tokens else None
        self.layer = torch.nn.Linear(DIM, VOCAB if tokens else 2)

    def forward(self, batch):
        return self.layer(self.embed(batch["input_ids"])) if self.tokens else self.layer(batch)

    def loss(self, batch) -> torch.Tensor:
        out = self(batch)
        if not self.tokens:
            return out.pow(2).mean()
        return torch.nn.functional.cross_entropy(out[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        if self.global_step == self.nan_at_step:
            loss = loss * float("nan")  # planted: this step's loss and every gradient are NaN
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def _data(self, seed: int) -> Dataset:
        return RandomTokens(seed=seed) if self.tokens else RandomFloats(seed=seed)

    def train_dataloader(self):
        return DataLoader(self._data(0), batch_size=4)

    def val_dataloader(self):
        return DataLoader(self._data(0 if self.val_copies_train else 1), batch_size=4)
