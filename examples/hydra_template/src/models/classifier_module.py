"""A LightningModule in lightning-hydra-template's style: net, criterion and optimizer from the config.

Planted bug (off by default): ``nan_at_step`` makes the training loss NaN from that step on.
"""

from typing import Any

import torch
from lightning import LightningModule


class ClassifierModule(LightningModule):
    def __init__(self, net: torch.nn.Module, optimizer: Any, nan_at_step: int = -1) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False, ignore=["net"])
        self.net = net
        self.criterion = torch.nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def model_step(self, batch):
        x, y = batch
        logits = self(x)
        return self.criterion(logits, y), (logits.argmax(dim=1) == y).float().mean()

    def training_step(self, batch, batch_idx):
        loss, acc = self.model_step(batch)
        if 0 <= self.hparams.nan_at_step <= self.global_step:
            loss = loss * float("nan")  # planted: this step's loss and every gradient are NaN
        self.log("train/loss", loss, on_step=True, on_epoch=False)
        self.log("train/acc", acc, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch, batch_idx):
        loss, acc = self.model_step(batch)
        self.log("val/loss", loss, sync_dist=True)
        self.log("val/acc", acc, sync_dist=True)

    def configure_optimizers(self):
        return {"optimizer": self.hparams.optimizer(params=self.parameters())}
