"""A config that contradicts the launcher's world (torchrun, srun) is the framework's one-line error,
not a Lightning traceback. Real torchrun (one node, and two nodes on localhost), and SLURM's
variables as srun sets them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from tests.conftest import REPO


def _env(cache, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC"))
           and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")}
    return {**env, "DSDEBUG_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1", **extra}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ours(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error: trainer.devices")]


def test_torchrun_one_node_without_devices_is_one_line(tmp_path, shared_cache):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(_free_port())]
    proc = subprocess.run([*torchrun, str(REPO / "train.py"), f"paths.log_dir={tmp_path}"], cwd=REPO,
                          env=_env(shared_cache), capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    assert _ours(proc.stderr) == ["error: trainer.devices=1 x trainer.num_nodes=1 does not match the processes "
                                  "torchrun started (WORLD_SIZE=2, LOCAL_WORLD_SIZE=2); valid: trainer.devices=2 "
                                  "trainer.num_nodes=1"]  # once: only rank 0 prints
    assert not (tmp_path / "train").exists() or not any((tmp_path / "train").rglob("*.ckpt"))


def test_torchrun_two_nodes_without_num_nodes_is_one_line(tmp_path, shared_cache):
    port = _free_port()
    nodes = []
    for node_rank in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
               "--node_rank", str(node_rank), "--master_addr", "127.0.0.1", "--master_port", str(port),
               str(REPO / "train.py"), f"paths.log_dir={tmp_path}"]
        nodes.append(subprocess.Popen(cmd, cwd=REPO, env=_env(shared_cache), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=180) for p in nodes]
    assert all(p.returncode != 0 for p in nodes)
    node0 = _ours(outs[0][1])
    assert node0 == ["error: trainer.devices=1 x trainer.num_nodes=1 does not match the processes torchrun started "
                     "(WORLD_SIZE=2, LOCAL_WORLD_SIZE=1); valid: trainer.devices=1 trainer.num_nodes=2"]
    assert _ours(outs[1][1]) == []  # rank 1 (node 1) stays quiet


def test_srun_variables_without_num_nodes_are_one_line(tmp_path, shared_cache):
    slurm = {"SLURM_NTASKS": "4", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": "0",
             "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "42",
             "SLURM_NODELIST": "localhost"}
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), "trainer.devices=2", f"paths.log_dir={tmp_path}"],
                          cwd=REPO, env=_env(shared_cache, **slurm), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert _ours(proc.stderr) == ["error: trainer.devices=2 x trainer.num_nodes=1 does not match the processes srun "
                                  "started (SLURM_NTASKS=4, SLURM_NNODES=2); valid: trainer.devices=2 "
                                  "trainer.num_nodes=2"]
    assert "Traceback" not in proc.stderr
