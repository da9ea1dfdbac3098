"""Everything a run directory holds that a report reads, in one object."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from src.report.history import read_history

CRASH_FILE = "crash.json"


@dataclass
class RunData:
    path: Path
    config: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)  # metrics.json (absent after a crash)
    findings: list[dict[str, Any]] = field(default_factory=list)
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    crash: dict[str, Any] | None = None  # crash.json: exit code, error line, exception

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


def load_run(run_dir: str | Path) -> RunData:
    run_dir = Path(run_dir)
    config: dict[str, Any] = {}
    cfg_path = run_dir / "config_resolved.yaml"
    if cfg_path.is_file():
        from omegaconf import OmegaConf

        config = OmegaConf.to_container(OmegaConf.load(cfg_path), resolve=False) or {}
    findings = []
    fpath = run_dir / "findings.jsonl"
    if fpath.is_file():
        for line in fpath.read_text().splitlines():
            try:
                findings.append(json.loads(line))
            except ValueError:
                continue
    return RunData(
        path=run_dir, config=config, metrics=_json(run_dir / "metrics.json") or {}, findings=findings,
        history=read_history(run_dir), crash=_json(run_dir / CRASH_FILE),
    )
