"""Rank liveness through the rendezvous store, under any launcher (torchrun, srun, deepspeed, ours).

Under torchrun or SLURM no rank is the parent of the others, so a SIGKILLed rank (the OOM
killer, a lost node) can only be seen through something every rank reaches: the store the
process group rendezvoused on (torchrun: its agent's TCPStore on node 0; otherwise rank 0
hosts it), on a connection of its own (`side_store`). Every rank runs one daemon thread:

- it registers who it is (``who/<r>``: host, pid, node) and bumps its heartbeat
  (``beat/<r>``: a counter and the step) every ``BEAT_S``; a rank that ends on purpose (an
  exception, the end of fit) says so first (``exit/<r>``), so it is not taken for dead;
- rank 0 reads every heartbeat (one ``multi_get``); the others read rank 0's and the verdict:
  O(world) store operations per second in all, no files, no shared filesystem;
- a rank whose heartbeat has not changed for ``stale_s`` (measured on the reader's clock) and
  that did not say it exits is dead; on the same host a vanished pid is dead at once. The
  first rank to decide claims the ``verdict`` key (compare_set) and is the one that reports.
  The store itself gone means its host is gone: rank 0 (or, under torchrun, node 0's agent,
  which exits once node 0's workers are dead).

After an exception (gloo raises at once when a peer's socket closes) the main thread asks
`Heartbeat.find_dead` with a short staleness: the failure is evidence already. A collective
that never returns (NCCL) is left to the thread: it decides after ``STALE_S``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Any, Callable

__all__ = ["BEAT_S", "Heartbeat", "PREFIX", "QUICK_STALE_S", "STALE_S", "STORE_TIMEOUT_S", "describe",
           "looks_like_comm_failure", "pid_gone", "side_store"]

log = logging.getLogger(__name__)

PREFIX = "dsdebug/liveness"
BEAT_S = 1.0
STALE_S = 20.0  # the thread, with no other evidence: generous (a GIL-heavy step must not look dead)
QUICK_STALE_S = 3.0  # after a collective failed
STORE_TIMEOUT_S = 10.0


def side_store(prefix: str, timeout_s: float = STORE_TIMEOUT_S) -> Any | None:
    """A connection of our own to the process group's store, under ``prefix``; None without one.

    A clone, so a blocked call here never holds the lock of the connection the process group
    uses, and with a short timeout (the group's store waits as long as the collective timeout)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    store = dist.distributed_c10d._get_default_store().clone()
    store.set_timeout(timedelta(seconds=timeout_s))
    return dist.PrefixStore(prefix, store)


def pid_gone(pid: int) -> bool:
    """This host only: the process no longer exists (or is a zombie nobody reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _boot_id() -> str | None:
    """Two hosts can share a name (containers): a pid is only checked where the boot id matches too."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def looks_like_comm_failure(exc: BaseException | None) -> bool:
    """An exception that a dead peer causes (gloo: 'Connection closed by peer'): worth waiting for a verdict."""
    import torch.distributed as dist

    words = ("gloo", "nccl", "connection", "broken pipe", "socket", "peer", "timed out", "timeout")
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, dist.DistError) or any(w in str(exc).lower() for w in words):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def describe(verdict: dict) -> str:
    """``rank 1 (host h, pid 123, node 1) died (...) at step 7``."""
    where = f"host {verdict.get('host', '?')}, pid {verdict.get('pid', '?')}"
    if verdict.get("node") is not None:
        where += f", node {verdict['node']}"
    return f"rank {verdict['rank']} ({where}) {verdict['how']} at step {verdict.get('step')}"


class Heartbeat:
    def __init__(self, store: Any, rank: int, world_size: int, identity: dict, step: Callable[[], int | None],
                 on_dead: Callable[[dict], None] | None = None, stale_s: float = STALE_S,
                 beat_s: float = BEAT_S) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.me = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "boot": _boot_id(), **identity}
        self.step, self.on_dead, self.stale_s, self.beat_s = step, on_dead, stale_s, beat_s
        self.who: dict[int, dict] = {}  # what each watched rank registered
        self.seen: dict[int, tuple[bytes, float]] = {}  # rank -> (heartbeat value, monotonic time it changed)
        self.store_failed_at: float | None = None
        self.exited: set[int] = set()  # ranks that said they end on purpose
        self.verdict: dict | None = None
        self.handled = False  # the main thread took over (an exception): the thread only beats
        self._n = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-rank{rank}", daemon=True)

    # ---- lifecycle (training thread) ------------------------------------------------
    def start(self) -> "Heartbeat":
        self.store.set(f"who/{self.rank}", json.dumps(self.me))
        self._beat()
        self._thread.start()
        return self

    def stop(self, reason: str = "finished") -> None:
        self.mark_exit(reason)
        self._stop.set()

    def mark_exit(self, reason: str, first_failure: bool = False) -> None:
        """This rank ends on purpose: not to be taken for dead when its heartbeat stops. A failure
        of its own (not a peer's death) is recorded once as ``first_failure``: the others then
        stop looking for a dead rank."""
        try:
            with self._lock:
                self.store.set(f"exit/{self.rank}", reason[:300])
                if first_failure:
                    self.store.compare_set("first_failure", "", f"{self.rank} {reason[:300]}")
        except Exception:  # noqa: BLE001 - the store may be gone with its host
            pass

    def _other_failed_first(self) -> bool:
        try:
            with self._lock:
                if not self.store.check(["first_failure"]):
                    return False
                return self.store.get("first_failure").decode().split()[0] != str(self.rank)
        except Exception:  # noqa: BLE001
            return False

    # ---- the thread -------------------------------------------------------------------
    def _loop(self) -> None:
        # until every watched rank's registration (host, pid) is read, look every 0.2 s: a rank that
        # dies early, with the store on its host, would otherwise be named "host ?, pid ?"
        while not self._stop.wait(self.beat_s if len(self.who) >= len(self.watched()) else min(self.beat_s, 0.2)):
            try:
                self._beat()
                verdict = None if self.handled else self.check(self.stale_s)
            except Exception:  # noqa: BLE001 - liveness must never take training down
                log.debug("heartbeat rank %d failed", self.rank, exc_info=True)
                continue
            if verdict is not None and self.on_dead is not None and not self.handled:
                self.on_dead(verdict)
                return

    def _beat(self) -> None:
        self._n += 1
        try:
            with self._lock:
                self.store.set(f"beat/{self.rank}", f"{self._n} {self.step()}")
            self.store_failed_at = None
        except Exception:  # noqa: BLE001
            self.store_failed_at = self.store_failed_at or time.monotonic()

    # ---- deciding ---------------------------------------------------------------------
    def watched(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.rank] if self.rank == 0 else [0]

    def _observe(self) -> dict | None:
        """Read the watched heartbeats (and the verdict, if someone decided already)."""
        ranks = self.watched()
        with self._lock:
            if self.store.check(["verdict"]):
                return json.loads(self.store.get("verdict"))
            missing = [r for r in ranks if r not in self.who]
            if missing:  # startup: read each rank's registration once it is there
                if not self.store.check([f"who/{r}" for r in missing]):
                    missing = [r for r in missing if self.store.check([f"who/{r}"])]
                for r, raw in zip(missing, self.store.multi_get([f"who/{r}" for r in missing]) if missing else []):
                    self.who[r] = json.loads(raw)
            ranks = [r for r in ranks if r in self.who]  # registered: their beat key exists
            values = self.store.multi_get([f"beat/{r}" for r in ranks]) if ranks else []
            if self.rank != 0 and 0 not in self.exited and self.store.check(["exit/0"]):
                self.exited.add(0)  # rank 0 ends on purpose: its store (if it hosts it) may go with it
        now = time.monotonic()
        for r, value in zip(ranks, values):
            if r not in self.seen or self.seen[r][0] != value:
                self.seen[r] = (value, now)
        return None

    def check(self, stale_s: float) -> dict | None:
        """A verdict (the dead rank, how, its last step) or None. Raises nothing."""
        if self.verdict is not None:
            return self.verdict
        try:
            published = self._observe()
            self.store_failed_at = None
        except Exception:  # noqa: BLE001 - the store is unreachable
            self.store_failed_at = self.store_failed_at or time.monotonic()
            published = None
        if published is not None:
            self.verdict = published
            return published
        if self.store_failed_at is not None:
            return self._store_gone(stale_s)
        now, dead = time.monotonic(), []
        for r, (value, changed) in sorted(self.seen.items()):
            who = self.who.get(r, {})
            same_host = who.get("host") == self.me["host"] and who.get("boot") == self.me.get("boot")
            if (now - changed > stale_s or (same_host and pid_gone(int(who.get("pid", 0))))) and not self._exited(r):
                dead.append((r, value))
        if not dead:
            return None
        r, value = dead[0]
        last = value.decode().split()[-1] if value else ""
        return self._decide({"rank": r, **self.who.get(r, {}), "step": self.step(),
                             "last_beat_step": int(last) if last.isdigit() else None,
                             "how": "died without an exception (its heartbeat stopped: killed by SIGKILL, often "
                                    "the OOM killer, or its node was lost)",
                             "others": [d for d, _ in dead[1:]], "seen_by": self.rank})

    def _exited(self, rank: int) -> bool:
        if rank not in self.exited:
            with self._lock:
                if self.store.check([f"exit/{rank}"]):
                    self.exited.add(rank)
        return rank in self.exited

    def _store_gone(self, stale_s: float) -> dict | None:
        if time.monotonic() - self.store_failed_at < min(stale_s, QUICK_STALE_S):
            return None  # one failed call is not a verdict
        if 0 in self.exited:
            return None  # rank 0 said it ends (finished, or failed with its own error): not a death
        who = self.who.get(0) or {}
        launcher = "node 0's torchrun agent" if os.environ.get("TORCHELASTIC_RUN_ID") else "rank 0"
        self.verdict = {"rank": 0, **who, "step": self.step(), "seen_by": self.rank,
                        "how": f"is gone (the rendezvous store, hosted by {launcher}, stopped answering)"}
        return self.verdict

    def _decide(self, verdict: dict) -> dict:
        """Publish the verdict; the rank whose compare_set wins reports it, the others adopt it."""
        try:
            with self._lock:
                verdict = json.loads(self.store.compare_set("verdict", "", json.dumps(verdict)))
        except Exception:  # noqa: BLE001 - the store died meanwhile: ours stands, and we report it
            pass
        self.verdict = verdict
        return verdict

    def claimed(self, verdict: dict) -> bool:
        """Whether this rank reports the verdict: the one that decided it (with no store: each survivor)."""
        return verdict.get("seen_by") == self.rank

    def find_dead(self, wait_s: float, stale_s: float = QUICK_STALE_S) -> dict | None:
        """Main thread, after an exception: poll for a verdict for up to ``wait_s``."""
        self.handled = True
        deadline = time.monotonic() + wait_s
        while True:
            verdict = self.check(stale_s)
            if verdict is not None or time.monotonic() >= deadline or self._other_failed_first():
                return verdict
            time.sleep(0.2)
