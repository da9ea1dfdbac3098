"""Failures without a parent process, under real torchrun on localhost: no rank is the parent of
another, so the ranks learn of a death through the rendezvous store (src/distributed/heartbeat.py).

- 1 node x 2: rank 1 SIGKILLs itself; torchrun's agent SIGTERMs rank 0 at once, while rank 0 is
  failing on gloo's 'Connection closed by peer' (the SIGTERM is held until the finding is written);
- 2 "nodes" x 1, each node with its own run dir: rank 1 dies (node 1's agent exits) while rank 0 is
  stuck outside any collective (its heartbeat thread ends it); or rank 0 dies (and with it node 0's
  agent and the store it hosts) and rank 1 names rank 0 and its host in its own run dir;
- 2 "nodes" x 1, own run dirs: comm_debug's hang watchdog still joins both ranks into one report
  (the store, not the filesystem) and each rank's flight-recorder dump is readable by torchfrtrace.

Every case measures how long the job took to end after the kill (printed) and holds it to the
60 s bound."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers.runs import REPO, SMOKE, TINY_NET
from tests.helpers.findings import read_findings

pytestmark = pytest.mark.slow

BASE = SMOKE + TINY_NET + [
    "strategy=ddp", "trainer.max_steps=50", "trainer.val_check_interval=100", "trainer.limit_val_batches=1",
    "export.hf=false", "export.fp32=false",
]
KILL = "+callbacks.kill._target_=tests.planted.comm.SigkillAtStep +callbacks.kill.step=3".split()
HOST = socket.gethostname()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC"))
           and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")}
    return {**env, "DSDEBUG_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"}


def _torchrun(tmp: Path, cache: Path, nodes: int, per_node: int, args: list[str]) -> list[tuple[subprocess.Popen, Path]]:
    """Start one torchrun per node (node n writes its run dir to tmp/node<n>); returns (process, stderr file)."""
    port, started = _free_port(), []
    for node in range(nodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc_per_node",
               str(per_node), "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port),
               str(REPO / "train.py"), f"trainer.devices={per_node}", f"trainer.num_nodes={nodes}",
               f"hydra.run.dir={tmp / f'node{node}'}", *args]
        err = tmp / f"stderr{node}.txt"
        with open(tmp / f"stdout{node}.txt", "w") as out, open(err, "w") as errf:
            started.append((subprocess.Popen(cmd, cwd=REPO, env=_env(cache), stdout=out, stderr=errf), err))
    return started


def _finish(started: list[tuple[subprocess.Popen, Path]], tmp: Path, timeout: float = 300) -> list[int]:
    codes = []
    try:
        for proc, _ in started:
            codes.append(proc.wait(timeout=timeout))
    finally:
        for proc, _ in started:
            if proc.poll() is None:  # the test failed: leave nothing running
                for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
                    p.kill()
    leftovers = [p.pid for p in psutil.process_iter(["cmdline"]) if str(tmp) in " ".join(p.info["cmdline"] or [])]
    assert not leftovers, f"processes of the job left behind: {leftovers}"
    return codes


def _ended_after_kill(tmp: Path) -> float:
    took = time.time() - float((tmp / "killed_at").read_text())
    print(f"every process of the job gone {took:.1f} s after the SIGKILL")
    return took


def _died(run_dir: Path) -> list[dict]:
    return [f for f in read_findings(run_dir) if f["code"] == "rank_died"]


STUCK_RANK_0 = ["+callbacks.stuck._target_=tests.planted.comm.SleepOnRank", "+callbacks.stuck.rank=0",
                "+callbacks.stuck.step=3", "+callbacks.stuck.seconds=600"]


def _assert_named(run_dir: Path, stderr: str, rank: int, node: int) -> None:
    died = _died(run_dir)
    assert len(died) == 1, read_findings(run_dir)
    assert died[0]["rank"] == rank and died[0]["step"] == 3 and died[0]["details"]["host"] == HOST, died
    assert died[0]["message"].startswith(f"rank {rank} (host {HOST}, pid ") and f", node {node})" in died[0]["message"]
    ours = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert ours and ours[-1].startswith(f"error: rank {rank} (host {HOST}, pid "), stderr[-3000:]
    assert f'File "{REPO}/src' not in stderr, "a traceback of ours instead of the one-line error"


def test_one_node_sigkill_of_rank_1_ends_the_job_with_rank_and_host_named(tmp_path, shared_cache):
    """torchrun's agent SIGTERMs rank 0 while it fails on gloo's error: it still writes the finding."""
    args = BASE + KILL + ["+callbacks.kill.rank=1", f"+callbacks.kill.stamp={tmp_path / 'killed_at'}"]
    started = _torchrun(tmp_path, shared_cache, nodes=1, per_node=2, args=args)
    (code,) = _finish(started, tmp_path)
    took = _ended_after_kill(tmp_path)
    assert code != 0
    assert took < 60, took
    _assert_named(tmp_path / "node0", started[0][1].read_text(), rank=1, node=0)
    assert json.loads((tmp_path / "node0" / "crash.json").read_text())["status"] == "rank_died"


@pytest.mark.parametrize("victim", [1, 0])
def test_two_nodes_sigkill_is_named_by_the_survivor_in_its_own_run_dir(victim, tmp_path, shared_cache):
    """victim 1: node 1's agent exits, rank 0 is stuck outside any collective (so only its heartbeat
    thread can end it). victim 0: node 0's agent exits with the store it hosts; rank 1 fails on gloo's
    error and names rank 0."""
    args = BASE + KILL + [f"+callbacks.kill.rank={victim}", f"+callbacks.kill.stamp={tmp_path / 'killed_at'}"]
    started = _torchrun(tmp_path, shared_cache, nodes=2, per_node=1, args=args + (STUCK_RANK_0 if victim else []))
    codes = _finish(started, tmp_path)
    took = _ended_after_kill(tmp_path)
    assert all(code != 0 for code in codes), codes
    assert took < 60, took
    survivor = 1 - victim
    _assert_named(tmp_path / f"node{survivor}", started[survivor][1].read_text(), rank=victim, node=victim)
    assert not _died(tmp_path / f"node{victim}")


def test_hang_watchdog_across_nodes_without_a_shared_run_dir(tmp_path, shared_cache):
    args = BASE + ["+callbacks=comm_debug", "callbacks.comm_debug.hang_timeout_s=8", "callbacks.comm_debug.hang_poll_s=1",
                   "+callbacks.plant._target_=tests.planted.comm.SleepOnRank", "+callbacks.plant.rank=1",
                   "+callbacks.plant.step=2", "+callbacks.plant.seconds=600"]
    started = _torchrun(tmp_path, shared_cache, nodes=2, per_node=1, args=args)
    codes = _finish(started, tmp_path)
    assert codes == [1, 1], codes  # each agent: its worker exited 124 (the agent itself says 1)
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    assert "exitcode  : 124" in started[0][1].read_text() and "exitcode  : 124" in started[1][1].read_text()
    hangs = [f for f in read_findings(node0) if f["code"] == "hang"]  # rank 0 reports, in its own dir
    assert len(hangs) == 1 and hangs[0]["rank"] == 1, read_findings(node0)
    assert "rank 1 is behind" in hangs[0]["message"] and "rank 0 waits in" in hangs[0]["message"]
    assert "torchfrtrace" in hangs[0]["advice"]
    assert not [f for f in read_findings(node1) if f["code"] == "hang"]
    assert not [f for f in read_findings(node0) + read_findings(node1) if f["code"] == "rank_died"], \
        "ranks ending on the watchdog's exit 124 are not dead ranks"
    assert "time.sleep(self.seconds)" in (node1 / "hang_rank1.txt").read_text()  # rank 1's stacks, its dir
    assert not list(tmp_path.rglob("comm_debug/*")), "heartbeat files: the store is the channel"
    # torch's analyzer reads the two nodes' dumps (gathered into one folder) and names rank 1
    gathered = tmp_path / "fr"
    gathered.mkdir()
    for rank, node in ((0, node0), (1, node1)):
        shutil.copy(node / "flight_recorder" / f"rank_{rank}", gathered)
    frtrace = Path(sys.executable).parent / "torchfrtrace"
    out = subprocess.run([str(frtrace), str(gathered), "-p", "rank_"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "missing ranks: {1}" in out.stdout + out.stderr, (out.stdout + out.stderr)[-3000:]
