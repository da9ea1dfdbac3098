"""What rank 0 does with a run dir when the run ends, however it ends (completed, crashed, hang
watchdog, Ctrl-C): the troubleshooting rules report into the findings channel, then
``report.html`` and ``report.md`` are written. Never raises: a report must not turn a finished
run into a failed one, or hide the error of a failed one."""

from __future__ import annotations

import logging
from pathlib import Path

__all__ = ["finish_run"]

log = logging.getLogger(__name__)


def finish_run(run_dir: str | Path) -> Path | None:
    run_dir = Path(run_dir)
    try:
        from dsdebug.findings import Finding, get_channel
        from dsdebug.report.load import load_run
        from dsdebug.report.rules import evaluate

        run = load_run(run_dir)
        seen = {(f.get("check"), f.get("code")) for f in run.findings}
        for f in evaluate(run):
            if (f["check"], f["code"]) not in seen:
                get_channel().report(Finding(check=f["check"], severity=f["severity"], code=f["code"],
                                             message=f["message"], advice=f["advice"], step=f["step"],
                                             rank=f["rank"], details=f["details"]))
    except Exception:  # noqa: BLE001
        log.warning("report: the troubleshooting rules failed", exc_info=True)
    try:
        from dsdebug.report.render import write_report

        html, _ = write_report(run_dir)
        log.info("report: %s", html)
        return Path(html)
    except Exception:  # noqa: BLE001
        log.warning("report: could not write report.html/report.md", exc_info=True)
        return None
