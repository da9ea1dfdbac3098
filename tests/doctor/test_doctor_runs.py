"""``python train.py <overrides> doctor=true`` as a user runs it: the probes run under the run's own
strategy and launcher, the verdict is printed, the probes are findings, and the exit code says
whether a probe failed (3) or all passed (0)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.findings import read_findings
from tests.helpers.runs import SMOKE, assert_ok, error_lines, only_run_dir, run_train

PROBES = {"collectives", "init_loss", "causality", "sample_independence", "train_eval", "coverage", "plan", "memory",
          "overfit", "checkpoint"}


def _doctor_findings(run_dir):
    return {f["code"]: f for f in read_findings(run_dir, "doctor")}


def test_a_planted_look_ahead_exits_3_naming_the_module(tmp_path, shared_cache):
    """One rank under the default strategy (DeepSpeed ZeRO-2), short sequences for speed: the
    look-ahead after attention is named."""
    proc = run_train([*SMOKE, "model.net._target_=tests.planted.doctor_nets.LookAheadLM", "doctor=true",
                      "data.batch_size=4", "data.seq_len=32"], tmp_path / "logs", shared_cache)
    assert proc.returncode == 3, proc.stderr[-3000:]
    lines = error_lines(proc)
    assert len(lines) == 1 and lines[0].startswith("error: doctor: ") and "causality (mix)" in lines[0], lines
    assert "preflight doctor" in proc.stderr and "Traceback" not in proc.stderr
    run_dir = only_run_dir(tmp_path / "logs")
    found = _doctor_findings(run_dir)
    assert set(found) == PROBES
    assert found["causality"]["severity"] == "error" and found["causality"]["details"]["culprit"] == "mix"
    assert json.loads((run_dir / "metrics.json").read_text())["status"] == "doctor_failed"
    assert (run_dir / "report.md").is_file()
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())


def test_doctor_takes_only_true_or_false(tmp_path, shared_cache):
    proc = run_train([*SMOKE, "doctor=maybe"], tmp_path / "logs", shared_cache, timeout=120)
    assert proc.returncode == 2
    assert error_lines(proc) == ["error: doctor='maybe' is invalid; valid: true, false"], proc.stderr[-2000:]


@pytest.mark.slow  # 2 processes of the default model (~60-100 s); the probes' logic is unit-tested in make test
def test_the_default_model_at_2_ranks_is_healthy(tmp_path, shared_cache):
    proc = run_train([*SMOKE, "trainer=ddp_sim", "doctor=true"], tmp_path / "logs", shared_cache)
    assert_ok(proc)
    run_dir = only_run_dir(tmp_path / "logs")
    found = _doctor_findings(run_dir)
    assert set(found) == PROBES
    assert all(f["details"]["status"] == "pass" for f in found.values()), {k: f["message"] for k, f in found.items()}
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "doctor_passed" and metrics["world_size"] == 2


@pytest.mark.slow  # 2 processes each (~60-100 s); ZeRO-3's gathers (GPT-2) are the only cover of that path
@pytest.mark.parametrize("builder, strategy", [("build_tiny_gpt2", "zero3"), ("build_tiny_llama", "zero2"),
                                               ("build_tiny_mixtral", "zero2")])
def test_hf_families_at_2_ranks_are_healthy(tmp_path, shared_cache, builder, strategy):
    proc = run_train([*SMOKE, "trainer=ddp_sim", f"strategy={strategy}", "doctor=true",
                      f"model.net._target_=tests.planted.doctor_nets.{builder}"], tmp_path / "logs", shared_cache)
    assert_ok(proc)
    found = _doctor_findings(only_run_dir(tmp_path / "logs"))
    assert set(found) == PROBES
    assert all(f["details"]["status"] == "pass" for f in found.values()), {k: f["message"] for k, f in found.items()}


@pytest.mark.slow  # 2 processes (~60 s); BatchNorm over the batch is caught by the unit tests in make test
def test_batchnorm_over_the_batch_at_2_ranks_under_ddp_exits_3(tmp_path, shared_cache):
    proc = run_train([*SMOKE, "trainer=ddp_sim", "strategy=ddp", "doctor=true",
                      "model.net._target_=tests.planted.doctor_nets.BatchNormLM"], tmp_path / "logs", shared_cache)
    assert proc.returncode == 3, proc.stderr[-3000:]
    found = _doctor_findings(only_run_dir(tmp_path / "logs"))
    assert found["sample_independence"]["details"]["culprit"] == "mix.bn"
    assert found["train_eval"]["details"]["culprit"] == "mix.bn"
