"""Hydra multirun with distributed jobs: every job in its own process tree.

Under ``-m`` the Hydra process does not train. For each job it starts
``python train.py <this job's overrides> hydra.run.dir=<job dir>`` and waits: the job's
ranks are that child and the ranks it launches, so no process group, DeepSpeed state or
port survives into the next job, a crashing job cannot take the sweep down, and no rank
ever creates an output dir of its own. The job's metric comes back through
``metrics.json`` (what Optuna optimizes). `SweepSummary` prints one table at the end and
makes the sweep exit non-zero if any job failed.

Under Hydra's submitit launchers the same function runs inside each submitit job process (every
SLURM task of the job); src/distributed/submitit_job.py says what runs where and how preemption,
submitit's requeue and the training's checkpoint take turns.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

__all__ = ["JOB_STATUS", "METRICS", "SweepSummary", "run_job_in_subprocess",
           "wandb_sweep_identity"]

log = logging.getLogger(__name__)

JOB_STATUS = "job_status.json"
METRICS = "metrics.json"


def run_job_in_subprocess(cfg: DictConfig, script: str | None = None) -> float:
    """Called in the Hydra multirun process (or a submitit job) for one job; returns the
    optimized metric. ``script``: the entry point (a submitit job's argv is submitit's)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_original_cwd

    from dsdebug.distributed import submitit_job

    hc = HydraConfig.get()
    job_dir = Path(hc.runtime.output_dir)
    script = str(Path(get_original_cwd(), script or sys.argv[0]).resolve())
    command = [sys.executable, script, *hc.overrides.task, f'hydra.run.dir="{job_dir}"', "hydra.mode=RUN"]
    job = submitit_job.current_job()
    rank = job.global_rank if job is not None else 0
    if job is not None:
        command += submitit_job.child_overrides(cfg, rank)
    if rank == 0:
        log.info("job %s: %s", hc.job.num, " ".join(hc.overrides.task))
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    # W&B groups the jobs of one sweep (wandb_sweep_identity below; config/prepare.py sweep_logger_arguments); Optuna writes no multirun.yaml
    env["DSDEBUG_SWEEP_DIR"] = str(job_dir.parent)
    env["DSDEBUG_JOB_NUM"] = str(hc.job.num)
    if job is None:
        returncode = subprocess.run(command, cwd=get_original_cwd(), env=env).returncode
    else:
        signals = submitit_job.JobSignals()
        with signals:
            signals.proc = subprocess.Popen(command, cwd=get_original_cwd(), env=env)
            returncode = signals.proc.wait()
    if rank != 0:
        return float("nan")  # the job's first task reports for all its ranks
    metrics = _read_json(job_dir / METRICS)
    metric_name = cfg.get("optimized_metric")
    value = metrics.get(metric_name) if metric_name else None
    status = {
        "job": hc.job.num,
        "overrides": list(hc.overrides.task),
        "returncode": returncode,
        "status": "completed" if returncode == 0 else "failed",
        "metric": metric_name,
        "value": value,
        "dir": str(job_dir),
    }
    if job is not None:
        status["job_id"] = str(job.job_id)
        if returncode == 0 and metrics.get("status") == "preempted":
            status["status"] = "preempted"  # stays so only if submitit does not requeue the job
            (job_dir / JOB_STATUS).write_text(json.dumps(status, indent=2))
            reason = signals.requeue()  # requeued: this process ends here
            status["requeue"] = f"not requeued: {reason or 'unknown'}"
            log.error("job %s preempted, %s", hc.job.num, status["requeue"])
    (job_dir / JOB_STATUS).write_text(json.dumps(status, indent=2))
    if status["status"] != "completed":
        if status["status"] == "failed":
            log.error("job %s failed with exit code %s; see %s", hc.job.num, returncode, job_dir)
        return float("nan")
    return float(value) if isinstance(value, (int, float)) else float("nan")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


class SweepSummary(Callback):
    """Hydra callback: one table for the sweep; exit code 1 if any job failed."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = [_read_json(p) for p in sorted(sweep_dir.glob(f"*/{JOB_STATUS}"), key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0)]
        if not rows:
            return
        (sweep_dir / "sweep_summary.json").write_text(json.dumps(rows, indent=2))
        from rich.console import Console
        from rich.table import Table

        common = set.intersection(*(set(r["overrides"]) for r in rows)) if len(rows) > 1 else set()
        table = Table(title=f"sweep {sweep_dir}", caption="common: " + " ".join(sorted(common)))
        for col in ("job", "overrides", "status", rows[0].get("metric") or "metric"):
            table.add_column(col)
        for r in rows:
            v = r.get("value")
            varying = [o for o in r["overrides"] if o not in common]
            table.add_row(str(r["job"]), " ".join(varying), r["status"],
                          f"{v:.4f}" if isinstance(v, (int, float)) and math.isfinite(v) else "-")
        Console(stderr=True).print(table)
        failed = [r for r in rows if r["status"] != "completed"]
        if failed:
            log.error("%d of %d jobs failed: %s", len(failed), len(rows), ", ".join(str(r["job"]) for r in failed))
            sys.exit(1)


def wandb_sweep_identity(run_dir: str | Path, task_name: str = "train") -> dict[str, str] | None:
    """For a multirun job: W&B ``group`` = the sweep, ``name`` = sweep + job number, so each
    job is its own run, grouped by sweep. None outside a multirun. The sweep dir comes from
    ``DSDEBUG_SWEEP_DIR``/``DSDEBUG_JOB_NUM`` if set, else from Hydra's ``multirun.yaml``
    next to the job dir (the basic sweeper writes it)."""
    sweep_dir, job = os.environ.get("DSDEBUG_SWEEP_DIR"), os.environ.get("DSDEBUG_JOB_NUM")
    run_dir = Path(run_dir)
    if not sweep_dir and (run_dir.parent / "multirun.yaml").is_file():
        sweep_dir, job = str(run_dir.parent), run_dir.name
    if not sweep_dir:
        return None
    group = f"{task_name}-{Path(sweep_dir).name}"
    return {"group": group, "name": f"{group}-{job}"}
