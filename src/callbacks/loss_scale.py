"""The fp16 loss scale, shared by the checks that read gradients (grad_monitor, loss_spike, layer_health,
nan_triage) and mixed_precision: where the scale lives (DeepSpeed's loss scaler, torch's GradScaler), what
it leaves in the gradients a check reads, and which non-finite gradients are the scaler's business.

- ``ScalerReader`` (``read_scaler(trainer)``): the current scale, its floor, the skipped steps; ``grad_factor``:
  the factor the gradients read in ``on_before_optimizer_step`` still carry. DeepSpeed unscales inside
  ``engine.step()``, after that hook, so there they are the loss-scaled gradients (x65536 at the default
  scale); Lightning's 16-mixed calls ``GradScaler.unscale_`` before the hook (factor 1).
- ``OverflowJudge``: whether a step's non-finite gradients are an overflow the dynamic scaler absorbs (it
  skips that update and lowers the scale: the scaler doing its job, not an error, not a NaN to rerun) or a
  non-finite value it does not absorb.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ABSORBED_STREAK", "OverflowJudge", "ScalerReader", "read_scaler"]

#: overflowed steps in a row a dynamic scaler absorbs once it has found its scale: DeepSpeed's hysteresis 2
#: makes two in a row normal when the scale grows back (every loss_scale_window steps); the next one is the
#: step mixed_precision's overflow_streak warns at by default (streak_warn=4)
ABSORBED_STREAK = 3


class ScalerReader:
    """Reads a run's fp16 loss scaler: DeepSpeed's (``engine.optimizer``) or torch's GradScaler."""

    def __init__(self, kind: str, obj: Any) -> None:
        self.kind, self.obj = kind, obj
        self.initial = self.scale()  # the scale at the start (GradScaler: one host read, here only)
        self._prev_scale: float | None = None if kind == "deepspeed" else self.initial
        self._prev_skipped = int(obj.skipped_steps) if kind == "deepspeed" else 0

    def _ds(self) -> Any:
        """DeepSpeed's scale holder: ZeRO's DynamicLossScaler, or the stage-0 fp16 optimizer's LossScaleConfig."""
        opt = self.obj.optimizer
        return getattr(opt, "loss_scaler", None) or getattr(opt, "loss_scale_config", None)

    def scale(self) -> float:
        """The current scale: a python number under DeepSpeed; GradScaler: ``get_scale()``, a host read."""
        if self.kind == "deepspeed":
            current = getattr(self.obj.optimizer, "cur_scale", None)  # ZeRO: an external scale if one is set
            return float(current if current is not None else self._ds().cur_scale)
        return float(self.obj.get_scale())

    def dynamic(self) -> bool:
        """A dynamic scaler lowers the scale on an overflow; a static scale (ds_config loss_scale > 0) never moves."""
        if self.kind != "deepspeed":
            return True
        s = self._ds()
        return bool(getattr(s, "dynamic", getattr(s, "dynamic_loss_scale", False)))

    def min_scale(self) -> float | None:
        """DeepSpeed's floor (``min_loss_scale``); None for GradScaler (it has none) or a static scale."""
        if self.kind != "deepspeed" or not self.dynamic():
            return None
        s = self._ds()
        floor = getattr(s, "min_scale", getattr(s, "min_loss_scale", None))
        return None if floor is None else float(floor)

    def settings(self) -> dict:
        if self.kind == "deepspeed":
            s = self._ds()
            return {k: getattr(s, a) for k, a in (("scale_window", "scale_window"), ("hysteresis", "delayed_shift"),
                                                 ("min_scale", "min_scale")) if hasattr(s, a)}
        return {"growth_interval": self.obj.get_growth_interval(), "backoff_factor": self.obj.get_backoff_factor()}

    def grad_factor(self, optimizer: Any) -> float | torch.Tensor:
        """The factor the gradients read in ``on_before_optimizer_step`` carry on top of the true gradient
        (divide by it). DeepSpeed: its current loss scale (it unscales inside ``engine.step()``, after the
        hook), a python number. GradScaler: 1.0 once Lightning has unscaled ``optimizer`` before the hook; an
        optimizer that unscales in its own step (fused Adam) is not unscaled there: the scale, a 0-dim tensor
        on the gradients' device (divide on the device: no host read)."""
        if self.kind == "deepspeed":
            return self.scale()
        from torch.amp.grad_scaler import OptState

        state = self.obj._per_optimizer_states.get(id(getattr(optimizer, "_optimizer", optimizer)))
        if (state is not None and state["stage"] is OptState.UNSCALED) or self.obj._scale is None:
            return 1.0
        return self.obj._scale

    def backward_scale(self) -> float | torch.Tensor:
        """The scale this step's backward ran with: a rerun that is to meet the step's overflow again
        differentiates the loss times this (no host read: a python number, or GradScaler's device tensor)."""
        if self.kind == "deepspeed":
            return self.scale()
        return self.obj._scale if self.obj._scale is not None else self.initial

    def read(self) -> tuple[float, bool]:
        """After a step: (scale, was that step skipped?)."""
        scale = self.scale()
        if self.kind == "deepspeed":
            total = int(self.obj.skipped_steps)
            skipped, self._prev_skipped = total > self._prev_skipped, total
        else:  # GradScaler: backoff (scale down) happens exactly on the steps it skipped
            skipped = self._prev_scale is not None and scale < self._prev_scale
        self._prev_scale = scale
        return scale, skipped


def read_scaler(trainer: Any) -> ScalerReader | None:
    """The run's fp16 loss scaler, or None (fp32 / bf16). Once the strategy has set up (``on_fit_start`` on)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    if isinstance(trainer.strategy, DeepSpeedStrategy):
        engine = trainer.strategy.deepspeed_engine
        return ScalerReader("deepspeed", engine) if engine.fp16_enabled() else None
    scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
    return ScalerReader("torch", scaler) if scaler is not None and scaler.is_enabled() else None


class OverflowJudge:
    """Is a step's non-finite gradient the dynamic loss scaler's business? ``judge`` once per optimizer step,
    with the same (all-reduced) flags on every rank, so every rank reaches the same verdict:
    ``finite`` | ``absorbed`` | ``not_absorbed``.

    Under a dynamic loss scaler a step whose loss is finite but whose gradients are not is an overflow: the
    scaler skips that update and lowers the scale. It absorbs:
    - every overflow until the first step goes through: the scaler's search for a scale that fits (from 2^16,
      or Megatron's 2^32, several skipped steps in a row are a normal start);
    - afterwards, up to ``ABSORBED_STREAK`` overflowed steps in a row.
    Not absorbed: a non-finite loss (the forward pass never sees the loss scale); the next overflowed step in
    a row; an overflow with the scale at its floor (DeepSpeed's ``min_loss_scale``), or, under GradScaler (no
    floor), a search that has taken the scale below 1; any non-finite gradient without a dynamic scaler.
    No host read: DeepSpeed's scale is a python number; GradScaler's is counted from its initial value (it
    halves on every skipped step). Not kept across a resume: a resumed run is past its search, its streak
    starts at 0."""

    def __init__(self, reader: ScalerReader | None, resumed: bool = False) -> None:
        self.reader = reader if reader is not None and reader.dynamic() else None
        self.found = resumed  # a step went through: the initial scale search is over
        self.streak = 0  # non-finite steps in a row
        self.absorbed = 0  # overflowed steps the scaler absorbed (for the checks' summaries)
        self.why = ""  # why the last non-finite step was not absorbed (a clause for the finding)

    def scale_now(self) -> float | None:
        """The scale this step runs with, for a check that judges the step later (it reads its values in
        batches): DeepSpeed's, a python number; None under GradScaler (counted from its start) or no scaler."""
        return self.reader.scale() if self.reader is not None and self.reader.kind == "deepspeed" else None

    def judge(self, loss_finite: bool, grads_finite: bool, scale: float | None = None) -> str:
        """The verdict on one step, in step order; ``scale``: that step's (``scale_now()`` then), else the current."""
        if loss_finite and grads_finite:
            self.found, self.streak = True, 0
            return "finite"
        self.streak += 1
        if self.reader is None or not loss_finite:
            self.why = "" if self.reader is None else "the loss itself is non-finite: no loss scale absorbs that"
            return "not_absorbed"
        floor = self._floor(scale)
        if floor:
            self.why = floor
        elif not self.found or self.streak <= ABSORBED_STREAK:
            self.absorbed += 1
            return "absorbed"
        else:
            self.why = (f"{self.streak} overflowed steps in a row, more than the dynamic loss scaler absorbs "
                        f"(lowering the scale did not help)")
        return "not_absorbed"

    def _floor(self, scale: float | None = None) -> str:
        """Why the scale (the step's) cannot go lower, or ''."""
        r = self.reader
        if r.kind == "deepspeed":
            floor, scale = r.min_scale(), (r.scale() if scale is None else scale)
            return (f"the loss scale is at its floor {scale:g} (min_loss_scale): the scaler cannot lower it"
                    if floor is not None and scale <= floor else "")
        scale = r.initial * r.obj.get_backoff_factor() ** (self.streak - 1)  # the scale this step ran with
        return (f"{self.streak} overflowed steps in a row from the start took the loss scale from {r.initial:g} to "
                f"{scale:.3g}, below 1: no scale fits" if not self.found and scale < 1.0 else "")
