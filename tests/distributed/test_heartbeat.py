"""Liveness through the store (src/distributed/heartbeat.py), without processes: ranks are Heartbeat
objects on one in-memory store. What the torchrun tests (tests/distributed/test_rank_death_torchrun.py) cannot
show on one machine: a rank on another host is found dead by its stale heartbeat alone (no pid to
check), a rank that said it exits is not, the store's host gone names rank 0, and the verdict is
published once and adopted by the other ranks."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from dsdebug.distributed.heartbeat import Heartbeat, describe


class FlakyStore:
    """An in-memory store that can go away (its host died)."""

    def __init__(self) -> None:
        self.inner, self.down = dist.HashStore(), False

    def __getattr__(self, name):
        fn = getattr(self.inner, name)

        def call(*args, **kwargs):
            if self.down:
                raise dist.DistNetworkError("Broken pipe")
            return fn(*args, **kwargs)
        return call


def _rank(store, rank, world=3, host=None, pid=None, step=lambda: 7, **kw) -> Heartbeat:
    identity = {"node": rank, "local_rank": 0, **({"host": host} if host else {}), **({"pid": pid} if pid else {})}
    return Heartbeat(store, rank, world, identity, step=step, beat_s=0.05, **kw)


@pytest.fixture
def ranks():
    made = []

    def make(*args, **kwargs):
        hb = _rank(*args, **kwargs)
        made.append(hb)
        return hb
    yield make
    for hb in made:
        hb._stop.set()


def _wait_seen(hb: Heartbeat, ranks: list[int]) -> None:
    deadline = time.time() + 10
    while not all(r in hb.seen for r in ranks):
        assert time.time() < deadline, hb.seen
        hb.check(60)
        time.sleep(0.05)


def test_a_rank_on_another_host_is_dead_when_its_heartbeat_stops(ranks):
    store = FlakyStore()
    r0, r1, r2 = ranks(store, 0).start(), ranks(store, 1, host="node-b").start(), ranks(store, 2).start()
    _wait_seen(r0, [1, 2])
    r1._stop.set()  # SIGKILL: no exit mark, the heartbeat just stops
    verdict = r0.find_dead(wait_s=10, stale_s=0.5)
    assert verdict["rank"] == 1 and verdict["host"] == "node-b" and verdict["node"] == 1
    assert verdict["step"] == 7 and r0.claimed(verdict)
    assert describe(verdict).startswith("rank 1 (host node-b, pid ")
    # rank 2 (watching rank 0 only) adopts the published verdict and does not report it again
    adopted = r2.find_dead(wait_s=5)
    assert adopted == verdict and not r2.claimed(adopted)


def test_a_rank_that_said_it_exits_is_not_dead(ranks):
    store = FlakyStore()
    r0, r1 = ranks(store, 0, world=2).start(), ranks(store, 1, world=2, host="node-b").start()
    _wait_seen(r0, [1])
    r1.stop("failed: RuntimeError: planted")
    assert r0.find_dead(wait_s=1.5, stale_s=0.3) is None


def test_a_vanished_pid_on_this_host_is_dead_at_once(ranks):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    store = FlakyStore()
    r0, _ = ranks(store, 0, world=2).start(), ranks(store, 1, world=2, pid=int(gone.stdout)).start()
    _wait_seen(r0, [1])
    verdict = r0.find_dead(wait_s=0, stale_s=60)  # no staleness needed: the process is gone
    assert verdict["rank"] == 1 and verdict["pid"] == int(gone.stdout)


def test_the_store_gone_names_rank_0_and_its_host(ranks):
    store = FlakyStore()
    ranks(store, 0, world=2, host="node-a").start()
    r1 = ranks(store, 1, world=2).start()
    _wait_seen(r1, [0])
    store.down = True
    verdict = r1.find_dead(wait_s=10, stale_s=0.5)
    assert verdict["rank"] == 0 and verdict["host"] == "node-a" and "rendezvous store" in verdict["how"]
    assert r1.claimed(verdict)  # nobody can publish it: each survivor reports


def test_the_thread_reports_a_death_the_main_thread_never_sees(ranks):
    store, seen = FlakyStore(), []
    r0 = ranks(store, 0, world=2, stale_s=0.5, on_dead=seen.append).start()
    r1 = ranks(store, 1, world=2, host="node-b").start()
    _wait_seen(r0, [1])
    r1._stop.set()
    deadline = time.time() + 10
    while not seen:
        assert time.time() < deadline
        time.sleep(0.05)
    assert len(seen) == 1 and seen[0]["rank"] == 1


def test_a_rank_that_failed_on_its_own_ends_the_search_at_once(ranks):
    store = FlakyStore()
    r0, r1 = ranks(store, 0, world=2).start(), ranks(store, 1, world=2).start()
    _wait_seen(r1, [0])
    r0.mark_exit("failed: ValueError: a bug on rank 0", first_failure=True)
    started = time.monotonic()
    assert r1.find_dead(wait_s=30) is None
    assert time.monotonic() - started < 30  # returned before the wait ran out


GUARD = """
import os, signal, time
from dsdebug.distributed import liveness
liveness._guard_sigterm()
liveness.state.failing = True            # this rank is writing its finding after a peer died
os.kill(os.getpid(), signal.SIGTERM)     # torchrun's agent stopping the node's workers
time.sleep(0.5)
print("held", flush=True)
liveness.state.failing = False
os.kill(os.getpid(), signal.SIGTERM)     # any other time: SIGTERM ends the process as always
time.sleep(5)
print("not reached", flush=True)
"""


def test_sigterm_is_held_while_the_rank_fails_and_default_otherwise():
    from tests.helpers.runs import REPO

    proc = subprocess.run([sys.executable, "-c", GUARD], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["held"], proc.stdout + proc.stderr[-2000:]
    assert proc.returncode == -15, proc.stderr[-2000:]


def test_the_store_going_away_after_rank_0_finished_is_not_a_death(ranks):
    store = FlakyStore()
    r0 = ranks(store, 0, world=2).start()
    r1 = ranks(store, 1, world=2).start()
    _wait_seen(r1, [0])
    r0.stop("finished")  # rank 0 (hosting the store under srun) is done and exits
    r1.check(60)  # rank 1 reads the exit mark (its thread does so every beat)
    store.down = True
    assert r1.find_dead(wait_s=1, stale_s=0.2) is None


def test_a_late_registration_is_read_before_the_next_beat():
    """Rank 0 registers after rank 1's thread started; with a 5 s beat, rank 1 still has rank 0's
    host and pid within a second, so a death with the store (the torchrun node-0 case) names them."""
    store = FlakyStore()
    r1 = Heartbeat(store, 1, 2, {"node": 1}, step=lambda: 3, beat_s=5.0).start()
    try:
        time.sleep(0.3)
        r0 = Heartbeat(store, 0, 2, {"node": 0, "host": "node0-host", "pid": 4242}, step=lambda: 3, beat_s=5.0)
        store.set("who/0", __import__("json").dumps(r0.me))
        store.set("beat/0", "1 3")
        deadline = time.time() + 1.5
        while 0 not in r1.who and time.time() < deadline:
            time.sleep(0.05)
        assert r1.who.get(0, {}).get("host") == "node0-host" and r1.who[0]["pid"] == 4242
        store.down = True
        r1.store_failed_at = time.monotonic() - 10
        assert "host node0-host, pid 4242" in describe(r1._store_gone(stale_s=1.0))
    finally:
        r1._stop.set()
