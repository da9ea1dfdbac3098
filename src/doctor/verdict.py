"""The doctor's one-screen verdict: one row per probe (status, culprit, what it found, what to do),
and the line the command exits with. Rank 0 prints it. Local: no collective."""

from __future__ import annotations

from typing import Any

from dsdebug.doctor.result import ProbeResult

__all__ = ["print_verdict", "summary_line"]

_STYLE = {"fail": "bold red", "warn": "yellow", "pass": "green", "skip": "dim"}


def summary_line(results: list[ProbeResult]) -> str:
    failed = [r for r in results if r.failed]
    if not failed:
        warned = sum(r.status == "warn" for r in results)
        return f"doctor: all {len(results)} probes passed" + (f" ({warned} warning(s))" if warned else "")
    names = ", ".join(f"{r.probe} ({r.culprit})" if r.culprit else r.probe for r in failed)
    return f"doctor: {len(failed)} of {len(results)} probes failed: {names}"


def print_verdict(results: list[ProbeResult], seconds: float | None = None, console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    title = "preflight doctor" + (f" ({seconds:.0f} s)" if seconds is not None else "")
    table = Table(title=title, show_lines=False)
    for col, width in (("probe", None), ("result", None), ("culprit", 28), ("found", None), ("what to do", None)):
        table.add_column(col, overflow="fold", max_width=width)
    for r in results:
        table.add_row(r.probe, r.status, r.culprit, r.message, r.advice if r.status in ("fail", "warn") else "",
                      style=_STYLE.get(r.status))
    console = console or Console(stderr=True)
    console.print(table)
    console.print(summary_line(results))
