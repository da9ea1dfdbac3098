"""A run preempted before its first step (distributed/startup_signals.py): the same ending as a
preemption mid-training, minus the checkpoint. Rank 0 (the only process so far) leaves

- a ``preempted`` finding naming the signal and the stage it arrived in,
- ``metrics.json`` with ``status: preempted`` (what a requeue script waits for), a previous
  attempt's files moved to ``attempts/<n>/`` first, as a resumed run does,
- the report, and one console line; the process exits 0.

The same command again starts the run (``resume=auto`` in the same run dir takes the newest
checkpoint if an earlier attempt left one).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from dsdebug.errors import PreemptedAtStartup

__all__ = ["end_preempted_at_startup"]

log = logging.getLogger(__name__)


def end_preempted_at_startup(cfg: Any, exc: PreemptedAtStartup, started: float) -> dict[str, Any]:
    from hydra.core.hydra_config import HydraConfig

    from dsdebug.checkpoint.resume import _archive_previous_attempt
    from dsdebug.findings import Finding, configure_channel, get_channel

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    _archive_previous_attempt(run_dir)
    if get_channel().path != run_dir / "findings.jsonl":
        configure_channel(run_dir)
    get_channel().report(Finding(
        check="preemption", severity="warning", code="preempted",
        message=f"{exc.signal_name} received {exc.stage}; stopped before the first step, nothing to save",
        advice="run the same command again (resume=auto in this run dir continues from its newest checkpoint, "
               "if an earlier attempt left one)",
        step=None, details={"signal": exc.signal_name, "stage": exc.stage, "checkpoint": None},
    ))
    metrics = {"status": "preempted", "global_step": None, "signal": exc.signal_name, "stage": exc.stage,
               "time_s": round(time.time() - started, 2), "final_checkpoint": None}
    (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    from dsdebug.report.finish import finish_run

    finish_run(run_dir)
    print(f"preempted: {exc.signal_name} received {exc.stage}; nothing to save. The same command starts it "
          f"again (run dir: {run_dir})", flush=True)
    return metrics
