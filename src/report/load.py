"""Everything a run directory holds that a report reads, in one object."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CRASH_FILE", "FINDINGS_FILE", "HISTORY_FILE", "METRICS_FILE", "RunData", "findings_files", "load_run",
           "read_findings", "read_history", "read_overrides", "read_ranks", "read_repro", "read_top_ops"]

CRASH_FILE = "crash.json"
HISTORY_FILE = "history.jsonl"
FINDINGS_FILE = "findings.jsonl"
METRICS_FILE = "metrics.json"


@dataclass
class RunData:
    path: Path
    config: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)  # metrics.json (absent after a crash)
    findings: list[dict[str, Any]] = field(default_factory=list)
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    crash: dict[str, Any] | None = None  # crash.json: exit code, error line, exception
    # every findings.jsonl read (the run dir's own, then any in a folder below it: a plain Lightning
    # project's logger writes it under e.g. tensorboard/version_0/); empty: none was found
    findings_files: list[Path] = field(default_factory=list)
    # where metrics.json/history.jsonl were read: the run dir, else the folder of a findings file below it
    record_dir: Path | None = None

    @property
    def plain(self) -> bool:
        """A plain Lightning run (the checks in a user's own Trainer), not a ``dsdebug-train`` run."""
        if self.metrics.get("runner") is not None:
            return self.metrics["runner"] == "lightning"
        # older plain runs: findings but none of dsdebug-train's files (config, crash.json, Hydra's .hydra/)
        return (not self.config and self.crash is None and bool(self.findings_files)
                and not (Path(self.path) / ".hydra").is_dir())

    def artifact_dirs(self) -> list[Path]:
        """Where the checks' own files (repro/, profiler/, data_inspector/) may be: the run dir, the
        record dir, and a plain run's ``default_root_dir`` (metrics.json ``root_dir``)."""
        dirs = [Path(self.path), *([self.record_dir] if self.record_dir else [])]
        if isinstance(self.metrics.get("root_dir"), str):
            dirs.append(Path(self.metrics["root_dir"]))
        return list(dict.fromkeys(dirs))

    def series(self, key: str) -> tuple[list[int], list[float]]:
        points = self.history.get(key, [])
        return [s for s, _ in points], [v for _, v in points]

    def keys(self, prefix: str) -> list[str]:
        return sorted(k for k in self.history if k.startswith(prefix))

    @property
    def status(self) -> str:
        if self.crash is not None:
            return str(self.crash.get("status", "crashed"))
        return str(self.metrics.get("status", "unknown"))

    def cfg(self, dotted: str, default: Any = None) -> Any:
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_history(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """key -> [(step, value), ...] in logging order; non-finite values come back as nan/inf."""
    path = Path(run_dir) / HISTORY_FILE
    series: dict[str, list[tuple[int, float]]] = {}
    if not path.is_file():
        return series
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash
        if not isinstance(row, dict):
            continue
        step = row.pop("step", None)
        row.pop("time", None)  # when the row was logged (benchmarks read it), not a metric
        for key, value in row.items():
            try:
                series.setdefault(key, []).append((int(step) if step is not None else -1, float(value)))
            except (TypeError, ValueError):
                continue
    return series


def read_overrides(run_dir: str | Path) -> list[str] | None:
    """The command's overrides (``.hydra/overrides.yaml``); None when absent or unreadable."""
    path = Path(run_dir) / ".hydra" / "overrides.yaml"
    try:
        from omegaconf import OmegaConf

        value = OmegaConf.to_container(OmegaConf.load(path))
    except Exception:  # noqa: BLE001 - missing or cut file
        return None
    return [str(v) for v in value] if isinstance(value, list) else None


def read_repro(run_dir: str | Path) -> dict[int, dict[str, Any]]:
    """rank -> ``repro/rank<r>.json`` (per-rank seeds, env, flags, versions, RNG digests)."""
    out: dict[int, dict[str, Any]] = {}
    for path in sorted(Path(run_dir, "repro").glob("rank*.json")):
        record = _json(path)
        suffix = path.stem[len("rank"):]
        if isinstance(record, dict) and suffix.isdigit():
            out[int(suffix)] = record
    return out


def read_top_ops(run_dir: str | Path) -> dict[str, dict[str, Any]]:
    """file stem -> ``profiler/top_ops_*.json`` ({"sort_by": ..., "rows": [...]})."""
    out = {}
    for path in sorted(Path(run_dir, "profiler").glob("top_ops_*.json")):
        record = _json(path)
        if isinstance(record, dict) and isinstance(record.get("rows"), list):
            out[path.stem] = record
    return out


def read_ranks(run_dir: str | Path) -> tuple[dict[str, Any] | None, dict[int, dict[str, Any]]]:
    """(``ranks/world.json``: every rank of the job with host and run dir, or None;
    rank -> ``ranks/rank<r>.json``: the ranks whose files reached this run dir).
    Written by src/distributed/rank_files.py."""
    heard: dict[int, dict[str, Any]] = {}
    for path in sorted(Path(run_dir, "ranks").glob("rank*.json")):
        record = _json(path)
        suffix = path.stem[len("rank"):]
        if isinstance(record, dict) and suffix.isdigit():
            heard[int(suffix)] = record
    world = _json(Path(run_dir, "ranks", "world.json"))
    return (world if isinstance(world, dict) and isinstance(world.get("ranks"), list) else None), heard


def findings_files(run_dir: str | Path) -> list[Path]:
    """``<run_dir>/findings.jsonl`` first, then every ``findings.jsonl`` in a folder below it (a logger's
    subfolder: ``lightning_logs/version_0/``, ``tensorboard/version_0/``), in path order."""
    run_dir = Path(run_dir)
    top = run_dir / FINDINGS_FILE
    below = sorted(p for p in run_dir.rglob(FINDINGS_FILE) if p != top and p.is_file())
    return ([top] if top.is_file() else []) + below


def read_findings(paths: list[Path]) -> list[dict[str, Any]]:
    """Every record of every file; with several files each record names its file (``source``)."""
    findings = []
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                if len(paths) > 1:
                    record.setdefault("source", str(path.parent))
                findings.append(record)
    return findings


def load_run(run_dir: str | Path) -> RunData:
    run_dir = Path(run_dir)
    config: dict[str, Any] = {}
    cfg_path = run_dir / "config_resolved.yaml"
    if cfg_path.is_file():
        from omegaconf import OmegaConf

        try:
            loaded = OmegaConf.to_container(OmegaConf.load(cfg_path), resolve=False)
        except Exception:  # noqa: BLE001 - a file cut by a crash: report what else is there
            loaded = None
        config = loaded if isinstance(loaded, dict) else {}
    files = findings_files(run_dir)
    # metrics.json / history.jsonl: the run dir's (dsdebug-train), else beside the newest findings file below
    # it (a plain Lightning run writes them there: report/run_record.py)
    record_dir = run_dir
    if not any((run_dir / f).is_file() for f in (METRICS_FILE, HISTORY_FILE)) and files:
        record_dir = max(files, key=lambda p: p.stat().st_mtime).parent
    metrics, crash = _json(record_dir / METRICS_FILE), _json(run_dir / CRASH_FILE)
    return RunData(
        path=run_dir, config=config, metrics=metrics if isinstance(metrics, dict) else {},
        findings=read_findings(files), history=read_history(record_dir), crash=crash if isinstance(crash, dict) else None,
        findings_files=files, record_dir=record_dir,
    )
