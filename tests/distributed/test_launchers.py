"""The same train.py under the launchers people use: torchrun (one node x 2 processes, and two
"nodes" x 1 process on localhost), SLURM's srun (its variables, two tasks as srun starts them)
and DeepSpeed's ``deepspeed --num_gpus 2`` (which appends ``--local_rank=<n>``).

Each run is the shared healthy debug=full DDP run's command line (tests/helpers/shared_runs.py), with
default paths: no ``hydra.run.dir``, no ``trainer.num_nodes`` (the preset's ``trainer.devices=2``
is adopted to the launcher's processes per node). Each must exit 0, write ONE run dir holding
every rank's files, train bit for bit what our own launcher trains, keep debug=full silent and
have findings and report that cover both ranks."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.runs import REPO, train_losses
from tests.helpers.shared_runs import ENV, HEALTHY, healthy_run

ARGS = HEALTHY["ddp"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC", "DSDEBUG_RUN"))
           and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")}
    return {**env, **ENV, "DSDEBUG_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1", **extra}


def _train(log_dir: Path) -> list[str]:
    return [str(REPO / "train.py"), *ARGS, f"paths.log_dir={log_dir}"]


def _wait(procs: list[subprocess.Popen], timeout: int = 600) -> list[tuple[int, str]]:
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        outs.append((p.returncode, out))
    return outs


def launch(kind: str, log_dir: Path, cache: Path) -> list[tuple[int, str]]:
    """Start the job as a user would; [(exit code, output)] per launcher process."""
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    port = str(_free_port())
    common = dict(cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if kind == "torchrun_1x2":
        cmds = [[*torchrun, "--nproc_per_node", "2", "--master_port", port, *_train(log_dir)]]
        return _wait([subprocess.Popen(c, env=_env(cache), **common) for c in cmds])
    if kind == "torchrun_2x1":
        cmds = [[*torchrun, "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(r),
                 "--master_addr", "127.0.0.1", "--master_port", port, *_train(log_dir)] for r in (0, 1)]
        # two "nodes" sharing one 2-core machine: a core each. Left alone, each node's single rank takes
        # both cores (torchrun sets OMP_NUM_THREADS only for nproc_per_node > 1, Lightning sizes threads by
        # the local ranks), and 2-thread matmuls differ in the last bit from the 1-thread reference on
        # CPUs with AVX512 kernels (seen on an Intel Xeon, not on the AMD EPYC this test was written on)
        env = {**_env(cache), "OMP_NUM_THREADS": "1"}
        return _wait([subprocess.Popen(c, env=env, **common) for c in cmds])
    if kind == "srun":  # what srun sets per task (one node, two tasks); Lightning derives the port from the job id
        job = str(int(port) - 15000) if 15000 < int(port) < 25000 else "4242"
        slurm = {"SLURM_NTASKS": "2", "SLURM_NNODES": "1", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NODEID": "0",
                 "SLURM_JOB_ID": job, "SLURM_JOB_NAME": "train.sbatch", "SLURM_NODELIST": "localhost"}
        if job == "4242":
            slurm["MASTER_PORT"] = port
        procs = [subprocess.Popen([sys.executable, *_train(log_dir)], env=_env(
            cache, **slurm, SLURM_PROCID=str(r), SLURM_LOCALID=str(r)), **common) for r in (0, 1)]
        return _wait(procs)
    if kind == "deepspeed":
        launcher = shutil.which("deepspeed", path=str(Path(sys.executable).parent))
        cmd = [launcher, "--num_gpus", "2", "--master_port", port, *_train(log_dir)]
        return _wait([subprocess.Popen(cmd, env=_env(cache), **common)])
    raise ValueError(kind)


KINDS = ["torchrun_1x2", "torchrun_2x1", "srun", "deepspeed"]
_runs: dict[str, tuple[Path, list[tuple[int, str]]]] = {}


def launched(kind: str, tmp_path_factory, cache: Path) -> tuple[Path, list[tuple[int, str]]]:
    if kind not in _runs:
        log_dir = tmp_path_factory.mktemp(kind)
        _runs[kind] = (log_dir, launch(kind, log_dir, cache))
    return _runs[kind]


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_launcher_trains_one_run_in_one_dir_like_our_launcher(kind, tmp_path_factory, shared_cache):
    log_dir, results = launched(kind, tmp_path_factory, shared_cache)
    for code, out in results:
        assert code == 0, out[-6000:]
        assert "Traceback" not in out, out[-6000:]
    runs = sorted((log_dir / "train" / "runs").iterdir())
    assert len(runs) == 1, runs  # one dir for the job, agreed by every rank of every node
    run = runs[0]
    if kind == "srun":
        assert run.name.startswith("slurm-")  # the job's id: a requeued job lands here again
    assert (run / "train.log").is_file() and (run / "rank1.log").is_file()
    assert (run / ".hydra" / "config.yaml").is_file()
    metrics = json.loads((run / "metrics.json").read_text())
    assert (metrics["world_size"], metrics["global_step"], metrics["status"]) == (2, 6, "completed")
    reference, _ = healthy_run("ddp", tmp_path_factory, shared_cache)  # our own launcher, trainer=ddp_sim
    assert train_losses(run) == train_losses(reference)  # bit for bit
    records = [json.loads(line) for line in (run / "findings.jsonl").read_text().splitlines()]
    bad = [r for r in records if r["severity"] != "info"]
    assert bad == [], json.dumps(bad, indent=1)[:3000]  # debug=full on a healthy run: silent
    assert {r["rank"] for r in records} >= {0, 1}  # both ranks reported into the one channel
    report = (run / "report.md").read_text()
    assert "| key | rank 0 | rank 1 |" in report  # the environment of both ranks
    assert "top_ops_rank1" in report  # rank 1's profiler trace reached the report
