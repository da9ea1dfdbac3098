"""What liveness knows about this process's ranks (one shared `state`), and the `rank_died`
finding: reported once per dead rank, whoever notices first (the launcher's poll, a child's
parent watch, the store heartbeat). Re-exported from liveness.py."""

from __future__ import annotations

import signal
import subprocess
from typing import Any

__all__ = ["state"]


class _State:
    step: int | None = None  # last optimizer step, for the finding
    start_step: int = 0  # the step fit started from (after a resume), for throughput
    procs: list[tuple[int, subprocess.Popen]] = []
    dead: dict[int, int] = {}  # rank -> returncode, as seen by rank 0
    finishing = False  # rank 0 is done with fit: children exiting now is expected
    parent_reported = False  # a child rank reported its parent's death
    failing = False  # this rank is handling an exception: a SIGTERM now is held (_guard_sigterm)
    heartbeat: Any = None  # heartbeat.Heartbeat, in multi-rank fits
    reported: set[int] = set()  # ranks whose death this process reported


state = _State()


def _describe(returncode: int) -> str:
    if returncode < 0:
        name = signal.Signals(-returncode).name
        hint = " (often the kernel OOM killer: check `dmesg` / `journalctl -k`)" if name == "SIGKILL" else ""
        return f"killed by {name}{hint}"
    return f"exited with code {returncode}"


def _report(rank: int, message: str, details: dict[str, Any]) -> None:
    from dsdebug.findings import Finding, get_channel

    if rank in state.reported:
        return
    state.reported.add(rank)
    host = details.get("host") or "its host"
    get_channel().report(Finding(
        check="liveness", severity="error", code="rank_died", rank=rank, step=state.step,
        message=message,
        advice="the other ranks were stopped instead of waiting for the collective timeout; read "
               f"rank {rank}'s log (its last lines) and the kernel log on {host} (`dmesg`, `journalctl -k`: "
               "the OOM killer); resume with resume=latest",
        details=details,
    ))
