"""Planted loss spikes (and a batch witness) for the loss_spike tests.

``+callbacks.spike._target_=tests.planted.spike.SpikeLoss +callbacks.spike.steps=[9,10]``: at those
global steps the net's logits are multiplied by ``factor`` (a confidently wrong model: the loss
jumps many-fold, the gradients with it), or, with ``mode=random_tokens``, the batch's tokens
are replaced by random ones (corrupted data). ``BatchWitness`` writes, per rank, one line per
training batch: global step, epoch, batch_idx and a fingerprint of the tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback


class SpikeLoss(Callback):
    def __init__(self, steps: list[int], factor: float = 20.0, mode: str = "logits", rank: int | None = None):
        self.steps, self.factor, self.mode, self.rank = {int(s) for s in steps}, float(factor), mode, rank

    def _active(self, trainer: Any) -> bool:
        return trainer.global_step in self.steps and self.rank in (None, trainer.global_rank)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.trainer = trainer
        if self.mode == "logits":
            pl_module.net.register_forward_hook(self._scale)

    def _scale(self, module: Any, inputs: Any, output: Any) -> Any:
        if not (self.trainer.training and self._active(self.trainer)):
            return output
        if hasattr(output, "logits"):
            output.logits = output.logits * self.factor
            return output
        return output * self.factor

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.mode == "random_tokens" and self._active(trainer):
            ids = batch["input_ids"]
            ids.random_(0, int(ids.max()) + 1)
            if "labels" in batch:
                batch["labels"].copy_(ids)


class BatchWitness(Callback):
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        ids = batch["input_ids"]
        fingerprint = int((ids.long() * torch.arange(1, ids.numel() + 1).view_as(ids)).sum())
        rec = {"step": trainer.global_step, "epoch": trainer.current_epoch, "batch_idx": batch_idx, "fp": fingerprint}
        with open(Path(trainer.default_root_dir) / f"batches_rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")


def read_batches(run_dir: Path, rank: int = 0) -> list[dict]:
    path = run_dir / f"batches_rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
