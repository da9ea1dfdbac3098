"""The launcher's world (torchrun, srun, deepspeed) is adopted into trainer.devices/num_nodes; a value
given explicitly that contradicts it is the framework's one-line error, not a Lightning traceback.
Real torchrun (one node, and two nodes on localhost), and SLURM's variables as srun sets them;
the detection and the adoption in-process. (Full runs under each launcher: tests/distributed/test_launchers.py.)"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tests.helpers.runs import REPO


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


@pytest.mark.slow  # a real launcher; the same lines in-process: test_a_value_against_the_launchers_world_is_one_line
def test_torchrun_one_node_with_contradicting_devices_is_one_line(tmp_path, shared_cache):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(_free_port())]
    proc = subprocess.run([*torchrun, str(REPO / "train.py"), "trainer.devices=1", f"paths.log_dir={tmp_path}"],
                          cwd=REPO,
                          env=_env(shared_cache), capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    assert _ours(proc.stderr) == ["error: trainer.devices=1 x trainer.num_nodes=1 does not match the processes "
                                  "torchrun started (WORLD_SIZE=2, LOCAL_WORLD_SIZE=2); valid: trainer.devices=2 "
                                  "trainer.num_nodes=1 (or leave both out: the launcher's world is used)"]  # once
    assert not (tmp_path / "train").exists() or not any((tmp_path / "train").rglob("*.ckpt"))


@pytest.mark.slow  # a real launcher; the same lines in-process: test_a_value_against_the_launchers_world_is_one_line
def test_torchrun_two_nodes_with_contradicting_num_nodes_is_one_line(tmp_path, shared_cache):
    port = _free_port()
    nodes = []
    for node_rank in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
               "--node_rank", str(node_rank), "--master_addr", "127.0.0.1", "--master_port", str(port),
               str(REPO / "train.py"), "trainer.num_nodes=1", f"paths.log_dir={tmp_path}"]
        nodes.append(subprocess.Popen(cmd, cwd=REPO, env=_env(shared_cache), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=180) for p in nodes]
    assert all(p.returncode != 0 for p in nodes)
    node0 = _ours(outs[0][1])
    assert node0 == ["error: trainer.devices=1 x trainer.num_nodes=1 does not match the processes torchrun started "
                     "(WORLD_SIZE=2, LOCAL_WORLD_SIZE=1); valid: trainer.devices=1 trainer.num_nodes=2 (or leave both "
                     "out: the launcher's world is used)"]
    assert _ours(outs[1][1]) == []  # rank 1 (node 1) stays quiet


@pytest.mark.slow  # the command line under srun's variables; in-process: test_a_value_against_the_launchers_world_is_one_line
def test_srun_variables_with_contradicting_num_nodes_are_one_line(tmp_path, shared_cache):
    slurm = {"SLURM_NTASKS": "4", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": "0",
             "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "42",
             "SLURM_NODELIST": "localhost"}
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), "trainer.devices=2", "trainer.num_nodes=1",
                           f"paths.log_dir={tmp_path}"],
                          cwd=REPO, env=_env(shared_cache, **slurm), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert _ours(proc.stderr) == ["error: trainer.devices=2 x trainer.num_nodes=1 does not match the processes srun "
                                  "started (SLURM_NTASKS=4, SLURM_NNODES=2); valid: trainer.devices=2 "
                                  "trainer.num_nodes=2 (or leave both out: the launcher's world is used)"]
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------ in-process: detection and adoption
def _cfg(devices=1, num_nodes=1):
    from omegaconf import OmegaConf

    return OmegaConf.create({"trainer": {"devices": devices, "num_nodes": num_nodes}})


TORCHRUN_2X2 = {"TORCHELASTIC_RUN_ID": "none", "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4",
                "LOCAL_WORLD_SIZE": "2"}
DEEPSPEED_2X2 = {"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "CROSS_RANK": "1", "CROSS_SIZE": "2",
                 "LOCAL_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
SRUN_2X2 = {"SLURM_NTASKS": "4", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "2(x2)", "SLURM_PROCID": "1",
            "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "77"}


def test_detect_names_each_launcher_and_its_world():
    from dsdebug.distributed.launch_env import detect

    got = {name: detect(env) for name, env in
           (("torchrun", TORCHRUN_2X2), ("deepspeed", DEEPSPEED_2X2), ("srun", SRUN_2X2))}
    assert {n: (w.launcher, w.world, w.per_node, w.nodes, w.rank) for n, w in got.items()} == {
        "torchrun": ("torchrun", 4, 2, 2, 3), "deepspeed": ("deepspeed", 4, 2, 2, 2), "srun": ("srun", 4, 2, 2, 1)}
    assert detect({}) is None  # python train.py
    assert detect({**SRUN_2X2, "SLURM_JOB_NAME": "bash"}) is None  # salloc's interactive shell: not a launch
    assert detect({"LOCAL_RANK": "1", "RANK": "1", "WORLD_SIZE": "2", "DSDEBUG_LAUNCHER_PID": "9"}) is None  # ours


@pytest.mark.parametrize("env", [TORCHRUN_2X2, DEEPSPEED_2X2, SRUN_2X2], ids=["torchrun", "deepspeed", "srun"])
def test_the_launchers_world_replaces_the_configs_defaults(env, monkeypatch):
    from dsdebug.distributed.launch_env import launcher_world

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    cfg = _cfg(devices=1, num_nodes=1)  # trainer=cpu's values, not given on the command line
    assert launcher_world(cfg) == {"devices": 2, "num_nodes": 2}
    assert (cfg.trainer.devices, cfg.trainer.num_nodes) == (1, 1)  # written by prepare, not by the check
    cfg = _cfg(devices="auto", num_nodes=2)
    assert launcher_world(cfg) == {"devices": 2}
    cfg = _cfg(devices=2, num_nodes=2)
    assert launcher_world(cfg) == {}


def test_deepspeeds_local_rank_argument_is_taken_off_hydras_command_line(monkeypatch):
    from dsdebug.distributed.run_dir import strip_local_rank

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert strip_local_rank(["--local_rank=1", "strategy=zero2", "trainer.max_steps=3"]) == [
        "strategy=zero2", "trainer.max_steps=3"]
    assert os.environ["LOCAL_RANK"] == "1"
    assert strip_local_rank(["a=1", "--local-rank", "0", "b=2"]) == ["a=1", "b=2"]
    assert os.environ["LOCAL_RANK"] == "1"  # the launcher's env var wins over the argument


def test_slurm_run_id_is_the_job_or_array_task():
    from dsdebug.distributed.run_dir import slurm_run_id

    assert slurm_run_id({"SLURM_JOB_ID": "123"}) == "slurm-123"
    assert slurm_run_id({"SLURM_JOB_ID": "124", "SLURM_ARRAY_JOB_ID": "120", "SLURM_ARRAY_TASK_ID": "4"}) == "slurm-120_4"
    assert slurm_run_id({}) is None


# docs/bad_inputs.md rows 73-75 in-process (the real launchers above: make test-all): rank 0's env as each
# launcher sets it, and a config value against it
TORCHRUN_1X2_RANK0 = {"TORCHELASTIC_RUN_ID": "none", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
                      "LOCAL_WORLD_SIZE": "2"}
TORCHRUN_2X1_RANK0 = {**TORCHRUN_1X2_RANK0, "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0"}
SRUN_2X2_RANK0 = {"SLURM_NTASKS": "4", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": "0",
                  "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "42",
                  "SLURM_NODELIST": "localhost"}


@pytest.mark.parametrize("env, overrides, line", [
    (TORCHRUN_1X2_RANK0, ["trainer.devices=1"],
     "error: trainer.devices=1 x trainer.num_nodes=1 does not match the processes torchrun started (WORLD_SIZE=2, "
     "LOCAL_WORLD_SIZE=2); valid: trainer.devices=2 trainer.num_nodes=1 (or leave both out: the launcher's world "
     "is used)"),
    (TORCHRUN_2X1_RANK0, ["trainer.num_nodes=1"],
     "error: trainer.devices=1 x trainer.num_nodes=1 does not match the processes torchrun started (WORLD_SIZE=2, "
     "LOCAL_WORLD_SIZE=1); valid: trainer.devices=1 trainer.num_nodes=2 (or leave both out: the launcher's world "
     "is used)"),
    (SRUN_2X2_RANK0, ["trainer.devices=2", "trainer.num_nodes=1"],
     "error: trainer.devices=2 x trainer.num_nodes=1 does not match the processes srun started (SLURM_NTASKS=4, "
     "SLURM_NNODES=2); valid: trainer.devices=2 trainer.num_nodes=2 (or leave both out: the launcher's world is "
     "used)"),
], ids=["torchrun_one_node_devices", "torchrun_two_nodes_num_nodes", "srun_two_nodes_num_nodes"])
def test_a_value_against_the_launchers_world_is_one_line(env, overrides, line, tmp_path, shared_cache, capsys,
                                                          monkeypatch):
    from tests.helpers.bad_input import cli_error_lines

    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert cli_error_lines(overrides, tmp_path, shared_cache, capsys) == [line]
