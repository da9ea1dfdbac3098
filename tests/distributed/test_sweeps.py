"""Hydra multirun with 2-process DeepSpeed jobs and failing jobs (one sweep, shared with
tests/distributed/test_distributed.py: tests/helpers/shared_runs.py), and an Optuna sweep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.runs import SMOKE, TINY_NET, run_train
from tests.helpers.shared_runs import sweep_job, sweep_run

QUICK = [*SMOKE, "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
         "export.hf=false", "export.fp32=false"]


def _sweep_dir(log_dir: Path) -> Path:
    dirs = list((log_dir / "train" / "multiruns").iterdir())
    assert len(dirs) == 1, dirs
    return dirs[0]


def test_multirun_of_two_process_deepspeed_jobs(tmp_path_factory, shared_cache):
    log_dir, proc = sweep_run(tmp_path_factory, shared_cache)  # tests/helpers/shared_runs.py
    sweep = _sweep_dir(log_dir)
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [p.name for p in jobs] == ["0", "1", "2", "3"]
    assert not (log_dir / "train" / "runs").exists(), "a rank created a run dir of its own"
    trained = {strategy: sweep_job(strategy, tmp_path_factory, shared_cache) for strategy in ("zero2", "zero2_offload")}
    for strategy, job in trained.items():
        m = json.loads((job / "metrics.json").read_text())
        assert m["world_size"] == 2 and m["global_step"] == 6 and m["zero_stage"] == 2
        assert (job / "rank1.log").is_file() and not list(job.glob("*/.hydra"))
        assert f"strategy={strategy}" in (job / ".hydra" / "overrides.yaml").read_text()
    # the offload job really ran another strategy (CPU Adam), not the first job's again
    assert "DeepSpeedCPUAdam" in (trained["zero2_offload"] / "train.log").read_text()
    assert "DeepSpeedCPUAdam" not in (trained["zero2"] / "train.log").read_text()


def test_a_failed_job_does_not_stop_the_sweep(tmp_path_factory, shared_cache):
    log_dir, proc = sweep_run(tmp_path_factory, shared_cache)  # jobs with optim.lr=-1 fail
    assert proc.returncode == 1, proc.stderr[-5000:]  # the sweep reports the failure ...
    summary = json.loads((_sweep_dir(log_dir) / "sweep_summary.json").read_text())
    # ... after running every job: the failed ones come first
    assert [r["status"] for r in summary] == ["failed", "failed", "completed", "completed"]
    assert [r["returncode"] for r in summary[:2]] == [2, 2]
    assert all(isinstance(r["value"], float) for r in summary[2:])
    assert "optim.lr must be a positive number" in proc.stderr


@pytest.mark.slow
def test_optuna_sweep(tmp_path, shared_cache):
    # two trials: the first sampled at random (startup), the second by TPE; a small plain net
    proc = run_train(["hparams_search=optuna", "hydra.sweeper.n_trials=2", "hydra.sweeper.sampler.n_startup_trials=1",
                      *QUICK, *TINY_NET], tmp_path, shared_cache, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    sweep = _sweep_dir(tmp_path)
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]
    values = [json.loads((sweep / j / "metrics.json").read_text())["val/loss"] for j in "01"]
    lrs = {o for j in "01" for o in json.loads((sweep / j / "job_status.json").read_text())["overrides"]
           if o.startswith("optim.lr=")}
    assert len(lrs) == 2, lrs  # two different sampled learning rates
    results = (sweep / "optimization_results.yaml").read_text()
    assert "best_value" in results and f"{min(values):.4f}"[:5] in results
