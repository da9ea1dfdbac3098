"""Rank death: notice it in seconds, name the rank, leave no orphans.

When a rank is SIGKILLed (the kernel OOM killer, a node agent) the others sit in their next
collective until the process-group timeout (30 min by default; NCCL may never return). On one
node our launcher is the parent of every rank, so it can see a death directly:

- rank 0 (the launching process) polls its child ranks; a child that exits non-zero is reported
  as a ``rank_died`` finding (rank, pid, exit code or signal, last step), then rank 0 gives its
  main thread ``grace_s`` to fail on its own (gloo raises at once) and otherwise kills the
  remaining ranks and exits 1 itself;
- every child rank polls its parent; if rank 0 is gone, it reports that and exits 1 after a
  short grace, instead of living on as an orphan;
- when rank 0 exits for any reason, it reaps its children (waits, then SIGTERM, then SIGKILL).

Across nodes the launcher is not the parent; there the hang watchdog of ``comm_debug``
(heartbeats on shared storage) and the process-group timeout apply.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from lightning.pytorch import Callback

log = logging.getLogger(__name__)

ENV_PARENT = "DSDEBUG_LAUNCHER_PID"
POLL_S = 0.5


class _State:
    step: int | None = None  # last optimizer step, for the finding
    start_step: int = 0  # the step fit started from (after a resume), for throughput
    procs: list[tuple[int, subprocess.Popen]] = []
    dead: dict[int, int] = {}  # rank -> returncode, as seen by rank 0
    finishing = False  # rank 0 is done with fit: children exiting now is expected
    parent_reported = False  # a child rank reported its parent's death


state = _State()


def _describe(returncode: int) -> str:
    if returncode < 0:
        name = signal.Signals(-returncode).name
        hint = " (often the kernel OOM killer: check `dmesg` / `journalctl -k`)" if name == "SIGKILL" else ""
        return f"killed by {name}{hint}"
    return f"exited with code {returncode}"


def _report(rank: int, message: str, details: dict[str, Any]) -> None:
    from src.findings import Finding, get_channel

    get_channel().report(Finding(
        check="liveness", severity="error", code="rank_died", rank=rank, step=state.step,
        message=message,
        advice="the other ranks were stopped instead of waiting for the collective timeout; read "
               f"rank{rank}.log (its last lines) and the kernel log; resume with resume=latest",
        details=details,
    ))


def _hard_exit(reason: str) -> None:
    print(f"error: {reason}", file=sys.stderr, flush=True)
    reap_children(timeout=2.0)
    os._exit(1)


# ----------------------------------------------------------------- rank 0 side
def watch_children(procs: list[tuple[int, subprocess.Popen]], grace_s: float = 20.0) -> None:
    """Rank 0: called by the launcher right after it started the child ranks."""
    state.procs = list(procs)
    atexit.register(reap_children)

    def loop() -> None:
        while True:
            time.sleep(POLL_S)
            for rank, proc in state.procs:
                rc = proc.poll()
                if rc is None or rc == 0 or rank in state.dead or state.finishing:
                    continue
                state.dead[rank] = rc
                message = f"rank {rank} (pid {proc.pid}) {_describe(rc)} at step {state.step}"
                _report(rank, message, {"pid": proc.pid, "returncode": rc})
                time.sleep(grace_s)  # the main thread usually fails first (gloo: at once)
                _hard_exit(f"{message}; stopped the other ranks after {grace_s:.0f} s")
            if state.procs and all(p.poll() is not None for _, p in state.procs) and not state.dead:
                return

    threading.Thread(target=loop, name="rank-liveness", daemon=True).start()


def dead_rank_message(wait_s: float = 2.0) -> str | None:
    """Rank 0, after an exception: did a child rank die (the likely cause)? Polls briefly."""
    deadline = time.time() + wait_s
    while True:
        for rank, proc in state.procs:
            rc = proc.poll()
            if rc not in (None, 0):
                if rank not in state.dead:
                    state.dead[rank] = rc
                    message = f"rank {rank} (pid {proc.pid}) {_describe(rc)} at step {state.step}"
                    _report(rank, message, {"pid": proc.pid, "returncode": rc})
                return f"rank {rank} (pid {proc.pid}) {_describe(rc)} at step {state.step}"
        if time.time() >= deadline or not state.procs:
            return None
        time.sleep(0.1)


def reap_children(timeout: float | None = None) -> None:
    """Rank 0 on exit: let the children finish (longer after a clean fit), then stop them."""
    if not state.procs:
        return
    if timeout is None:
        timeout = 60.0 if state.finishing and not state.dead else 5.0
    deadline = time.time() + timeout
    for _, proc in state.procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            pass
    for sig_fn in ("terminate", "kill"):
        alive = [p for _, p in state.procs if p.poll() is None]
        if not alive:
            return
        for p in alive:
            getattr(p, sig_fn)()
        for p in alive:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


# ------------------------------------------------------------ child rank side
def watch_parent(grace_s: float = 5.0) -> None:
    """Child rank: exit if rank 0 (our launching parent) is gone."""
    parent = os.environ.get(ENV_PARENT)
    if not parent or os.environ.get("LOCAL_RANK", "0") == "0":
        return
    parent_pid = int(parent)
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))

    def loop() -> None:
        while os.getppid() == parent_pid:
            time.sleep(POLL_S)
        parent_gone_message()
        time.sleep(grace_s)
        print(f"error: rank 0 (pid {parent_pid}) died; rank {rank} exiting", file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=loop, name="parent-liveness", daemon=True).start()


def parent_gone_message(wait_s: float = 0.0) -> str | None:
    """Child rank: if rank 0 (our launching parent) is gone, report it once and say so. After an
    exception (a collective failing because rank 0 died) the caller waits a moment: the
    reparenting can lag the socket error."""
    parent = os.environ.get(ENV_PARENT)
    if not parent:
        return None
    parent_pid = int(parent)
    deadline = time.time() + wait_s
    while os.getppid() == parent_pid:
        if time.time() >= deadline:
            return None
        time.sleep(0.1)
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    message = f"rank 0 (pid {parent_pid}) is gone; rank {rank} stops at step {state.step}"
    if not state.parent_reported:
        state.parent_reported = True
        _report(0, message, {"pid": parent_pid, "seen_by": rank})
    return message


class LivenessCallback(Callback):
    """Keeps the step for the findings (and the start step for throughput) and marks the end of
    fit (children may exit now)."""

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        state.start_step = trainer.global_step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        state.step = trainer.global_step

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        state.finishing = True
