"""Run train.py as a user would (or in this process), and read what a run wrote."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf"

# The tests' base: conf/experiment/smoke.yaml (a few steps on a slice of the default corpus, short
# validation, no progress bar, CSV logs). Overrides after it win: [*SMOKE, "trainer.max_steps=6"].
SMOKE = ["experiment=smoke"]
# A small plain net (embedding -> MLP -> head) for runs where the model is not what a test is
# about: a step costs a fraction of the tiny DeepSeek's (MoE routing, MLA) on 2 cores.
TINY_NET = ["model.net._target_=tests.planted.data.HealthyTinyLM"]
# The same DeepSeek-V3 architecture (MLA, MoE, first layer dense), smaller: for runs that need
# a Hugging Face model (its config feeds "auto" ds_config values) but not its size.
SMALL_DEEPSEEK = ["model.net.hidden_size=64", "model.net.num_hidden_layers=2"]


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


def compose_as_hydra_main(overrides: list[str], run_dir: Path, cache: Path):
    """The config ``@hydra.main`` hands the task function for ``train.py <overrides>``: composed with
    the hydra node, HydraConfig set (run dir, cwd, job name), then the hydra node dropped. The caller
    clears ``HydraConfig.instance().cfg`` when done (``train_in_process`` does)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    os.environ.setdefault("PROJECT_ROOT", str(REPO))
    os.environ["DSDEBUG_CACHE_DIR"] = str(cache)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(CONF), version_base="1.3"):
            cfg = compose("train", overrides=[*overrides, f"hydra.run.dir={run_dir}"], return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(run_dir)
        cfg.hydra.runtime.cwd = str(REPO)
        cfg.hydra.job.name = "train"
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]  # a task function never sees the hydra node
    run_dir.mkdir(parents=True, exist_ok=True)
    return cfg


def train_in_process(overrides: list[str], run_dir: Path, cache: Path) -> dict:
    """Compose and train in this process (no subprocess start-up): for 1-process runs only. As under
    ``train.py``, INFO lines of every logger are written to ``<run_dir>/train.log`` (Hydra's job logging).
    The process's environment and torch thread count are put back afterwards (a fit changes both:
    OMP_NUM_THREADS, PL_GLOBAL_SEED, DS_ACCELERATOR, ...), also when called from a fixture of a wider
    scope than conftest's per-test restore: later ``train.py`` runs must not inherit them."""
    import logging

    import torch
    from hydra.core.hydra_config import HydraConfig

    from dsdebug.config.prepare import prepare
    from dsdebug.trainer.entry import train

    root, handler = logging.getLogger(), None
    level, env, threads = root.level, dict(os.environ), torch.get_num_threads()
    try:
        cfg = compose_as_hydra_main(overrides, run_dir, cache)
        handler = logging.FileHandler(run_dir / "train.log")
        handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        return train(prepare(cfg))
    finally:
        if handler is not None:
            root.removeHandler(handler)
            handler.close()
        root.setLevel(level)
        HydraConfig.instance().cfg = None  # later tests must not see this run's cwd/output dir
        if dict(os.environ) != env:
            os.environ.clear()
            os.environ.update(env)
        torch.set_num_threads(threads)
