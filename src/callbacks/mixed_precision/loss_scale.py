"""Where the fp16 loss scale lives (DeepSpeed's DynamicLossScaler, torch's GradScaler), for mixed_precision."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["FP16_TINY", "ScalerReader", "read_scaler", "subnormal_fraction"]

FP16_TINY = torch.finfo(torch.float16).tiny  # 6.1e-5, smallest normal fp16


class ScalerReader:
    """Reads (scale, skipped this step) after each optimizer step, from DeepSpeed or torch's GradScaler."""

    def __init__(self, kind: str, obj: Any) -> None:
        self.kind, self.obj = kind, obj
        self._prev_scale: float | None = None if kind == "deepspeed" else float(obj.get_scale())
        self._prev_skipped = int(obj.skipped_steps) if kind == "deepspeed" else 0

    def _ds_scaler(self) -> Any:
        return getattr(self.obj.optimizer, "loss_scaler", None)

    def scale(self) -> float:
        if self.kind == "deepspeed":
            s = self._ds_scaler()
            return float(s.cur_scale if s is not None else self.obj.optimizer.cur_scale)
        return float(self.obj.get_scale())

    def min_scale(self) -> float | None:
        s = self._ds_scaler() if self.kind == "deepspeed" else None
        return float(s.min_scale) if s is not None and getattr(s, "dynamic", False) else None

    def settings(self) -> dict:
        if self.kind == "deepspeed":
            s = self._ds_scaler()
            return {k: getattr(s, a) for k, a in (("scale_window", "scale_window"), ("hysteresis", "delayed_shift"),
                                                 ("min_scale", "min_scale")) if hasattr(s, a)}
        return {"growth_interval": self.obj.get_growth_interval(), "backoff_factor": self.obj.get_backoff_factor()}

    def read(self) -> tuple[float, bool]:
        scale = self.scale()
        if self.kind == "deepspeed":
            total = int(self.obj.skipped_steps)
            skipped, self._prev_skipped = total > self._prev_skipped, total
        else:  # GradScaler: backoff (scale down) happens exactly on the steps it skipped
            skipped = self._prev_scale is not None and scale < self._prev_scale
        self._prev_scale = scale
        return scale, skipped


def read_scaler(trainer: Any) -> ScalerReader | None:
    """The run's dynamic loss scaler, or None (fp32 / bf16 / static scale)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    if isinstance(trainer.strategy, DeepSpeedStrategy):
        engine = trainer.strategy.deepspeed_engine
        return ScalerReader("deepspeed", engine) if engine.fp16_enabled() else None
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return ScalerReader("torch", scaler) if scaler is not None and scaler.is_enabled() else None


def subnormal_fraction(grads: list[torch.Tensor]) -> tuple[float, int]:
    """Share of non-zero fp16 gradient elements below fp16's smallest normal, and how many were counted."""
    sub = nonzero = 0
    for g in grads:
        if g is None or g.dtype != torch.float16 or g.numel() == 0:
            continue
        a = g.detach().abs()
        nz = a > 0
        nonzero += int(nz.sum())
        sub += int((nz & (a < FP16_TINY)).sum())
    return (sub / nonzero if nonzero else 0.0), nonzero
