"""Shared test helpers: run train.py as a user would, and read what a run wrote."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"

# A few steps of real training on a slice of the default corpus; no progress bar, CSV logs.
FAST = [
    "trainer.max_steps=4",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=2",
    "trainer.enable_progress_bar=false",
    "trainer.log_every_n_steps=1",
    "~callbacks.rich_progress_bar",
    "data.max_tokens=60000",
    "logger=csv",
]
# A small plain net (embedding -> MLP -> head) for runs where the model is not what a test is
# about: a step costs a fraction of the tiny DeepSeek's (MoE routing, MLA) on 2 cores.
TINY_NET = ["model.net._target_=tests.planted_data.HealthyTinyLM"]
# The same DeepSeek-V3 architecture (MLA, MoE, first layer dense), smaller: for runs that need
# a Hugging Face model (its config feeds "auto" ds_config values) but not its size.
SMALL_DEEPSEEK = ["model.net.hidden_size=64", "model.net.num_hidden_layers=2"]


@pytest.fixture(autouse=True)
def _restore_process_env():
    """Every test starts from the session's environment and torch thread count. An in-process fit
    changes both for the rest of the process (Lightning's CPU DDP sets OMP_NUM_THREADS=<cores per
    process>, seed_everything sets PL_GLOBAL_SEED, ...), and every later `python train.py` this
    process starts would inherit them: a 2-process run then used 2 threads per rank instead of
    Lightning's 1, and two runs of the same config differed in the last bit of one logged loss."""
    import torch

    saved, threads = dict(os.environ), torch.get_num_threads()
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory) -> Path:
    """One tokenizer/token cache for the whole session (trained once, ~2 s)."""
    return tmp_path_factory.mktemp("cache")


def run_train(args: list[str], log_dir: Path, cache: Path, timeout: int = 400,
              env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``python train.py <args> paths.log_dir=<log_dir>``; returns the finished process."""
    full_env = {**os.environ, "DSDEBUG_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1", **(env or {})}
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"):
        full_env.pop(key, None)
    cmd = [sys.executable, str(REPO / "train.py"), *args, f"paths.log_dir={log_dir}"]
    return subprocess.run(cmd, cwd=cwd or REPO, env=full_env, capture_output=True, text=True, timeout=timeout)


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-6000:]}"


def run_dirs(log_dir: Path) -> list[Path]:
    return sorted((log_dir / "train" / "runs").glob("*"))


def only_run_dir(log_dir: Path) -> Path:
    dirs = run_dirs(log_dir)
    assert len(dirs) == 1, f"expected exactly one run dir, got {dirs}"
    return dirs[0]


def metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def train_losses(run_dir: Path) -> dict[int, float]:
    """step -> train/loss from the CSV logger (logged every step by the tests' configs)."""
    out = {}
    with open(run_dir / "csv" / "metrics.csv") as f:
        for row in csv.DictReader(f):
            if row.get("train/loss"):
                out[int(row["step"])] = float(row["train/loss"])
    return out


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def train_in_process(overrides: list[str], run_dir: Path, cache: Path) -> dict:
    """Compose and train in this process (no subprocess start-up): for 1-process runs only."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from dsdebug.config.prepare import prepare
    from dsdebug.trainer.entry import train

    os.environ.setdefault("PROJECT_ROOT", str(REPO))
    os.environ["DSDEBUG_CACHE_DIR"] = str(cache)
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, f"hydra.run.dir={run_dir}"], return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(run_dir)
        cfg.hydra.runtime.cwd = str(REPO)
        cfg.hydra.job.name = "train"
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]  # a task function never sees the hydra node
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        return train(prepare(cfg))
    finally:
        GlobalHydra.instance().clear()
        HydraConfig.instance().cfg = None  # later tests must not see this run's cwd/output dir
