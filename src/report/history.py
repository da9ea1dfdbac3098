"""`HistoryLogger`: every scalar any logger receives, also in ``<run_dir>/history.jsonl``.

The report must not depend on which logger a user picked (TensorBoard, CSV, W&B or none), so the
trainer always gets this Lightning logger as well. It sees what Lightning's logger connector
sends (``self.log`` values, the LR monitor) and what the debug callbacks send with
``logger.log_metrics`` (gradient norms, per-rank stats, comm share). Lightning calls loggers on
rank 0 only. One JSON line per call: ``{"step": 12, "time": 1763800000.12, "train/loss": 5.31, ...}``
(``time``: wall clock, seconds since the epoch, when the row was logged; benchmarks read step
rates from it without adding instrumentation to the run).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities.rank_zero import rank_zero_only

# read_history lives in load.py so that reading a run (python -m dsdebug.report) never imports lightning/torch
from dsdebug.report.load import HISTORY_FILE  # noqa: E402

__all__ = ["HistoryLogger"]


class HistoryLogger(Logger):
    def __init__(self, run_dir: str | Path) -> None:
        super().__init__()
        self.path = Path(run_dir) / HISTORY_FILE

    @property
    def name(self) -> str:
        return "history"

    @property
    def version(self) -> str:
        return "0"

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass  # config_resolved.yaml has them

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        row: dict[str, Any] = {"step": step, "time": round(time.time(), 4)}
        for key, value in metrics.items():
            value = value.item() if hasattr(value, "item") else value
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                row[key] = float(value) if math.isfinite(value) else str(value)
        if len(row) == 2:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(row) + "\n").encode())
        finally:
            os.close(fd)
