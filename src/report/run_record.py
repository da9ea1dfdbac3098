"""What a plain Lightning run (no ``dsdebug-train``) records for its report, beside ``findings.jsonl``.

``dsdebug-train`` writes ``metrics.json`` (how the run ended), ``history.jsonl`` (every scalar) and
the resolved config. A plain project with the checks in its ``Trainer`` has none of these, so its
report said "status unknown", "not recorded: enable debug=grads" for a GradMonitor that ran, and
``python train.py`` for a command nobody typed. ``record_run`` (called once per fit by the first
check's ``setup``, rank 0, only when the findings channel configured itself: never under
``dsdebug-train``) adds:

- ``RunRecord`` (a Callback appended to ``trainer.callbacks``): ``metrics.json`` with ``runner:
  "lightning"``, the command (``sys.argv`` of rank 0), strategy, world size, precision, steps, time,
  the Trainer's ``default_root_dir`` (where the checks' artifacts go) and ``status``: ``running`` at
  fit start, then ``completed`` / ``stopped_by_check`` / ``interrupted`` (Ctrl-C) / ``crashed`` (with
  the error line). At the end of the fit it also sends the other ranks' findings to the dashboards.
- a ``HistoryLogger`` appended to ``trainer.loggers`` when the Trainer has a logger (so
  ``trainer.logger`` and ``trainer.log_dir`` stay the user's): the scalars the checks and
  ``self.log`` send to the loggers also land in ``history.jsonl``. With ``logger=False`` nothing is
  added (the checks' metrics go nowhere then, and the report says so).

Rank awareness: rank 0 only (Lightning calls loggers on rank 0; ``RunRecord`` writes on rank 0); no
collective.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback

from dsdebug.findings import get_channel
from dsdebug.report.history import HistoryLogger

__all__ = ["METRICS_FILE", "RUNNER", "RunRecord", "command_line", "record_run"]

METRICS_FILE = "metrics.json"
RUNNER = "lightning"  # metrics.json's ``runner`` for a plain Lightning run


def command_line() -> str:
    """What was run, as a shell would take it: ``python <argv>`` (rank 0's ``sys.argv``)."""
    argv = list(sys.argv)
    if argv and argv[0].endswith("__main__.py"):  # python -m pkg
        argv[0] = "-m " + Path(argv[0]).parent.name
    return "python " + " ".join(a if a.startswith("-m ") else shlex.quote(a) for a in argv)


class RunRecord(Callback):
    """Rank 0's ``metrics.json`` for a plain Lightning run (see the module docstring)."""

    def __init__(self, run_dir: str | Path, dashboards: Any = None) -> None:
        self.run_dir = Path(run_dir)
        self.dashboards = dashboards
        self.started = time.time()
        self.record: dict[str, Any] = {}

    def _write(self, **fields: Any) -> None:
        self.record.update(fields)
        self.record["time_s"] = round(time.time() - self.started, 2)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / METRICS_FILE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.record, indent=2, default=str))
        os.replace(tmp, path)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.global_rank != 0:
            return
        self.started = time.time()
        self._write(runner=RUNNER, status="running", command=command_line(), cwd=os.getcwd(),
                    strategy=type(trainer.strategy).__name__, world_size=trainer.world_size,
                    precision=str(trainer.precision), model=type(pl_module).__name__,
                    root_dir=str(Path(trainer.default_root_dir).resolve()), global_step=trainer.global_step,
                    loggers=[type(lg).__name__ for lg in trainer.loggers if type(lg).__name__ != "HistoryLogger"],
                    max_steps=trainer.max_steps)

    def _scalars(self, trainer: Any) -> dict[str, float]:
        out = {}
        for key, value in trainer.callback_metrics.items():
            try:
                out[key] = float(value)
            except (TypeError, ValueError, RuntimeError):
                continue
        return {k: v for k, v in out.items() if v == v and abs(v) != float("inf")}

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.global_rank != 0:
            return
        stop = get_channel().stop_request
        self._write(status="interrupted" if trainer.interrupted else "stopped_by_check" if stop is not None
                    else "completed", global_step=trainer.global_step, **self._scalars(trainer))
        self._finish_dashboards()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if trainer.global_rank != 0:
            return
        status = "interrupted" if isinstance(exception, KeyboardInterrupt) else "crashed"
        self._write(status=status, global_step=trainer.global_step,
                    error=f"{type(exception).__name__}: {exception}".splitlines()[0][:500])
        self._finish_dashboards()

    def _finish_dashboards(self) -> None:
        if self.dashboards is not None:  # the other ranks' findings, from findings.jsonl; W&B's table
            self.dashboards.finish(get_channel().read_all())
            self.dashboards = None


def record_run(trainer: Any, run_dir: str | Path, dashboards: Any = None) -> RunRecord | None:
    """Rank 0, once per fit of a plain project: ``RunRecord`` and (when the Trainer logs) ``HistoryLogger``."""
    if any(isinstance(cb, RunRecord) for cb in trainer.callbacks):
        return None
    record = RunRecord(run_dir, dashboards)
    trainer.callbacks.append(record)  # Lightning reads trainer.callbacks at every hook: it gets the next ones
    if trainer.loggers and not any(isinstance(lg, HistoryLogger) for lg in trainer.loggers):
        trainer.loggers = [*trainer.loggers, HistoryLogger(run_dir)]  # appended: trainer.logger stays the user's
    return record
