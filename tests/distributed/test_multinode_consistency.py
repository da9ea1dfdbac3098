"""Two real torchrun "nodes" x 1 process on localhost, each with its own (node-local) run dir, node 1
started with another OMP_NUM_THREADS, an NCCL_* variable, a secret-looking NCCL_* variable and
another seed. One run serves every assertion here (~45 s): the consistency warnings name the key,
the rank and its host; rank 0's run dir still gets rank 1's findings, marker and timeline lines;
the report lists both ranks; log lines carry the host. A healthy 2-process run (the shared one)
stays silent and writes no line twice."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.runs import REPO, SMOKE, TINY_NET
from tests.helpers.shared_runs import healthy_run

pytestmark = pytest.mark.slow

HOST = socket.gethostname()
SECRET = "hunter2-do-not-print"
ARGS = [*SMOKE, *TINY_NET,
        "trainer.max_steps=3", "trainer.val_check_interval=3", "trainer.limit_val_batches=1", "strategy=ddp",
        "export.hf=false", "export.fp32=false", "trainer.devices=1", "trainer.num_nodes=2",
        "+callbacks=log_sync", "callbacks.log_sync.every_n_steps=2",
        "+callbacks.plant._target_=tests.planted.ranks.ReportOnRank"]  # an info finding on rank 1 only
NODE_ENV = [{"OMP_NUM_THREADS": "1"},
            {"OMP_NUM_THREADS": "2", "NCCL_IB_DISABLE": "1", "NCCL_TEST_PASSWORD": SECRET}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, shared_cache):
    root = tmp_path_factory.mktemp("two_nodes")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC", "NCCL_"))
            and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                          "OMP_NUM_THREADS")}
    port, procs = _free_port(), []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
               "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port),
               str(REPO / "train.py"), *ARGS, f"paths.log_dir={root}", f"hydra.run.dir={root / f'node{node}'}",
               *(["seed=43"] if node else [])]
        env = {**base, "DSDEBUG_CACHE_DIR": str(shared_cache), "PYTHONUNBUFFERED": "1", **NODE_ENV[node]}
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, f"exit {p.returncode}\n{out[-3000:]}\n{err[-6000:]}"
    return root, outs


def _findings(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "findings.jsonl").read_text().splitlines()]


def test_a_node_with_other_env_and_seed_is_named(two_nodes):
    root, _ = two_nodes
    warnings = {f["details"]["key"]: f for f in _findings(root / "node0") if f["check"] == "consistency"}
    assert {"env.OMP_NUM_THREADS", "env.NCCL_IB_DISABLE", "env.NCCL_TEST_PASSWORD", "seed", "config"} <= set(warnings)
    omp = warnings["env.OMP_NUM_THREADS"]
    assert omp["severity"] == "warning" and omp["code"] == "env_mismatch" and omp["rank"] == 1
    assert omp["message"] == (f"OMP_NUM_THREADS differs across ranks: rank 1 (host {HOST}) has '2'; "
                              f"rank 0 (host {HOST}) has '1'")
    assert warnings["env.NCCL_IB_DISABLE"]["message"].startswith(f"NCCL_IB_DISABLE differs across ranks: rank 1 "
                                                                 f"(host {HOST}) has '1'; rank 0")
    assert warnings["seed"]["code"] == "seed_mismatch" and warnings["seed"]["rank"] == 1
    assert f"rank 1 (host {HOST}) has 43" in warnings["seed"]["message"]
    assert warnings["config"]["message"].endswith("differing keys: data.seed")  # data.seed: ${seed}
    assert "***" in warnings["env.NCCL_TEST_PASSWORD"]["message"]


def test_secret_values_reach_no_output(two_nodes):
    root, outs = two_nodes
    assert all(SECRET not in text for pair in outs for text in pair)
    for path in root.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path


def test_rank0_node_local_dir_gets_rank1_findings_and_report_lists_both(two_nodes):
    root, _ = two_nodes
    node0, node1 = root / "node0", root / "node1"
    planted = [f for f in _findings(node0) if f["code"] == "planted_on_rank"]
    assert [(f["rank"], f["message"]) for f in planted] == [(1, "planted on rank 1")]  # arrived, once
    assert [f["code"] for f in _findings(node1)] == ["planted_on_rank"]  # node 1 keeps its own copy
    world = json.loads((node0 / "ranks" / "world.json").read_text())
    assert [(e["rank"], e["host"], e["shared"], e.get("collected")) for e in world["ranks"]] == [
        (0, HOST, True, None), (1, HOST, False, True)]
    assert json.loads((node0 / "ranks" / "rank1.json").read_text())["run_dir"] == str(node1.resolve())
    report = (node0 / "report.md").read_text()
    assert (f"| ranks heard from | 2 of 2: ranks 0-1 (host {HOST}); rank 1 collected through the process group "
            "(node-local run dir) |") in report
    assert "not heard from" not in report
    # the findings section shows rank 1's finding
    assert "planted/planted_on_rank" in report


def test_timeline_covers_both_nodes_and_log_lines_carry_the_host(two_nodes):
    root, _ = two_nodes
    merged = (root / "node0" / "logs_merged.log").read_text().splitlines()
    assert any(f" [rank 1] [{HOST}] " in line for line in merged)
    assert any(f" [rank 0] [{HOST}] " in line for line in merged)
    for node, log in (("node0", "train.log"), ("node1", "rank1.log")):  # rank r > 0 logs to rank<r>.log
        lines = (root / node / log).read_text().splitlines()
        assert lines and all(line.startswith("[") and f"][{HOST}][" in line for line in lines if line[:2] == "[2")


def test_healthy_two_process_run_is_silent_and_writes_nothing_twice(tmp_path_factory, shared_cache):
    run_dir, _ = healthy_run("ddp", tmp_path_factory, shared_cache)  # shared: debug=full, 2 processes, one dir
    lines = (run_dir / "findings.jsonl").read_text().splitlines()
    assert len(lines) == len(set(lines))
    assert [json.loads(line) for line in lines if json.loads(line)["check"] == "consistency"] == []
    world = json.loads((run_dir / "ranks" / "world.json").read_text())
    assert [(e["rank"], e["shared"], "collected" in e) for e in world["ranks"]] == [(0, True, False), (1, True, False)]
    assert f"| ranks heard from | 2 of 2: ranks 0-1 (host {HOST}) |" in (run_dir / "report.md").read_text()
