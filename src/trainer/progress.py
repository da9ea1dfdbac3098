"""The progress bar, throttled: Lightning's `RichProgressBar` redrawn at most once per interval.

Lightning's bar reads every progress-bar metric and updates the rich task after every training
batch. On the default CPU run that cost a measurable share of the step time (progress bar, in
docs/benchmarks.md, "Costs the code refers to"); at GPU step times it would be more.
Here the per-batch update runs only when ``min_interval_s`` has passed since the last one (and
always for the last batch of an epoch), so a human still sees it move about once a second.
The bar's title is "Epoch <n>" on a step-limited run (Lightning's reads "Epoch 0/-2" there).
When stdout is not a terminal (a batch job writing to a log file, where every redraw is a
line of log) the interval is ``non_tty_interval_s``.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

from lightning.pytorch.callbacks import RichProgressBar

__all__ = ["ThrottledRichProgressBar"]


class ThrottledRichProgressBar(RichProgressBar):
    def __init__(self, min_interval_s: float = 1.0, non_tty_interval_s: float = 30.0, **kwargs: Any) -> None:
        from dsdebug.errors import ConfigError

        for key, value in (("min_interval_s", min_interval_s), ("non_tty_interval_s", non_tty_interval_s)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"callbacks.rich_progress_bar.{key}={value!r} is invalid; "
                                  f"valid: a number of seconds >= 0 (0 = every batch)")
        super().__init__(**kwargs)
        interactive = getattr(sys.stdout, "isatty", lambda: False)()
        self.min_interval_s = float(min_interval_s if interactive else non_tty_interval_s)
        self._last_update = -math.inf

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        now = time.monotonic()
        total = self.total_train_batches
        last = isinstance(total, (int, float)) and math.isfinite(total) and batch_idx + 1 >= total
        if now - self._last_update < self.min_interval_s and not last:
            return
        self._last_update = now
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def _get_train_description(self, current_epoch: int) -> str:
        """"Epoch 0", or "Epoch 0/9" with a real epoch limit: Lightning writes ``max_epochs - 1``,
        which for a step-limited run (``max_epochs=-1``) is "Epoch 0/-2"."""
        description = super()._get_train_description(current_epoch)
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs < 0:
            description = description.replace(f"/{max_epochs - 1}", "")
        return description
