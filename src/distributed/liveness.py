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

Under torchrun, srun or deepspeed no rank is the parent of another: there every rank heartbeats
through the rendezvous store (``heartbeat.py``), and a survivor names the dead rank and its host.
torchrun's agent SIGTERMs the surviving workers of a node at once when one dies; a SIGTERM that
arrives while this rank is already failing is held (``_guard_sigterm``) until the finding is
written, instead of killing the rank mid-report or starting a preemption checkpoint.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from lightning.pytorch import Callback

from dsdebug.distributed import startup_signals
from dsdebug.distributed._liveness_state import _describe, _report, state

__all__ = ["LivenessCallback", "state", "watch_children", "watch_parent", "dead_rank_message", "parent_gone_message",
           "peer_dead_message", "reap_children", "ending_on_purpose", "ignore_sigterm_from_now", "ENV_PARENT"]

log = logging.getLogger(__name__)

ENV_PARENT = "DSDEBUG_LAUNCHER_PID"
POLL_S = 0.5


def _child_message(rank: int, pid: int, returncode: int) -> str:
    return f"rank {rank} (host {socket.gethostname()}, pid {pid}) {_describe(returncode)} at step {state.step}"


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
                message = _child_message(rank, proc.pid, rc)
                _report(rank, message, {"pid": proc.pid, "host": socket.gethostname(), "returncode": rc})
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
                message = _child_message(rank, proc.pid, rc)
                if rank not in state.dead:
                    state.dead[rank] = rc
                    _report(rank, message, {"pid": proc.pid, "host": socket.gethostname(), "returncode": rc})
                return message
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


# ------------------------------------------------- any launcher: the store's heartbeats
FIND_WAIT_S = 10.0  # after a failed collective: how long to look for the rank that died
PEER_GRACE_S = 10.0  # after the heartbeat thread's own verdict: the main thread's turn to fail first
SIGTERM_HOLD_S = 20.0  # a held SIGTERM ends the rank after this at the latest (torchrun SIGKILLs at 30 s)


def _peer_report(verdict: dict) -> str:
    from dsdebug.distributed.heartbeat import describe

    message = describe(verdict)
    if state.heartbeat is not None and state.heartbeat.claimed(verdict):
        keys = ("host", "pid", "node", "local_rank", "last_beat_step", "seen_by", "others")
        details = {k: verdict.get(k) for k in keys}
        _report(int(verdict["rank"]), message, details)
    return message


def _on_peer_dead(verdict: dict) -> None:
    """Heartbeat thread: a peer died and the main thread has not noticed (a collective that
    never returns): report, give the main thread its chance, then end this rank."""
    message = _peer_report(verdict)
    deadline = time.time() + PEER_GRACE_S
    while time.time() < deadline or (state.failing and time.time() < deadline + SIGTERM_HOLD_S):
        time.sleep(0.2)  # when the main thread is failing, it exits on its own with the full story
    if state.heartbeat.rank == 0:
        _leave_crash_record(message)
    _hard_exit(f"{message}; rank {state.heartbeat.rank} stopped too")


def _leave_crash_record(message: str) -> None:
    """Rank 0 ends from this thread: leave crash.json and the report, as the main thread would."""
    from dsdebug.findings import get_channel

    try:
        run_dir = get_channel().path.parent
        crash = {"status": "rank_died", "exit_code": 1, "error": message, "exception": "RankDied"}
        (run_dir / "crash.json").write_text(json.dumps(crash, indent=1))
        from dsdebug.report.finish import finish_run

        finish_run(run_dir)
    except Exception:  # noqa: BLE001 - never in the way of ending the rank
        log.debug("no crash record", exc_info=True)


def peer_dead_message(exc: BaseException) -> str | None:
    """Main thread, after an exception in a multi-rank fit: the rank that died, if one did."""
    hb = state.heartbeat
    if hb is None:
        return None
    from dsdebug.distributed.heartbeat import looks_like_comm_failure

    state.failing = True
    verdict = hb.find_dead(FIND_WAIT_S if looks_like_comm_failure(exc) else 0.0)
    return None if verdict is None else _peer_report(verdict)


def ending_on_purpose(reason: str) -> None:
    """Another part ends this rank (the hang watchdog): its peers must not report it as dead."""
    if state.heartbeat is not None:
        state.heartbeat.handled = True
        state.heartbeat.mark_exit(reason)


def ignore_sigterm_from_now() -> None:
    """The report is written and the rank exits now. Python puts SIGTERM back to its default while
    it shuts down (not an ignored one), so a launcher's SIGTERM then would end it 'by SIGTERM'."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _guard_sigterm() -> None:
    """Before Lightning records the handlers it restores after fit: SIGTERM acts as always
    (the default: end the process), except while this rank is failing, when it is held so the
    survivor can still name the dead rank; the hold ends after SIGTERM_HOLD_S at the latest."""
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGTERM)
    if current not in (signal.SIG_DFL, None) and not startup_signals.is_recorder(current):
        return  # someone else's handler (a test harness, an outer framework): leave it
    recording = startup_signals.is_recorder(current)  # a SIGTERM now is still a preemption (PreemptionCheckpoint)

    def on_sigterm(signum: int, frame: Any) -> None:
        if not state.failing and recording and not state.finishing:
            current(signum, frame)  # before PreemptionCheckpoint's handler is in place: recorded
            return
        if not state.failing:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        log.warning("SIGTERM received while this rank is stopping after a failure: finishing the report first")
        timer = threading.Timer(SIGTERM_HOLD_S, lambda: os._exit(128 + signal.SIGTERM))
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, on_sigterm)


class LivenessCallback(Callback):
    """Keeps the step for the findings (and the start step for throughput), marks the end of
    fit (children may exit now), and in multi-rank fits runs this rank's store heartbeat."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or trainer.world_size < 2 or state.heartbeat is not None:
            return
        from dsdebug.distributed.heartbeat import PREFIX, Heartbeat, side_store

        store = side_store(PREFIX)
        if store is None:
            return
        _guard_sigterm()
        identity = {"node": trainer.node_rank, "local_rank": trainer.local_rank}
        state.heartbeat = Heartbeat(store, trainer.global_rank, trainer.world_size, identity,
                                    step=lambda: state.step, on_dead=_on_peer_dead).start()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        state.start_step = trainer.global_step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        state.step = trainer.global_step

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        state.failing = True  # before Lightning's teardown puts _guard_sigterm's handler back
        if state.heartbeat is not None:
            from dsdebug.distributed.heartbeat import looks_like_comm_failure

            state.heartbeat.mark_exit(f"failed: {type(exception).__name__}: {exception}",
                                      first_failure=not looks_like_comm_failure(exception))

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        state.finishing = True
        if state.heartbeat is not None:
            state.heartbeat.stop("finished")
            state.heartbeat = None
