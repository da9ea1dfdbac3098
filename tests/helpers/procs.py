"""Running train.py in the background for fault tests: start, wait for progress, find ranks."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import psutil

from tests.helpers.runs import REPO


def start_train(args: list[str], log_dir: Path, cache: Path, env: dict | None = None,
                preexec_fn: Callable | None = None) -> subprocess.Popen:
    full_env = {**os.environ, "DSDEBUG_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1", **(env or {})}
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"):
        full_env.pop(key, None)
    cmd = [sys.executable, str(REPO / "train.py"), *args, f"paths.log_dir={log_dir}"]
    out = open(log_dir / "stdout.txt", "w")
    err = open(log_dir / "stderr.txt", "w")
    return subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=out, stderr=err, preexec_fn=preexec_fn)


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) before {what}")
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def rank_pids(proc: subprocess.Popen, world_size: int = 2, timeout: float = 120) -> dict[int, int]:
    """rank -> pid: rank 0 is the launched process, the others its train.py children."""
    def children() -> list[psutil.Process]:
        return [p for p in tree(proc.pid)[1:] if "train.py" in " ".join(p.cmdline())]
    wait_for(lambda: len(children()) == world_size - 1, timeout, "child ranks to start", proc)
    pids = {0: proc.pid}
    for child in children():
        rank = next(int(a.split("rank")[-1]) for a in child.cmdline() if a.startswith("hydra.job.name=rank"))
        pids[rank] = child.pid
    return pids


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def output(log_dir: Path) -> tuple[str, str]:
    return (log_dir / "stdout.txt").read_text(), (log_dir / "stderr.txt").read_text()
