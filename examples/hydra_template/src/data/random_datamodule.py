"""A LightningDataModule on a fixed random classification set (no download; the template uses MNIST)."""

import torch
from lightning import LightningDataModule
from torch.utils.data import DataLoader, TensorDataset


class RandomDataModule(LightningDataModule):
    def __init__(self, num_samples: int = 256, num_features: int = 32, num_classes: int = 4,
                 batch_size: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)

    def _split(self, seed: int) -> TensorDataset:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(self.hparams.num_samples, self.hparams.num_features, generator=g)
        w = torch.randn(self.hparams.num_features, self.hparams.num_classes, generator=g)
        return TensorDataset(x, (x @ w).argmax(dim=1))

    def setup(self, stage: str | None = None) -> None:
        self.data_train, self.data_val = self._split(0), self._split(1)

    def train_dataloader(self):
        return DataLoader(self.data_train, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.data_val, batch_size=self.hparams.batch_size)
