"""Findings on the dashboards people already watch: TensorBoard text and W&B alerts + a table.

The channel (channel.py) writes every finding to the console, the rank log and
``findings.jsonl``; ``attach_dashboards`` adds the run's Lightning loggers as one more sink:

- ``TensorBoardLogger``: ``add_text("findings/<check>", "<markdown line>", step)``, one entry per
  finding (TensorBoard's TEXT tab, at the finding's step).
- ``WandbLogger``: every finding of severity ``error`` raises ``run.alert(title, text, level)``
  (W&B's email/Slack alerts; offline, the alert is kept in the run file and goes out on sync); at
  the end a ``findings`` table (``wandb.Table``: severity, check, code, step, rank, message,
  advice) holds every rank's findings.

Who attaches it: the first check's ``setup`` (``callbacks/base.py attach_channel``), on rank 0,
under ``dsdebug-train`` and in a plain Lightning project alike; ``dsdebug-train`` also calls it
before fit (the same sink is returned: nothing is attached twice).

Rank awareness: rank 0 only (``attach_dashboards`` is called there); no collective. Live,
rank 0 forwards its own findings; ``finish`` (after fit, from ``findings.jsonl``) adds the other
ranks' and the report's advisor findings, then the table. Text is redacted
(``secrets.redact_text``). A dashboard that fails never stops training: the sink logs it once
at debug level and goes on.

This module imports no logger class (findings is the ground floor): loggers are recognised by
their class name and used through ``logger.experiment``.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

from dsdebug.findings.channel import Finding, FindingsChannel
from dsdebug.findings.incidents import group, verdict
from dsdebug.findings.secrets import redact_text

__all__ = ["DashboardSink", "INCIDENT_COLUMNS", "TABLE_COLUMNS", "attach_dashboards", "markdown_line"]

log = logging.getLogger(__name__)

TABLE_COLUMNS = ["severity", "check", "code", "step", "rank", "message", "advice"]
INCIDENT_COLUMNS = ["severity", "incident", "root finding", "step", "findings", "message", "also seen as"]
_WANDB_LEVEL = {"error": "ERROR", "warning": "WARN", "info": "INFO"}


def _key(record: dict[str, Any]) -> tuple:
    return (record.get("time"), record.get("check"), record.get("code"), record.get("rank"), record.get("step"))


def markdown_line(record: dict[str, Any]) -> str:
    """One finding as a markdown line (TensorBoard text, W&B alert text)."""
    where = f"step {record['step']}" if record.get("step") is not None else "setup"
    who = "all ranks" if record.get("rank") is None else f"rank {record['rank']}"
    text = f"**{record['severity']}** `{record['check']}/{record['code']}` {where}, {who}: {record['message']}"
    if record.get("advice"):
        text += f" → {record['advice']}"
    return redact_text(text)


class DashboardSink:
    """Forwards findings to the TensorBoard and W&B loggers among ``loggers`` (rank 0)."""

    def __init__(self, loggers: Iterable[Any]) -> None:
        self.tensorboard = [lg for lg in loggers if type(lg).__name__ == "TensorBoardLogger"]
        self.wandb = [lg for lg in loggers if type(lg).__name__ == "WandbLogger"]
        self.sent: set[tuple] = set()
        self._failed: set[str] = set()

    @property
    def active(self) -> bool:
        return bool(self.tensorboard or self.wandb)

    def __call__(self, finding: Finding) -> None:
        import json

        self.send(json.loads(finding.to_json()))

    def send(self, record: dict[str, Any]) -> None:
        key = _key(record)
        if key in self.sent:
            return
        self.sent.add(key)
        line = markdown_line(record)
        step = record.get("step") or 0
        for logger in self.tensorboard:
            self._guard("tensorboard", lambda lg=logger: lg.experiment.add_text(f"findings/{record['check']}", line,
                                                                               global_step=step))
        if record.get("severity") == "error":
            title = redact_text(f"dsdebug {record['check']}/{record['code']}")[:64]
            for logger in self.wandb:
                self._guard("wandb", lambda lg=logger: lg.experiment.alert(title=title, text=line,
                                                                         level=_WANDB_LEVEL["error"]))

    def finish(self, records: list[dict[str, Any]]) -> None:
        """After fit: the findings not sent live (other ranks, the report's rules), then the incidents
        (incidents.py: the verdict and one line per root cause; TensorBoard text ``incidents``, W&B
        table ``incidents`` and summary ``verdict``), then W&B's table of every finding."""
        for record in records:
            self.send(record)
        incidents = group(records)
        last_step = max((r["step"] for r in records if isinstance(r.get("step"), int)), default=0)
        summary = redact_text("\n\n".join([verdict(records)] + [
            f"**{i.severity}** {i.title()} (`{i.source()}`): {i.root.get('message', '')}"
            + (f" — also seen as: {i.evidence_text()}" if i.evidence else "") for i in incidents]))
        for logger in self.tensorboard:
            self._guard("tensorboard", lambda lg=logger: lg.experiment.add_text("incidents", summary,
                                                                               global_step=last_step))
            self._guard("tensorboard", lambda lg=logger: lg.experiment.flush())
        if not self.wandb:
            return
        rows = [[r.get("severity"), r.get("check"), r.get("code"), r.get("step"),
                 "all" if r.get("rank") is None else str(r.get("rank")),
                 redact_text(str(r.get("message", ""))), redact_text(str(r.get("advice", "")))] for r in records]
        incident_rows = [[i.severity, redact_text(i.title()), i.source(), i.step, i.count,
                          redact_text(str(i.root.get("message", ""))), redact_text(i.evidence_text())] for i in incidents]

        def log_table(logger: Any) -> None:
            import wandb

            logger.experiment.log({"findings": wandb.Table(columns=TABLE_COLUMNS, data=rows, allow_mixed_types=True),
                                   "incidents": wandb.Table(columns=INCIDENT_COLUMNS, data=incident_rows,
                                                            allow_mixed_types=True)})
            logger.experiment.summary["verdict"] = redact_text(verdict(records))

        for logger in self.wandb:
            self._guard("wandb", lambda lg=logger: log_table(lg))

    def _guard(self, name: str, send: Any) -> None:
        try:
            send()
        except Exception:  # noqa: BLE001 - a dashboard must never stop a run
            if name not in self._failed:
                self._failed.add(name)
                log.debug("findings could not be sent to %s", name, exc_info=True)


def attach_dashboards(channel: FindingsChannel, loggers: Iterable[Any]) -> DashboardSink | None:
    """Rank 0: forward ``channel``'s findings to the loggers' dashboards from now on (and the ones
    this process reported already, before the loggers existed). None when no logger has a dashboard.

    Idempotent per channel: ``dsdebug-train`` calls it before fit and every check's ``setup`` calls it
    again (so a plain Lightning project gets its dashboards too); the first sink is returned, never a
    second one (each finding reaches a dashboard once)."""
    for existing in channel.sinks:
        if isinstance(existing, DashboardSink):
            return existing
    sink = DashboardSink(list(loggers))
    if not sink.active:
        return None
    for finding in channel.local:
        sink(finding)
    channel.sinks.append(sink)
    return sink
