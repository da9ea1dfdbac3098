"""Planted non-finite forwards for the nan_triage tests.

``NaNOutput``: at ``step`` (on ``rank``, None = every rank) the output of module ``module`` becomes
NaN -- on the first ``calls`` calls of that step only (``calls=1``: a transient fault, the rerun is
finite), or on every call during the step (``calls=null``: reproducible, the rerun hits it again).
``+callbacks.planted._target_=tests.planted.nan.NaNOutput +callbacks.planted.module=mlp.2
+callbacks.planted.step=3 +callbacks.planted.calls=1``

``OverflowOutput``: the same, but the output goes through an unstable ``exp(100 x)`` (a float32
overflow: inf where x > ~0.89; the next layers make NaN of it). ``NaNLoss``: every module output stays finite, the loss
of that step is NaN (a log(0) or 0/0 in the loss computation); the rerun meets it again.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback


class NaNOutput(Callback):
    def __init__(self, module: str, step: int, calls: int | None = None, rank: int | None = None) -> None:
        self.module, self.step, self.calls, self.rank = module, step, calls, rank
        self.seen = 0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.trainer = trainer
        modules = {(n[4:] if n.startswith("net.") else n): m for n, m in pl_module.named_modules()}
        modules[self.module].register_forward_hook(self._poison)

    def _poison(self, module: Any, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        t = self.trainer
        if t.global_step != self.step or not t.training or self.rank not in (None, t.global_rank):
            return output
        self.seen += 1
        return self.poison(output) if self.calls is None or self.seen <= self.calls else output

    def poison(self, output: torch.Tensor) -> torch.Tensor:
        return output * float("nan")


class OverflowOutput(NaNOutput):
    def poison(self, output: torch.Tensor) -> torch.Tensor:
        return torch.exp(output * 100.0)  # an unstable exp: float32 overflows to inf above ~88.7


class NaNLoss(Callback):
    """The step's loss is NaN at ``step`` (every module output finite): wraps the LightningModule's
    ``_losses``, which both its training_step and nan_triage's rerun call."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        losses = pl_module._losses

        def poisoned(batch: Any, training: bool = False) -> Any:
            loss, moe = losses(batch, training=training)
            if trainer.global_step == self.step and trainer.training:
                loss = loss * float("nan")
            return loss, moe

        pl_module._losses = poisoned
