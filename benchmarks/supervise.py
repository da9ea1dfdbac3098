"""Run a benchmark's command in its own session and always stop it and every descendant (torchrun,
train.py and its ranks each start sessions of their own), on error, timeout or Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import harness

REPO = harness.REPO


class BenchError(Exception):
    """A run failed or timed out: one line for the user."""


def run_supervised(cmd: list[str], log_path: Path, timeout: float, env: dict[str, str]) -> float:
    """Run cmd in its own session, return its wall seconds; on error, timeout or Ctrl-C stop it
    and every descendant seen while it ran (torchrun starts its workers in sessions of their own)."""
    import psutil

    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    seen: dict[int, psutil.Process] = {}
    started = time.monotonic()
    deadline = started + timeout
    try:
        while True:
            try:
                seen.update((c.pid, c) for c in psutil.Process(proc.pid).children(recursive=True))
            except psutil.NoSuchProcess:
                pass
            try:
                proc.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() > deadline:
                raise BenchError(f"timed out after {timeout:.0f} s: {' '.join(cmd[:4])} ..; log: {log_path}")
    finally:
        _stop(proc, list(seen.values()))
    if proc.returncode != 0:
        raise BenchError(f"exit {proc.returncode}: {' '.join(cmd[:4])} ..; log: {log_path}")
    return time.monotonic() - started


def _stop(proc: subprocess.Popen, descendants: list[Any]) -> None:
    import psutil

    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in descendants if p.is_running()]  # is_running: pid not reused
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
        for p in alive:
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        psutil.wait_procs(alive, timeout=5)
        if proc.poll() is not None and not any(p.is_running() for p in descendants):
            return
