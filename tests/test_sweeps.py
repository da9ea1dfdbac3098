"""Hydra multirun with 2-process DeepSpeed jobs, a failing job, and an Optuna sweep."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import run_train

QUICK = [
    "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
    "trainer.enable_progress_bar=false", "~callbacks.rich_progress_bar", "data.max_tokens=60000",
    "logger=csv", "export.hf=false", "export.fp32=false",
]


def _sweep_dir(log_dir: Path) -> Path:
    dirs = list((log_dir / "train" / "multiruns").iterdir())
    assert len(dirs) == 1, dirs
    return dirs[0]


@pytest.mark.slow
def test_multirun_of_two_process_deepspeed_jobs(tmp_path, shared_cache):
    proc = run_train(["-m", "optim.lr=1e-3,3e-3", "strategy=zero2,zero3", "trainer=ddp_sim", *QUICK],
                     tmp_path, shared_cache, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    sweep = _sweep_dir(tmp_path)
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [p.name for p in jobs] == ["0", "1", "2", "3"]
    assert not (tmp_path / "train" / "runs").exists(), "a rank created a run dir of its own"
    seen = set()
    for job in jobs:
        m = json.loads((job / "metrics.json").read_text())
        assert m["world_size"] == 2 and m["global_step"] == 2
        assert (job / "rank1.log").is_file() and not list(job.glob("*/.hydra"))
        overrides = (job / ".hydra" / "overrides.yaml").read_text()
        seen.add((m["zero_stage"], "optim.lr=0.001" in overrides))
    assert seen == {(2, True), (2, False), (3, True), (3, False)}
    summary = json.loads((sweep / "sweep_summary.json").read_text())
    assert [r["status"] for r in summary] == ["completed"] * 4


@pytest.mark.slow
def test_a_failed_job_does_not_stop_the_sweep(tmp_path, shared_cache):
    proc = run_train(["-m", "optim.lr=-1,1e-3", *QUICK], tmp_path, shared_cache, timeout=600)
    assert proc.returncode == 1  # the sweep reports the failure ...
    summary = json.loads((_sweep_dir(tmp_path) / "sweep_summary.json").read_text())
    assert [r["status"] for r in summary] == ["failed", "completed"]  # ... after running every job
    assert summary[0]["returncode"] == 2 and isinstance(summary[1]["value"], float)
    assert "optim.lr must be a positive number" in proc.stderr


@pytest.mark.slow
def test_optuna_sweep_of_three_trials(tmp_path, shared_cache):
    proc = run_train(["hparams_search=optuna", "hydra.sweeper.n_trials=3", "hydra.sweeper.sampler.n_startup_trials=2",
                      *QUICK], tmp_path, shared_cache, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    sweep = _sweep_dir(tmp_path)
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1", "2"]
    values = [json.loads((sweep / j / "metrics.json").read_text())["val/loss"] for j in "012"]
    lrs = {o for j in "012" for o in json.loads((sweep / j / "job_status.json").read_text())["overrides"]
           if o.startswith("optim.lr=")}
    assert len(lrs) == 3, lrs  # three different sampled learning rates
    results = (sweep / "optimization_results.yaml").read_text()
    assert "best_value" in results and f"{min(values):.4f}"[:5] in results
