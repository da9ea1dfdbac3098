"""`DeepSpeedWallClock`: DeepSpeed's ``wall_clock_breakdown`` timings, into the metrics and the report.

The config example and the table of metrics and findings: the class docstring (`DeepSpeedWallClock`).
"""

from __future__ import annotations

import statistics
from typing import Any

from dsdebug.callbacks.base import DebugCallback

__all__ = ["DeepSpeedWallClock"]

PHASES = ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step")


class DeepSpeedWallClock(DebugCallback):
    """`DeepSpeedWallClock`: DeepSpeed's ``wall_clock_breakdown`` timings, into the metrics and the report.

    ``"wall_clock_breakdown": true`` is DeepSpeed's own answer to "where does my step go": the
    engine times forward, backward (split into the local backward and the gradient all-reduce /
    reduce-scatter) and the optimizer step, and prints them. This callback reads the same numbers
    through the engine's public ``get_wall_clock_timers()`` at every optimizer step (rank 0), logs
    them, and ends the fit with one finding that says where the time went. ``train.py`` adds it
    whenever the DeepSpeed config turns the timers on (wall_clock_breakdown, or the flops
    profiler); it costs nothing otherwise because it is not there.

    Validation forwards also run through the engine's timers; they are reset after each validation
    so the next training step is not charged for them.

    | metric key (every optimizer step, rank 0) | meaning |
    |---|---|
    | ``deepspeed/fwd_ms`` | forward of all micro-batches of the step |
    | ``deepspeed/bwd_ms`` | backward, of which: |
    | ``deepspeed/bwd_inner_ms`` | local backward (autograd) |
    | ``deepspeed/bwd_allreduce_ms`` | gradient reduction (all-reduce / reduce-scatter) |
    | ``deepspeed/step_ms`` | optimizer step (with ZeRO's parameter all-gather) |

    | finding code | severity | when |
    |---|---|---|
    | ``ds_wall_clock`` | info | end of fit: mean ms per phase and the reduction's share of the step |

    Example (no ``callbacks.*`` entry: a DeepSpeed JSON with ``"wall_clock_breakdown": true`` adds it)::

        python train.py strategy=deepspeed_json strategy.config=tests/ds_configs/wall_clock_breakdown.json

    Resume: nothing is carried over (``state_attrs`` is empty): the timings are rank 0's, of this process.
    """
    name = "ds_wall_clock"
    state_attrs = ()  # rank 0's timers of this process

    def __init__(self) -> None:
        super().__init__(on_error="warn")
        self.steps: list[dict[str, float]] = []
        self._last_step = -1

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        if trainer.global_step == self._last_step or trainer.global_rank != 0:
            return  # mid-accumulation (no new optimizer step), or not rank 0: nothing to read
        self._last_step = trainer.global_step
        cache = trainer.strategy.deepspeed_engine.get_wall_clock_timers() or {}
        row = {phase: float(cache[phase]) for phase in PHASES if phase in cache}
        if not row:
            return
        self.steps.append(row)
        for logger in trainer.loggers:
            logger.log_metrics({f"deepspeed/{phase}_ms": ms for phase, ms in row.items()}, step=trainer.global_step)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        timers = trainer.strategy.deepspeed_engine.timers
        for name in ("fwd", "fwd_microstep"):  # validation forwards are not the next step's
            if name in getattr(timers, "timers", {}):
                timers(name).reset()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.global_rank != 0 or not self.steps:
            return
        steady = self.steps[1:] or self.steps  # the first step includes warm-up (allocation, JIT)
        mean = {phase: statistics.fmean(row.get(phase, 0.0) for row in steady) for phase in PHASES}
        total = mean["fwd"] + mean["bwd"] + mean["step"]
        share = mean["bwd_allreduce"] / total if total > 0 else 0.0
        self.report(
            trainer, "info", "ds_wall_clock",
            f"DeepSpeed wall_clock_breakdown, rank 0, mean of {len(steady)} optimizer step(s): forward "
            f"{mean['fwd']:.1f} ms, backward {mean['bwd']:.1f} ms (local {mean['bwd_inner']:.1f} ms + gradient "
            f"reduction {mean['bwd_allreduce']:.1f} ms), optimizer step {mean['step']:.1f} ms; the reduction is "
            f"{share:.0%} of the step",
            "a large reduction share points at communication (see debug=comm); a large step at optimizer offload "
            "or ZeRO-3's parameter gathering",
            {"mean_ms": mean, "steps": len(steady), "reduction_share": share}, rank=0)
