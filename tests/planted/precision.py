"""Planted precision setups for the mixed_precision tests.

``RealFp16OnCpu`` makes a run real fp16 mixed precision on this CPU: Lightning's own
``MixedPrecision("16-mixed", "cpu")`` plugin with a torch ``GradScaler("cpu")`` (fp16 autocast
works on CPU, emulated; the project refuses ``trainer.precision=16-mixed`` here only because
the CPU has no native fp16). Optionally it plants an overflow: from ``overflow_step`` on, for
``overflow_steps`` steps, the fp16 gradient flowing out of module ``module`` is multiplied by
``factor`` -- beyond fp16's 65504 at any scale >= 1, so the scaler sees inf and skips.

``+callbacks.planted._target_=tests.planted.precision.RealFp16OnCpu
+callbacks.planted.module=fc +callbacks.planted.overflow_step=3 +callbacks.planted.overflow_steps=20``
(use with ``strategy=ddp``).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback


class RealFp16OnCpu(Callback):
    def __init__(self, module: str | None = None, overflow_step: int = -1, overflow_steps: int = 0,
                 factor: float = 1e30) -> None:
        self.module, self.overflow_step, self.overflow_steps, self.factor = module, overflow_step, overflow_steps, factor

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        from lightning.pytorch.plugins.precision import MixedPrecision

        trainer.strategy.precision_plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.trainer = trainer
        if self.module is not None:
            modules = {(n[4:] if n.startswith("net.") else n): m for n, m in pl_module.named_modules()}
            modules[self.module].register_forward_hook(self._plant)

    def _plant(self, module: Any, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        step = self.trainer.global_step
        if self.trainer.training and output.requires_grad and \
                self.overflow_step <= step < self.overflow_step + self.overflow_steps:
            output.register_hook(lambda g: g * self.factor)
        return output
