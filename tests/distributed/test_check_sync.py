"""The checks' side channel (src/distributed/check_sync.py) on real gloo process groups: a check that
fails on some ranks never leaves the others inside its collective, and the ranks stay aligned.

Each scenario runs in 2 or 3 real processes (torch.multiprocessing, gloo, no Lightning): every rank plays
a script of check collectives ("agree, then all-reduce the payload on the default group") and failures
("notice"), and returns what it saw. A hang fails the test through the join timeout.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsdebug.distributed.check_sync import CheckAborted, ChecksDiverged, CheckSync


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collective(sync: CheckSync, check: int, log: list) -> None:
    """A check's collective as the helpers make it: agree, then the payload on the default group."""
    try:
        sync.agree(check)
    except CheckAborted:
        log.append(("aborted", check))
        return
    t = torch.ones(1)
    dist.all_reduce(t)
    log.append(("done", check, int(t.item())))


def _play_one(rank: int, script: str) -> dict:
    sync = CheckSync.create()  # a side group of its own per scenario
    log: list = []
    try:
        for kind, check in SCRIPTS[script][rank]:
            if kind == "fail":
                sync.notice(check)
                log.append(("failed", check))
            elif kind == "coll":
                _collective(sync, check, log)
            elif kind == "train":  # the training's own collective (default group), every rank
                t = torch.ones(1)
                dist.all_reduce(t)
                log.append(("train", int(t.item())))
        failed = sync.close()
    except ChecksDiverged as e:
        return {"diverged": str(e)}
    return {"log": log, "failed": sorted(failed), "headers": sync.headers}


def _play(rank: int, world: int, port: int, scripts: list[str], out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for script in scripts:  # one after the other, in the same processes
            out[(script, rank)] = _play_one(rank, script)
            dist.barrier()
    finally:
        dist.destroy_process_group()


# rank -> its ops. ("coll", c): a collective of check c; ("fail", c): check c raised here (its later ops on
# this rank are gone, as the guard drops them); ("train", None): the training's collective between hooks.
X, Y = 0, 1
SCRIPTS = {
    # rank 1's X raises before X's 2nd collective, which rank 0 is already in: rank 0's X is aborted there
    "fail_before_collective": {0: [("coll", X), ("coll", X), ("coll", Y), ("train", None), ("coll", Y)],
                               1: [("coll", X), ("fail", X), ("coll", Y), ("train", None), ("coll", Y)]},
    # rank 1's X raises after X's last collective: rank 0 meets the notice in Y's header, posts it again
    "fail_after_last_collective": {0: [("coll", X), ("coll", Y), ("train", None), ("coll", X), ("coll", Y)],
                                   1: [("coll", X), ("fail", X), ("coll", Y), ("train", None), ("coll", Y)]},
    # every rank fails X at once (a deterministic bug): the notices answer each other
    "fail_everywhere": {0: [("coll", X), ("fail", X), ("coll", Y), ("train", None), ("coll", Y)],
                        1: [("coll", X), ("fail", X), ("coll", Y), ("train", None), ("coll", Y)]},
    # a failure after every check's last collective: known everywhere at the close
    "fail_at_the_end": {0: [("coll", X), ("train", None)],
                        1: [("coll", X), ("train", None), ("fail", Y)]},
    # two checks fail on two ranks; the training's collectives in between never cross the checks'
    "two_failures": {0: [("coll", X), ("fail", Y), ("train", None), ("coll", X), ("train", None), ("coll", X)],
                     1: [("coll", X), ("coll", Y), ("train", None), ("fail", X), ("train", None)]},
    # a rank-rule bug: the ranks reach different checks' collectives with no failure to explain it
    "diverged": {0: [("coll", X)], 1: [("coll", Y)]},
}
THREE = {"three_ranks": {0: [("coll", X), ("coll", X), ("coll", Y)],
                         1: [("coll", X), ("fail", X), ("coll", Y)],
                         2: [("coll", X), ("coll", X), ("coll", Y)]}}
SCRIPTS.update(THREE)


def _spawn(world: int, scripts: list[str]) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Manager().dict()
    port = _port()
    procs = [ctx.Process(target=_play, args=(r, world, port, scripts, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, f"a rank hung in {scripts} (the side channel let a collective wait forever)"
    return dict(out)


@pytest.fixture(scope="module")
def played() -> dict:
    """Every scenario, played once: the 2-rank ones in one pair of processes, then the 3-rank one."""
    two = [s for s in SCRIPTS if s not in THREE]
    return {**_spawn(2, two), **_spawn(3, list(THREE))}


def _run(played: dict, script: str) -> dict:
    return {rank: v for (name, rank), v in played.items() if name == script}


def _done(log: list, check: int) -> list:
    return [e for e in log if e[0] == "done" and e[1] == check]


def test_a_check_failing_before_a_collective_the_other_rank_is_in_aborts_it_there(played):
    out = _run(played, "fail_before_collective")
    assert ("aborted", X) in out[0]["log"]  # rank 0 was inside X's 2nd collective's agreement
    assert len(_done(out[0]["log"], Y)) == 2 and len(_done(out[1]["log"], Y)) == 2
    assert all(e[2] == 2 for e in _done(out[0]["log"], Y))  # Y's payloads met: both ranks summed
    assert out[0]["failed"] == out[1]["failed"] == [X]


def test_a_notice_met_in_another_checks_header_is_answered_and_the_ranks_realign(played):
    out = _run(played, "fail_after_last_collective")
    assert _done(out[0]["log"], Y) and all(e[2] == 2 for e in _done(out[0]["log"], Y))
    assert ("aborted", X) in out[0]["log"]  # X's next collective, a step later, is dropped on rank 0
    assert ("train", 2) in out[0]["log"] and ("train", 2) in out[1]["log"]  # the training's collective paired
    assert out[0]["failed"] == out[1]["failed"] == [X]


def test_every_rank_failing_at_once_needs_no_realignment(played):
    out = _run(played, "fail_everywhere")
    for r in (0, 1):
        assert len(_done(out[r]["log"], Y)) == 2 and out[r]["failed"] == [X]


def test_a_failure_after_the_last_collective_is_known_everywhere_at_the_close(played):
    out = _run(played, "fail_at_the_end")
    assert out[0]["failed"] == out[1]["failed"] == [Y]


def test_two_checks_failing_on_two_ranks(played):
    out = _run(played, "two_failures")
    assert out[0]["failed"] == out[1]["failed"] == [X, Y]
    assert ("train", 2) in out[0]["log"] and out[0]["log"].count(("train", 2)) == 2


def test_three_ranks_two_alive_abort_together(played):
    out = _run(played, "three_ranks")
    assert ("aborted", X) in out[0]["log"] and ("aborted", X) in out[2]["log"]
    assert all(len(_done(out[r]["log"], Y)) == 1 and _done(out[r]["log"], Y)[0][2] == 3 for r in range(3))


def test_ranks_at_different_checks_with_no_failure_are_named_as_diverged(played):
    out = _run(played, "diverged")
    assert "diverged" in out[0] and "diverged" in out[1]
    assert "different check collectives" in out[0]["diverged"]


def test_one_process_has_no_side_channel():
    assert CheckSync.create() is None  # no process group here


def test_no_side_group_leaves_the_checks_without_agreement_and_says_so(monkeypatch, caplog):
    """A build whose gloo cannot make the side group: no side channel (the run goes on), one warning."""
    def no_gloo(*args, **kwargs):
        raise RuntimeError("planted: gloo is not available in this build")

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
    monkeypatch.setattr(dist, "new_group", no_gloo)
    monkeypatch.setattr("torch.distributed.distributed_c10d.get_backend", lambda *a, **k: "gloo")
    with caplog.at_level("WARNING", logger="dsdebug.distributed.check_sync"):
        assert CheckSync.create() is None
    assert "no side channel for the checks" in caplog.text and "planted" in caplog.text
