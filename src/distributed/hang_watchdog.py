"""Hang watchdog for `comm_debug`: a per-rank thread that notices a stalled job, dumps every
rank's stacks, names the rank(s) that are behind and ends the job instead of letting it sit
in a blocked collective until the process-group timeout (30 min by default).

Side channel: a blocked collective blocks the training thread, not this one, so the ranks
talk through the rendezvous store (a connection of its own to the process group's store,
``dsdebug.distributed.heartbeat.side_store``; one process: an in-memory store): one heartbeat key per
rank, a ``flag`` key claimed with compare_set, a ``reported`` key. No shared filesystem is
needed: across nodes with node-local run dirs every rank still joins the same report.

Every rank runs one watchdog thread; it only reads state that the training thread updates
(step, progress time) and the process-wide `CommTracker` (collectives entered / in flight).
When a rank stalls for ``timeout_s`` (or sees another rank's flag) it: claims or sees the
flag, writes a final heartbeat with where its training thread is, dumps all thread stacks
to ``hang_rank<r>.txt`` and torch's flight recorder to ``flight_recorder/rank_<r>`` in its own
run dir; the first rank to claim the flag waits for the others' heartbeats, analyses them
(`analyze`) and reports one finding; the launching rank of each node reaps its child
processes; every rank exits with `HANG_EXIT_CODE`.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable
from dsdebug.distributed.hang_analysis import analyze, where_is

__all__ = ["HangWatchdog", "HANG_EXIT_CODE", "watchdog_store"]

log = logging.getLogger(__name__)

HANG_EXIT_CODE = 124  # the `timeout(1)` convention: "gave up waiting"


def watchdog_store(fit: int) -> Any:
    """The store the watchdogs of one fit share (keys under ``dsdebug/comm_debug/<fit>``)."""
    import torch.distributed as dist

    from dsdebug.distributed.heartbeat import side_store

    return side_store(f"dsdebug/comm_debug/{fit}") or dist.HashStore()


class HangWatchdog:
    def __init__(self, run_dir: Path, rank: int, world_size: int, timeout_s: float, poll_s: float,
                 tracker: Any, on_hang: Callable[[dict, dict[int, dict]], None], reap_children: bool,
                 store: Any) -> None:
        self.run_dir, self.store = Path(run_dir), store
        self.rank, self.world_size = rank, world_size
        self.timeout_s, self.poll_s = float(timeout_s), float(poll_s)
        self.grace_s = max(5.0, 3 * self.poll_s)
        self.tracker, self.on_hang, self.reap_children = tracker, on_hang, reap_children
        self.step, self.progress_time = -1, time.time()
        self.fired = False
        self._stop = threading.Event()
        self._training_thread = threading.current_thread()  # started from a training hook
        self._thread = threading.Thread(target=self._loop, name=f"comm_debug-watchdog-rank{rank}", daemon=True)

    # ---- training thread ------------------------------------------------------------
    def start(self) -> "HangWatchdog":
        self.progress_time = time.time()
        self._thread.start()
        return self

    def progress(self, step: int) -> None:  # two attribute writes: the only per-step cost
        self.step, self.progress_time = step, time.time()

    def stop(self) -> None:
        if not self.fired:
            self._stop.set()
            self._thread.join(timeout=2 * self.poll_s)

    def wait_for_exit(self) -> None:
        """After firing the watchdog ends the process; the training thread must not race it
        (e.g. an exception from a collective whose peer already exited)."""
        self._thread.join()

    # ---- watchdog thread ------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.wait(self.poll_s):
                self._write_beat()
                if time.time() - self.progress_time > self.timeout_s or self._has("flag"):
                    self._fire()
                    return
        except Exception:  # noqa: BLE001 - a broken watchdog must never take training down
            log.exception("comm_debug watchdog failed on rank %d; hang detection is off", self.rank)

    def _has(self, key: str) -> bool:
        try:
            return bool(self.store.check([key]))
        except Exception:  # noqa: BLE001 - the store's host is gone: this rank decides alone
            return False

    def _write_beat(self, where: dict | None = None) -> None:
        tr, now = self.tracker, time.time()
        inflight = [] if tr is None else [
            {"name": name, "seq": seq, "for_s": round(time.perf_counter() - start, 3)}
            for name, start, seq in sorted(list(tr.inflight.values()), key=lambda v: v[2])]
        beat = {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(), "step": self.step,
                "progress_time": self.progress_time, "now": now, "fired": where is not None,
                "seq": tr.seq if tr else None, "last": tr.last if tr else None, "inflight": inflight,
                "where": where}
        try:
            self.store.set(f"beat/{self.rank}", json.dumps(beat, default=str))
        except Exception:  # noqa: BLE001
            log.debug("comm_debug: heartbeat not written", exc_info=True)

    def read_beats(self) -> dict[int, dict]:
        beats = {}
        for r in range(self.world_size):
            if r == self.rank or self._has(f"beat/{r}"):
                try:
                    beats[r] = json.loads(self.store.get(f"beat/{r}"))
                except Exception:  # noqa: BLE001
                    continue
        return beats

    def _fire(self) -> None:
        self.fired = True
        from dsdebug.distributed.liveness import ending_on_purpose

        ending_on_purpose("hang watchdog")  # the ranks now exit 124 one by one: none of them "died"
        try:
            self._report(time.time() - self.progress_time)
        finally:  # whatever failed above, the job must not stay hung
            self._end()

    def _claim(self, key: str) -> bool:
        try:
            return self.store.compare_set(key, "", str(self.rank)).decode() == str(self.rank)
        except Exception:  # noqa: BLE001 - no store: report what this rank knows
            return True

    def _report(self, stalled_s: float) -> None:
        first = self._claim("flag")  # the rank that noticed first: it makes sure someone reports
        where = where_is(self._training_thread)
        self._write_beat(where)
        self._dump(stalled_s, where)
        reporter = False
        if first or self.rank == 0:
            def everyone_fired() -> bool:
                beats = self.read_beats()
                return len(beats) == self.world_size and all(b.get("fired") for b in beats.values())

            self._wait(everyone_fired)
            if self.rank != 0:  # rank 0 reports when its watchdog runs: its run dir holds the report
                self._wait(lambda: self._has("reporter"))
            reporter = self._claim("reporter")
        if reporter:
            beats = self.read_beats()
            analysis = analyze(beats, self.world_size, time.time(), stale_s=3 * self.poll_s)
            analysis["stalled_s"], analysis["detected_by"] = round(stalled_s, 1), self.rank
            try:
                self.on_hang(analysis, beats)
            finally:
                try:
                    self.store.set("reported", "1")
                except Exception:  # noqa: BLE001
                    pass
        else:
            log.error("comm_debug: rank %d joined the hang report (stacks in hang_rank%d.txt)", self.rank, self.rank)
            self._wait(lambda: self._has("reported"), factor=4)

    def _wait(self, done: Callable[[], bool], factor: float = 1.0) -> None:
        deadline = time.time() + factor * self.grace_s
        while time.time() < deadline and not done():
            time.sleep(0.2)

    def _dump(self, stalled_s: float, where: dict) -> None:
        tr = self.tracker
        path = self.run_dir / f"hang_rank{self.rank}.txt"
        names = {t.ident: t.name for t in threading.enumerate()}
        lines = [f"comm_debug hang report: rank {self.rank} of {self.world_size}, pid {os.getpid()}, "
                 f"host {socket.gethostname()}",
                 f"no training progress for {stalled_s:.1f} s (hang_timeout_s={self.timeout_s:g}); "
                 f"global_step at the last progress: {self.step}"]
        if tr is not None:
            last = tr.last and f"{tr.last[0]} (#{tr.last[1]}), {time.time() - tr.last[2]:.1f} s ago"
            lines.append(f"collectives entered: {tr.seq}; last entered: {last or 'none'}")
            inflight = sorted(list(tr.inflight.values()), key=lambda v: v[2])
            lines += [f"in flight: {n} (#{s}) for {time.perf_counter() - t0:.1f} s" for n, t0, s in inflight] or \
                ["in flight: none"]
        lines.append(f"training thread is at: {where.get('innermost')}")
        lines.append("\n--- Python stacks, all threads (training thread first) ---")
        frames = sys._current_frames()
        order = sorted(frames, key=lambda i: i != self._training_thread.ident)
        for ident in order:
            lines.append(f"\nThread {names.get(ident, '?')} ({ident}):")
            lines.append("".join(traceback.format_stack(frames[ident])).rstrip())
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n\n--- faulthandler (all threads, innermost first) ---\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        from dsdebug.distributed.flight_recorder import dump_flight_recorder

        dump_flight_recorder(self.run_dir, self.rank)

    def _end(self) -> None:
        try:
            _finish_wandb(HANG_EXIT_CODE)  # before reaping: the W&B service is a child process
            if self.reap_children:
                _reap_children(self.grace_s)
        except Exception:  # noqa: BLE001
            log.exception("comm_debug: cleanup before exit failed")
        if self.rank == 0:  # the report of a hung run, as for any other ending
            try:
                crash = {"status": "hang", "exit_code": HANG_EXIT_CODE, "exception": "HangWatchdog",
                         "error": f"hang watchdog: no training progress; stacks in {self.run_dir}/hang_rank<r>.txt"}
                (Path(self.run_dir) / "crash.json").write_text(json.dumps(crash, indent=1))
                from dsdebug.report.finish import finish_run

                finish_run(self.run_dir)
            except Exception:  # noqa: BLE001
                log.exception("comm_debug: the report of the hung run failed")
        for handler in logging.getLogger().handlers:
            try:
                handler.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(HANG_EXIT_CODE)


def _reap_children(grace_s: float) -> None:
    """The launching rank's children (other ranks, data workers, W&B service): let them
    exit on their own watchdogs, then kill what is left, so no orphan keeps running."""
    try:
        import psutil
    except ImportError:
        return
    children = psutil.Process().children(recursive=True)
    _, alive = psutil.wait_procs(children, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)


def _finish_wandb(exit_code: int) -> None:
    """Close a W&B run as failed (os._exit skips its atexit hook); never block the exit."""
    wandb = sys.modules.get("wandb")
    run = getattr(wandb, "run", None) if wandb is not None else None
    if run is None:
        return

    def finish() -> None:
        try:
            run.summary.update({"status": "hang"})
            run.finish(exit_code=exit_code)
        except Exception:  # noqa: BLE001
            log.warning("comm_debug: could not finish the W&B run", exc_info=True)

    t = threading.Thread(target=finish, daemon=True)
    t.start()
    t.join(timeout=15)
