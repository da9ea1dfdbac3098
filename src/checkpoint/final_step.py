"""`FinalStep`: the last optimizer step of a run is always logged and validated.

Lightning sends train metrics to the loggers only every ``log_every_n_steps`` and validates only
every ``val_check_interval`` batches, so a run whose ``max_steps`` is not a multiple of them ends
without its last step: a 5-step run at ``log_every_n_steps=10`` logs no train row at all, and
``val/loss`` stays the step-0 sanity value when no interval was reached. Both of Lightning's
decisions also honour ``trainer.should_stop`` (``_LoggerConnector.should_update_logs`` and
``_TrainingEpochLoop._should_check_val_fx``, the path early stopping takes). This callback sets
it at the start of the micro-batch that completes the last optimizer step, so Lightning logs
that step and runs its validation loop right after it, in the usual place (checkpoints,
``val/loss`` in ``callback_metrics`` and so in metrics.json, the report). A last step that is a
validation step anyway validates once.

Rank awareness: runs on every rank and the condition is the step counter (the same on every
rank), so every rank enters the validation loop and its collectives match.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback

__all__ = ["FinalStep"]


class FinalStep(Callback):
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        loop = trainer.fit_loop.epoch_loop
        if loop._should_accumulate():  # a micro-batch inside an accumulation window: no step yet
            return
        last_step = trainer.max_steps is not None and 0 < trainer.max_steps <= trainer.global_step + 1
        max_epochs = trainer.max_epochs
        last_epoch = max_epochs is not None and 0 < max_epochs <= trainer.current_epoch + 1
        if last_step or (last_epoch and loop._num_ready_batches_reached()):
            trainer.should_stop = True
