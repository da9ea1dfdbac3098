"""log_sync's files: the per-rank timeline (``timeline.jsonl``, one append per write so ranks
appending after a crash don't interleave) and its merged, human-readable form (``logs_merged.log``)."""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path

__all__ = ["TIMELINE", "MERGED", "STATS", "append_records", "write_merged"]

TIMELINE, MERGED = "timeline.jsonl", "logs_merged.log"
STATS = ("step_time", "compute_time", "comm_time", "loss", "mem_mb")


def append_records(run_dir: Path, records: list[dict]) -> None:
    if not records:
        return
    data = "".join(json.dumps(rec, default=str) + "\n" for rec in records).encode()
    run_dir.mkdir(parents=True, exist_ok=True)  # a plain Trainer (logger=False) may not have made it
    fd = os.open(run_dir / TIMELINE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)  # one write: ranks appending after a crash don't interleave lines
    finally:
        os.close(fd)

def write_merged(run_dir: Path) -> None:
    path = run_dir / TIMELINE
    if not path.is_file():
        return
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    out = []
    for rec in sorted(records, key=lambda r: r.get("time", 0)):
        stamp = datetime.fromtimestamp(rec.get("time", 0)).isoformat(sep=" ", timespec="milliseconds")
        if rec.get("kind") == "metrics":
            stats = " ".join(f"{k}={rec[k]:.4g}" for k in STATS if isinstance(rec.get(k), (int, float)))
            out.append(f"{stamp} [rank {rec['rank']}] METRICS step={rec.get('step')} {stats}")
        else:
            message = str(rec.get("message", "")).replace("\n", "\n    ")  # continuation lines indented
            host = f" [{rec['host']}]" if rec.get("host") else ""
            out.append(f"{stamp} [rank {rec['rank']}]{host} {rec['level']} {rec['logger']}: {message}")
    (run_dir / MERGED).write_text("\n".join(out) + "\n")
