"""`MixedPrecisionCheck`: fp16 loss-scale trajectory, skipped steps, overflow streaks, bf16 update underflow.

The config example and the table of metrics and findings: the class docstring (`MixedPrecisionCheck`).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, ClassVar

import torch

from dsdebug.callbacks.loss_scale import ScalerReader, read_scaler
from dsdebug.callbacks.mixed_precision.underflow import FP16_TINY, subnormal_fraction
from dsdebug.config.args import Rule, integer, number
from dsdebug.callbacks.base import DebugCallback
from dsdebug.callbacks.grad_access import _at_accumulation_boundary, display_name, grad_source, local_grad
from dsdebug.findings import Finding

__all__ = ["MixedPrecisionCheck"]

log = logging.getLogger(__name__)
ADVICE = ("keep dynamic loss scaling (DeepSpeed fp16.loss_scale=0) with loss_scale_window=1000 and "
          "hysteresis 2; lower initial_scale_power (16 -> 12) if the first steps all overflow; Adam eps=1e-8; "
          "gradient clipping max_norm=1.0 (optim.grad_clip); or switch to bf16 (trainer.precision=bf16-mixed: "
          "fp32's exponent range, no loss scaling)")


class MixedPrecisionCheck(DebugCallback):
    """`MixedPrecisionCheck`: fp16 loss-scale trajectory, skipped steps, overflow streaks, bf16 update underflow.

    Catches (unstable mixed-precision training): an fp16 run whose dynamic loss scaler keeps skipping
    steps (a streak of overflows: the gradients are non-finite whatever the scale, i.e. a real
    NaN/Inf, not a too-high scale), a scale that collapsed to its floor (training has effectively
    stopped: every step is skipped or its gradients underflow), too many skipped steps over a window,
    and, for weights kept in bf16 without fp32 master copies, updates rounded away (|dw| < ~2^-8 |w|).

    A skipped step is the scaler doing its job. At the start it searches for a scale that fits: every
    step overflows and halves the scale (after DeepSpeed's hysteresis) until the first one goes through
    (from 2^16 a few steps, from Megatron's 2^32 a dozen or more). That initial search is not a streak:
    streaks count from the first step that went through; the search is judged by the floor alone
    (``loss_scale_min``: a NaN/Inf present from step 0 halves the scale down to it) and shown in the
    summary (skipped steps, scale before -> after). The gradient checks read the same scaler
    (``dsdebug.callbacks.loss_scale``): they judge unscaled gradients and leave absorbed overflows alone.

    Where the loss scale is read (python numbers, after each optimizer step; no collective): DeepSpeed fp16
    from ``engine.optimizer.loss_scaler`` (DynamicLossScaler: ``cur_scale``, ``min_scale``, hysteresis
    ``delayed_shift``, ``scale_window``) and ``engine.skipped_steps`` (no device sync); Lightning
    ``16-mixed`` from ``trainer.precision_plugin.scaler.get_scale()`` -- a step was skipped iff the
    scale went down (GradScaler backs off on every inf step, only then); one ``.item()`` per step on
    GPU, after GradScaler.step has synchronised anyway. fp32/bf16: no scaler, that part is idle. The
    scale and skip flags are agreed across ranks by both scalers, so every rank decides alike: rank 0
    writes, every rank applies ``on_error`` (warn | stop; ``skip`` is refused: the step is skipped).

    bf16 update underflow (every ``every_n_steps``, rank 0: weights replicated): when the optimizer
    updates bf16 weights itself (``bf16-true``; not DeepSpeed, whose bf16 optimizers keep fp32
    masters, nor ``bf16-mixed``, fp32 weights), it clones them before the step and counts elements
    with a non-zero gradient that did not move (update < half a bf16 ulp). Cost: one copy of the
    bf16 weights per checked step. Gradient underflow: exact zeros are NOT used (embedding rows, idle
    experts and dead units give many structural zeros); the robust signal is the share of non-zero
    fp16 gradient elements below fp16's smallest normal (6.1e-5: losing bits, their smaller
    neighbours flushed to 0). bf16 has fp32's exponent range and is not judged; torch AMP's parameter
    gradients are fp32 (its underflow shows as a low loss scale), so this applies to fp16 gradients
    only (DeepSpeed fp16, fp16 weights).

    Example::

        python train.py +callbacks=mixed_precision trainer=gpu trainer.precision=16-mixed
        python train.py +callbacks=mixed_precision trainer.precision=bf16-true strategy=ddp

    | metric key | meaning |
    |---|---|
    | ``precision/loss_scale`` | current loss scale (fp16 only, every ``every_n_steps``) |
    | ``precision/skipped_steps`` | skipped (overflowed) optimizer steps so far |
    | ``precision/bf16_stale_fraction`` | share of bf16 weight elements with a gradient that did not move |
    | ``precision/fp16_subnormal_grad_fraction`` | share of non-zero fp16 gradient elements below fp16's smallest normal |

    | finding code | severity | when |
    |---|---|---|
    | ``overflow_streak`` | warning / error | ``streak_warn`` / ``streak_error`` consecutive skipped steps after the scaler's initial search (the first step that goes through ends it) |
    | ``loss_scale_min`` | error | a step overflowed and the scale is at its floor (DeepSpeed ``min_scale``, else ``min_scale``) |
    | ``frequent_overflow`` | warning | > ``max_skip_fraction`` of the last ``window`` steps skipped (after ``warmup_steps``) |
    | ``bf16_update_underflow`` | warning | > ``max_stale_fraction`` of bf16 weight elements did not move (after ``warmup_steps``; once) |
    | ``grad_underflow`` | warning | > ``max_subnormal_fraction`` of non-zero fp16 gradient elements are subnormal |
    | ``precision_summary`` | info | at the end: precision, scaler, skipped steps, scale range, the initial search (skipped steps, scale before -> after), worst stale fraction |

    Resume (``state_attrs``, from the scaler every rank agrees on): the overflow streak, skipped and
    observed steps, the skip window, whether the scale-floor error was reported, the initial search (over?
    its skipped steps; a resumed run without it counts as past it). Not kept: the scale
    history (grows with the run) and the bf16 stale fraction (rank 0's own measurement).
    """
    name = "mixed_precision"
    policies = ("warn", "stop")
    policy_note = "skip: the scaler already skips an overflowed step"
    state_attrs = ("streak", "skipped", "steps", "_recent", "_at_floor_reported", "_found", "search_skipped",
                   "search_scale")

    #: argument rules, declared: the config layer reads them before the check is built
    #: (config/check_args.json, written by python -m dsdebug.callbacks.arg_table)
    arg_rules: ClassVar[dict[str, Rule]] = {
        "every_n_steps": integer(0, note="0 = off"),
        "streak_warn": integer(1),
        "streak_error": integer(1),
        "min_scale": number(0, open_low=True),
        "window": integer(1),
        "max_skip_fraction": number(0, 1, open_low=True),
        "warmup_steps": integer(0),
        "max_stale_fraction": number(0, 1, open_low=True),
        "max_subnormal_fraction": number(0, 1, open_low=True),
    }

    def __init__(self, every_n_steps: int = 50, streak_warn: int = 4, streak_error: int = 10,
                 min_scale: float = 1.0, window: int = 100, max_skip_fraction: float = 0.05,
                 warmup_steps: int = 50, max_stale_fraction: float = 0.5, max_subnormal_fraction: float = 0.1,
                 on_error: str = "warn") -> None:
        super().__init__(on_error=on_error)
        self.check_declared(every_n_steps=every_n_steps, streak_warn=streak_warn, streak_error=streak_error,
                            min_scale=min_scale, window=window, max_skip_fraction=max_skip_fraction,
                            warmup_steps=warmup_steps, max_stale_fraction=max_stale_fraction,
                            max_subnormal_fraction=max_subnormal_fraction)
        self.check_args(streak_error=(streak_error, integer(streak_warn, note="streak_warn")))
        self.every_n_steps, self.streak_warn, self.streak_error = every_n_steps, streak_warn, streak_error
        self.min_scale, self.window, self.max_skip_fraction = float(min_scale), window, float(max_skip_fraction)
        self.warmup_steps, self.max_stale_fraction = warmup_steps, float(max_stale_fraction)
        self.max_subnormal_fraction = float(max_subnormal_fraction)
        self.reader: ScalerReader | None = None
        self.streak = self.skipped = self.steps = 0
        self._recent: deque[bool] = deque(maxlen=window)
        self._scales: list[float] = []
        self._at_floor_reported = False
        self._found = False  # a step went through: the scaler's initial search is over
        self.search_skipped = 0  # steps the initial search skipped
        self.search_scale: float | None = None  # the scale it found
        self._stepped = False
        self._bf16: list[tuple[str, torch.nn.Parameter]] = []
        self._snap: list[torch.Tensor] | None = None
        self.worst_stale = (0.0, None)
        self._stale_reported = False

    # ---- setup: every rank --------------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        from lightning.pytorch.strategies import DeepSpeedStrategy

        self.reader = read_scaler(trainer)
        self._found = self._found or trainer.global_step > 0  # a resumed run is past its search
        self._source = grad_source(trainer.strategy)
        master = isinstance(trainer.strategy, DeepSpeedStrategy)  # its bf16/ZeRO optimizers keep fp32 masters
        self._bf16 = [] if master else [(display_name(n), p) for n, p in pl_module.named_parameters()
                                        if p.requires_grad and p.dtype == torch.bfloat16]
        self._params = [p for p in pl_module.parameters() if p.requires_grad]
        if trainer.global_rank == 0:
            log.info("mixed_precision: precision %s, loss scaler %s%s", trainer.precision,
                     self.reader.kind if self.reader else "none",
                     f", {len(self._bf16)} bf16 weights without fp32 masters" if self._bf16 else "")

    # ---- per optimizer step ---------------------------------------------------------------
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if not _at_accumulation_boundary(trainer):
            return
        self._stepped = True
        step = trainer.global_step
        if not self.due(step):
            return
        if self._bf16 and trainer.global_rank == 0 and step >= self.warmup_steps:
            self._snap = [p.detach().clone() for _, p in self._bf16]  # rank 0: weights are replicated
        if self.reader is not None:
            frac, n = subnormal_fraction([local_grad(p, self._source) for p in self._params])
            if n and frac > self.max_subnormal_fraction and trainer.global_rank == 0:
                self._report(trainer, "warning", "grad_underflow",
                             f"{frac:.1%} of the {n} non-zero fp16 gradient elements on rank 0 are subnormal "
                             f"(< {FP16_TINY:.2g}) at step {step} > max_subnormal_fraction="
                             f"{self.max_subnormal_fraction:g}: small gradients are being flushed to zero",
                             "raise the loss scale (initial_scale_power, a smaller hysteresis/scale window), or "
                             "switch to bf16; " + ADVICE, {"fraction": frac, "elements": n}, rank=0)
            self._log(trainer, {"precision/fp16_subnormal_grad_fraction": frac} if n else {})

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._stepped:
            return
        self._stepped = False
        step = trainer.global_step - 1  # the step this batch's update belonged to
        skipped = False
        if self.reader is not None:
            scale, skipped = self.reader.read()
            self.observe(trainer, step, scale, skipped)
        if self._snap is not None:
            snap, self._snap = self._snap, None
            if not skipped and not getattr(pl_module, "skip_optimizer_step", False):
                self._stale(trainer, step, snap)

    def observe(self, trainer: Any, step: int, scale: float, skipped: bool) -> None:
        """Judge one optimizer step's (scale after the step, skipped?). Same inputs on every rank."""
        self.steps += 1
        self._scales.append(scale)
        self.skipped += skipped
        searching = skipped and not self._found  # the scaler's initial search: not a streak
        self.search_skipped += searching
        if not skipped and not self._found:
            self._found, self.search_scale = True, scale
            if self.search_skipped and trainer.global_rank == 0:
                log.info("mixed_precision: the loss scaler's initial search skipped %d step(s) and settled at %g "
                         "(step %d goes through)", self.search_skipped, scale, step)
        self.streak = self.streak + 1 if skipped and not searching else 0
        floor = self.reader.min_scale() if self.reader is not None else None
        floor = self.min_scale if floor is None else floor
        details = {"scale": scale, "streak": self.streak, "skipped_steps": self.skipped, "steps": self.steps,
                   **(self.reader.settings() if self.reader is not None else {})}
        if self.due(step):
            self._log(trainer, {"precision/loss_scale": scale, "precision/skipped_steps": self.skipped}, step)
        if skipped and scale <= floor and not self._at_floor_reported:
            self._at_floor_reported = True
            self._report(trainer, "error", "loss_scale_min",
                         f"step {step} overflowed and the loss scale is at its floor {scale:g} (min {floor:g}): "
                         f"it cannot back off further, training has effectively stopped ({self.skipped} of "
                         f"{self.steps} steps skipped; DeepSpeed raises at the next overflow)",
                         "the gradients are non-finite at any scale: find the NaN/Inf source (grad_monitor, "
                         "nan_triage), lower the LR; " + ADVICE, details, step=step)
        if self.streak in (self.streak_warn, self.streak_error):
            severity = "error" if self.streak == self.streak_error else "warning"
            self._report(trainer, severity, "overflow_streak",
                         f"{self.streak} consecutive optimizer steps skipped for overflow (steps "
                         f"{step - self.streak + 1}..{step}); loss scale now {scale:g} (was "
                         f"{self._scales[-self.streak - 1] if len(self._scales) > self.streak else self.reader.initial:g})"
                         + ("" if severity == "warning" else ": the gradients are non-finite whatever the scale"),
                         "a streak is a real NaN/Inf, not a too-high scale: look at the first skipped step's "
                         "batch and layers (grad_monitor, nan_triage); " + ADVICE, details, step=step)
        if step >= self.warmup_steps:
            self._recent.append(bool(skipped))
            if len(self._recent) == self.window and sum(self._recent) / self.window > self.max_skip_fraction:
                frac = sum(self._recent) / self.window
                self._recent.clear()  # judge the next full window afresh
                self._report(trainer, "warning", "frequent_overflow",
                             f"{frac:.0%} of the last {self.window} steps (to step {step}) were skipped for "
                             f"overflow > max_skip_fraction={self.max_skip_fraction:g}; loss scale {scale:g}",
                             "each skipped step is lost data; " + ADVICE, {**details, "fraction": frac}, step=step)

    def _stale(self, trainer: Any, step: int, snap: list[torch.Tensor]) -> None:
        stale = active = 0
        per: list[tuple[float, str]] = []
        for (name, p), before in zip(self._bf16, snap):
            g = p.grad
            mask = (g != 0) if g is not None else torch.ones_like(p, dtype=torch.bool)
            n_active = int(mask.sum())
            if not n_active:
                continue
            n_stale = int(((p.detach() == before) & mask).sum())
            stale, active = stale + n_stale, active + n_active
            per.append((n_stale / n_active, name))
        frac = stale / active if active else 0.0
        self._log(trainer, {"precision/bf16_stale_fraction": frac}, step)
        if frac > self.worst_stale[0]:
            self.worst_stale = (frac, step)
        if frac > self.max_stale_fraction and not self._stale_reported:
            self._stale_reported = True  # once: the summary carries the worst fraction and its step
            per.sort(reverse=True)
            lr = trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else float("nan")
            self._report(trainer, "warning", "bf16_update_underflow",
                         f"{frac:.1%} of the bf16 weight elements with a gradient did not change at step {step} "
                         f"(lr {lr:.3g}): their update was below half a bf16 ulp (~2^-9 relative); worst: "
                         + ", ".join(f"{n} {f:.0%}" for f, n in per[:3]),
                         "the weights are bf16 without fp32 master copies: use trainer.precision=bf16-mixed "
                         "(fp32 weights) or DeepSpeed bf16 (fp32 masters), or a larger LR; updates smaller than "
                         "~2^-8 of the weight are lost", {"fraction": frac, "lr": lr,
                                                         "worst": {n: f for f, n in per[:10]}}, rank=0, step=step)

    # ---- helpers -----------------------------------------------------------------------
    def _log(self, trainer: Any, metrics: dict, step: int | None = None) -> None:
        if metrics and trainer.global_rank == 0:
            for lg in trainer.loggers:
                lg.log_metrics(metrics, step=trainer.global_step if step is None else step)

    def _report(self, trainer: Any, severity: str, code: str, message: str, advice: str, details: dict,
                rank: int | None = None, step: int | None = None) -> None:
        """Called on every rank with the same decision (rank=0 findings: rank 0 only): rank 0 writes."""
        step = trainer.global_step if step is None else step
        if trainer.global_rank == 0:
            self.report(trainer, severity, code, message, advice, details, rank=rank, step=step)
        elif severity == "error":
            self._apply_policy(trainer, Finding(self.name, severity, code, message, advice, step=step, rank=rank))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.global_rank != 0:
            return
        scales = f", scale {min(self._scales):g}..{max(self._scales):g}" if self._scales else ""
        if self.search_skipped:
            after = f"{self.search_scale:g}" if self.search_scale is not None else "none found yet"
            scales += (f"; the initial scale search skipped {self.search_skipped} of them "
                       f"({self.reader.initial if self.reader else float('nan'):g} -> {after})")
        stale = f", worst bf16 stale fraction {self.worst_stale[0]:.3g} at step {self.worst_stale[1]}" \
            if self._bf16 else ""
        self.report(trainer, "info", "precision_summary",
                    f"precision {trainer.precision}, "
                    + (f"loss scaler {self.reader.kind}: {self.skipped} of {self.steps} steps skipped{scales}"
                       if self.reader else "no loss scaler (nothing to track)") + stale,
                    details={"precision": str(trainer.precision), "scaler": self.reader.kind if self.reader else None,
                             "skipped_steps": self.skipped, "steps": self.steps,
                             "min_scale_seen": min(self._scales) if self._scales else None,
                             "initial_scale": self.reader.initial if self.reader else None,
                             "search_skipped": self.search_skipped, "search_scale": self.search_scale,
                             "bf16_weights": len(self._bf16), "worst_stale_fraction": self.worst_stale[0]},
                    rank=None)
