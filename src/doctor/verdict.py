"""The doctor's one-screen verdict: one row per probe (status, culprit, what it found, what to do),
and the line the command exits with. Rank 0 prints it. Local: no collective."""

from __future__ import annotations

from typing import Any

from dsdebug.probes.result import ProbeResult

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
    """One row per probe (what it found, shortened: findings.jsonl keeps it whole), then what to do
    for each failed or warned probe, then the summary line."""
    from rich.console import Console
    from rich.table import Table

    title = "preflight doctor" + (f" ({seconds:.0f} s)" if seconds is not None else "")
    table = Table(title=title, show_lines=False, pad_edge=False)
    table.add_column("probe", no_wrap=True)
    table.add_column("result", no_wrap=True)
    table.add_column("culprit", overflow="fold", min_width=14, max_width=30)
    table.add_column("found", overflow="ellipsis", no_wrap=True, max_width=60)
    for r in results:
        table.add_row(r.probe, r.status, r.culprit, _short(r.message, 60), style=_STYLE.get(r.status))
    console = console or Console(stderr=True, width=max(120, Console(stderr=True).width))
    console.print(table)
    for r in results:
        if r.status in ("fail", "warn") and r.advice:
            console.print(f"{r.probe}: {_short(r.message, 160)}\n  -> {r.advice}", style=_STYLE[r.status],
                          highlight=False)
    console.print(summary_line(results), highlight=False)


def _short(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "\u2026"
