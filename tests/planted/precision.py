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

import functools

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
        factory = getattr(pl_module, "optimizer_factory", None)
        if factory is not None:  # as optim.optimizer.fused=auto resolves under torch AMP fp16 (models/optim.py)
            pl_module.optimizer_factory = functools.partial(factory, fused=False)

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


class DeepSpeedFp16OnCpu(RealFp16OnCpu):
    """DeepSpeed's own fp16 (ZeRO's fp16 optimizer, its DynamicLossScaler) on this CPU, as ``trainer.precision=16-mixed``
    runs it on a GPU: the gradients the checks read before ``engine.step()`` are still multiplied by the loss scale.
    DeepSpeed's CPU accelerator says fp16 is unsupported without AVX512-FP16 (torch computes it anyway, emulated, slowly):
    for this process it is told otherwise. ``initial_scale_power``/``hysteresis``/``min_loss_scale`` go to the ds_config
    ``fp16`` section (Lightning's DeepSpeedStrategy writes it from these attributes); 32 makes the scaler search down
    from 2^32, as Megatron starts, a normal run of skipped steps at the start. The overflow plant is RealFp16OnCpu's.
    Used with ``strategy=zero2`` (tests/callbacks/test_fp16_loss_scale.py)."""

    def __init__(self, initial_scale_power: int = 16, hysteresis: int = 2, min_loss_scale: float = 1.0,
                 loss_scale_window: int = 1000, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ds_fp16 = {"initial_scale_power": initial_scale_power, "hysteresis": hysteresis,
                        "min_loss_scale": min_loss_scale, "loss_scale_window": loss_scale_window}
        self._restore: Any = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        from deepspeed.accelerator import get_accelerator
        from lightning.pytorch.plugins.precision import DeepSpeedPrecision

        strategy = trainer.strategy
        for key in ("fp16", "bf16"):
            strategy.config.pop(key, None)
        for key, value in self.ds_fp16.items():
            setattr(strategy, key, value)  # _format_precision_config reads these when the engine starts
        strategy.loss_scale = 0  # dynamic
        strategy.precision_plugin = DeepSpeedPrecision("16-mixed")
        acc = type(get_accelerator())
        self._restore = (acc, acc.__dict__.get("is_fp16_supported"))
        acc.is_fp16_supported = lambda self: True

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._restore is not None:
            acc, original = self._restore
            if original is None:
                del acc.is_fp16_supported
            else:
                acc.is_fp16_supported = original
            self._restore = None
