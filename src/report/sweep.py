"""`sweep_index(sweep_dir)`: one page for a multirun (``logs/train/multiruns/<time>/``).

Each job subdir (``0/``, ``1/``, ...) is a run dir. What a job was run with and how it ended
come from ``sweep_summary.json`` / ``<job>/job_status.json`` (src/distributed/sweep.py) when the
sweep got that far, else from the job's own ``.hydra/overrides.yaml`` and metrics.json /
crash.json. Writes ``sweep_index.html`` / ``.md`` in the sweep dir, each job linked to its
``report.html`` where one exists.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from dsdebug.report import plots
from dsdebug.report.doc import Document
from dsdebug.report.load import load_run, read_overrides
from dsdebug.report.render import all_findings, last_value

__all__ = ["build", "is_sweep_dir", "job_dirs", "job_row", "sweep_index"]

_RUN_FILES = ("config_resolved.yaml", "metrics.json", "history.jsonl", "findings.jsonl", "crash.json", ".hydra")


def job_dirs(sweep_dir: str | Path) -> list[Path]:
    """Numbered subdirs that look like run dirs, in job order."""
    found = [p for p in Path(sweep_dir).iterdir() if p.is_dir() and p.name.isdigit()
             and any((p / f).exists() for f in _RUN_FILES + ("job_status.json",))]
    return sorted(found, key=lambda p: int(p.name))


def is_sweep_dir(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and ((path / "sweep_summary.json").is_file() or bool(job_dirs(path)))


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _summary_rows(sweep_dir: Path) -> dict[str, dict[str, Any]]:
    rows = _json(sweep_dir / "sweep_summary.json")
    if not isinstance(rows, list):
        return {}
    return {str(r.get("job")): r for r in rows if isinstance(r, dict)}


def job_row(job_dir: Path, summary: dict[str, Any] | None) -> dict[str, Any]:
    status_file = summary or _json(job_dir / "job_status.json") or {}
    run = load_run(job_dir)
    overrides = status_file.get("overrides") or read_overrides(job_dir) or []
    status = status_file.get("status") or run.status
    if run.crash is not None and run.crash.get("error"):
        status = f"{status}: {run.crash['error']}"
    throughput = next((f"{v:.1f} tokens/s" for k, v in run.metrics.items()
                       if "tokens" in k and isinstance(v, (int, float))), None)
    if throughput is None and isinstance(run.metrics.get("time_s"), (int, float)):
        throughput = f"{run.metrics['time_s']:.1f} s"
    found = all_findings(run)
    return {"job": job_dir.name, "overrides": [str(o) for o in overrides], "status": status,
            "train_loss": last_value(run, "train/loss"), "val_loss": last_value(run, "val/loss"),
            "speed": throughput, "findings": len(found),
            "errors": sum(1 for f in found if f.get("severity") == "error"),
            "report": (job_dir / "report.html").is_file()}


def build(sweep_dir: Path) -> tuple[Document, list[dict[str, Any]]]:
    summary = _summary_rows(sweep_dir)
    rows = [job_row(d, summary.get(d.name)) for d in job_dirs(sweep_dir)]
    doc = Document(f"Sweep: {sweep_dir.name}")
    doc.para(f"{sweep_dir} — {len(rows)} job(s), "
             f"{sum(1 for r in rows if str(r['status']).startswith('completed'))} completed")
    common = set.intersection(*(set(r["overrides"]) for r in rows)) if len(rows) > 1 else set()
    if common:
        doc.para("common overrides: " + " ".join(sorted(common)))
    doc.heading("Jobs")

    def loss(value: float | None) -> str:
        return f"{value:.4f}" if isinstance(value, float) and math.isfinite(value) else "-"

    table = [[r["job"], " ".join(o for o in r["overrides"] if o not in common) or "(none)", r["status"],
              loss(r["train_loss"]), loss(r["val_loss"]), r["speed"] or "-",
              f"{r['findings']} ({r['errors']} error)" if r["errors"] else str(r["findings"]),
              f"{r['job']}/report.html" if r["report"] else "-"] for r in rows]
    classes = ["" if str(r["status"]).startswith("completed") else "mismatch" for r in rows]
    doc.table(["job", "overrides", "status", "final train/loss", "final val/loss", "speed", "findings", "report"],
              table, classes)
    doc.heading("Final loss per job")
    labels = [f"{r['job']}: " + " ".join(o for o in r["overrides"] if o not in common)[:40] for r in rows]
    key = "val_loss" if any(r["val_loss"] is not None for r in rows) else "train_loss"
    png = plots.bars(labels, [r[key] if r[key] is not None else math.nan for r in rows],
                     f"final {key.replace('_', '/')} per job", key.replace("_", "/"))
    if png is None:
        doc.note("no job recorded a final loss")
    else:
        doc.image("final_loss", "final loss per job", png)
    return doc, rows


def sweep_index(sweep_dir: str | Path) -> tuple[Path, Path]:
    """Write ``sweep_index.html`` and ``sweep_index.md`` into the sweep dir; returns their paths."""
    sweep_dir = Path(sweep_dir)
    doc, _ = build(sweep_dir)
    return doc.write(sweep_dir, "sweep_index")
