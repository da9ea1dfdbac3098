"""Findings: what every check reports, in one place, readable by people and programs.

A finding is (a) a log line (logger ``findings.<check>``, level = severity, so it lands in
the console and the per-rank log file) and (b) one JSON object appended to
``<run_dir>/findings.jsonl``. Every rank appends to the same file: each record is written
with a single ``write`` on an ``O_APPEND`` descriptor, so lines from different ranks never
interleave. Fields: ``time, step, rank (null = all ranks), check, severity, code, message,
advice, details``. ``message`` names the culprit (parameter, layer, rank, batch, step);
``advice`` says what to do. Secrets never reach the file (details are redacted).

Who configures it: the framework (``configure_channel(run_dir)``, every rank, before the
Trainer is built) -- that always wins. In a plain Lightning project nobody does, so the first
check's ``setup`` calls ``auto_configure`` (see ``DebugCallback``): findings go to
``<trainer.log_dir>/findings.jsonl`` and, when no logging handler is set up at all, one
console handler for the ``findings`` logger makes info findings visible (each line once).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dsdebug.findings.secrets import redact

__all__ = ["FINDINGS_FILE", "Finding", "FindingsChannel", "SEVERITIES", "auto_configure", "configure_channel",
           "console_handler", "get_channel", "needs_auto"]

SEVERITIES = ("info", "warning", "error")
_LEVELS = {"info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
FINDINGS_FILE = "findings.jsonl"


@dataclass
class Finding:
    check: str
    severity: str
    code: str
    message: str
    advice: str = ""
    step: int | None = None
    rank: int | None = None
    details: dict[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")
        if not self.code or not self.check:
            raise ValueError("a finding needs a check name and a code")

    def line(self) -> str:
        where = f"step {self.step}" if self.step is not None else "setup"
        who = "all ranks" if self.rank is None else f"rank {self.rank}"
        text = f"[{self.check}/{self.code}] {where}, {who}: {self.message}"
        return f"{text} -> {self.advice}" if self.advice else text

    def to_json(self) -> str:
        record = asdict(self)
        record["details"] = redact(_jsonable(record["details"]))
        return json.dumps(record, allow_nan=False, default=str)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)  # "nan", "inf": JSON has no literal for them
    if hasattr(obj, "item") and getattr(obj, "numel", lambda: 2)() == 1:
        return _jsonable(obj.item())
    return obj


class FindingsChannel:
    """Process-wide sink; `configure_channel` points it at the run dir."""

    def __init__(self, run_dir: str | Path | None = None, origin: str = "explicit") -> None:
        self.path = Path(run_dir) / FINDINGS_FILE if run_dir is not None else None
        # "default": nobody configured it; "explicit": configure_channel; "auto": a check's setup
        self.origin = origin
        self.owner: int | None = None  # id() of the Trainer an "auto" channel was made for
        self.local: list[Finding] = []  # what this process reported
        self.stop_request: Finding | None = None  # set by a check whose policy is "stop"
        self.sinks: list[Any] = []  # callables given each finding (rank 0's dashboards: sinks.py)

    def report(self, finding: Finding) -> Finding:
        logging.getLogger(f"findings.{finding.check}").log(_LEVELS[finding.severity], finding.line())
        self.local.append(finding)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            data = (finding.to_json() + "\n").encode()
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        for sink in self.sinks:
            sink(finding)
        return finding

    def read_all(self) -> list[dict[str, Any]]:
        """Every rank's findings, from the file (falls back to this process's)."""
        if self.path is None or not self.path.is_file():
            return [json.loads(f.to_json()) for f in self.local]
        out = []
        for line in self.path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a rank killed mid-write leaves at most one broken last line
        return out

    def summary_lines(self, report: str | Path | None = None, status: str | None = None) -> list[str]:
        """The end of a run on the console: the incidents (warnings and errors grouped by cause, the
        root cause first, the other findings as its evidence: ``incidents.py``), then ONE verdict line
        with the report path last. Info findings are not listed: they live in the report."""
        from dsdebug.findings.incidents import group, verdict

        records = self.read_all()
        incidents = group(records)
        lines = [f"incidents ({len(incidents)}), root cause first; every finding: findings.jsonl and the report"
                 ] if incidents else []
        for incident in incidents:
            lines.append(f"{incident.severity.upper():8}{incident.title()}  [{incident.source()}]")
            lines.append(f"        {incident.root.get('message', '')}")
            if incident.root.get("advice"):
                lines.append(f"        -> {incident.root['advice']}")
            if incident.evidence:
                lines.append(f"        also seen as: {incident.evidence_text()}")
        lines.append(verdict(records, str(report) if report else None, status))
        return lines

    def print_summary(self, report: str | Path | None = None, status: str | None = None) -> None:
        from rich.console import Console
        from rich.text import Text

        # stdout, after the run summary table: the verdict is the console's last line; no 80-column wrap
        console = Console(soft_wrap=True, highlight=False)
        for line in self.summary_lines(report, status):
            style = "bold red" if line.startswith("ERROR") else "yellow" if line.startswith("WARNING") else None
            console.print(Text(line, style=style))


_channel = FindingsChannel(origin="default")


def get_channel() -> FindingsChannel:
    return _channel


def configure_channel(run_dir: str | Path | None) -> FindingsChannel:
    """Point the channel at ``<run_dir>/findings.jsonl`` (None: log only). Wins over auto_configure."""
    global _channel
    _channel = FindingsChannel(run_dir)
    return _channel


def needs_auto(owner: object) -> bool:
    """True when nobody configured the channel for this owner (a Trainer): local, no collective."""
    return _channel.origin == "default" or (_channel.origin == "auto" and _channel.owner != id(owner))


def auto_configure(run_dir: str | Path, owner: object) -> FindingsChannel:
    """The channel of a run nobody configured (a plain Lightning project): every rank appends to
    ``<run_dir>/findings.jsonl``. An explicit configure_channel keeps winning; a new owner (a
    second ``fit`` in the same process) gets its own file."""
    global _channel
    if needs_auto(owner):
        _channel = FindingsChannel(run_dir, origin="auto")
        _channel.owner = id(owner)
        _channel.path.parent.mkdir(parents=True, exist_ok=True)
        console_handler()
    return _channel


class _ConsoleHandler(logging.StreamHandler):
    """Marks the handler we added, so it is added once."""


def console_handler() -> logging.Handler | None:
    """Info findings reach the console: a handler on the ``findings`` logger only when neither it
    nor the root logger has a stream handler (the user's logging setup wins; no line is printed
    twice). Non-stream handlers (LogSync's line buffer on the root logger) do not count."""
    logger = logging.getLogger("findings")
    if any(isinstance(h, logging.StreamHandler) for h in logger.handlers + logging.getLogger().handlers):
        return None
    handler = _ConsoleHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    return handler
