"""The checks in a plain Lightning project: no dsdebug config, no Hydra, no setup call.

- 1 process, in this process: the findings channel configures itself from ``trainer.log_dir``
  (a second fit gets its own file; the framework's configure_channel wins), info findings reach
  the console once, log_sync creates its dir, data_inspector compares float batches by value
  (no false "exact copies" from int truncation) and still catches a planted val = train copy.
- slow, ONE 2-rank run: a fresh venv outside the repo with a real (non-editable) install of the
  repo, the example project ``examples/plain_lightning`` (its own ``src`` package) with all seven
  checks, a planted NaN at step 3 and val = train; then ``dsdebug-train`` from another directory.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from examples.plain_lightning.src.model import BoringModel, RandomFloats
from tests.helpers.runs import REPO, SMALL_DEEPSEEK, SMOKE, assert_ok, metrics, only_run_dir

EXAMPLE = REPO / "examples" / "plain_lightning"


@pytest.fixture
def fresh_channel():
    """The process-wide channel as a plain project finds it (nobody configured it); restored after."""
    from dsdebug.findings import channel as ch

    saved = ch._channel
    ch._channel = ch.FindingsChannel(origin="default")
    yield ch
    ch._channel = saved


class SmallFloats(BoringModel):
    """|x| < 1 almost everywhere: truncated to ints every sample would be all zeros (the old bug)."""

    def _data(self, seed: int) -> RandomFloats:
        data = RandomFloats(seed=seed)
        data.x = data.x * 0.1
        return data


def _fit(root: Path, model, callbacks, **kwargs) -> "object":
    import lightning as L

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, val_check_interval=2, limit_val_batches=1,
                        default_root_dir=root, callbacks=callbacks, enable_progress_bar=False,
                        enable_model_summary=False, **kwargs)
    trainer.fit(model)
    return trainer


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_float_batches_compared_by_value_and_channel_configures_itself(tmp_path, fresh_channel):
    from dsdebug.callbacks import DataInspector

    healthy = _fit(tmp_path / "healthy", SmallFloats(), [DataInspector()], enable_checkpointing=False)
    planted = _fit(tmp_path / "leak", SmallFloats(val_copies_train=True), [DataInspector()],
                   enable_checkpointing=False)
    # each fit its own findings file, under its own trainer.log_dir (lightning_logs/version_0)
    files = [Path(t.log_dir) / "findings.jsonl" for t in (healthy, planted)]
    assert files[0] != files[1] and all(f.is_file() for f in files), files
    ok, leak = _records(files[0]), _records(files[1])
    codes = {r["code"] for r in ok}
    assert "first_batch" in codes and not codes & {"train_val_overlap", "train_val_overlap_small"}, ok
    first = next(r for r in ok if r["code"] == "first_batch")
    assert "not token ids (float32 data)" in first["message"]
    assert first["details"]["tensors"]["batch"]["dtype"] == "float32"
    overlap = [r for r in leak if r["code"] == "train_val_overlap"]
    assert overlap and overlap[0]["severity"] == "warning" and overlap[0]["details"]["exact"] == 64, leak
    assert overlap[0]["details"]["ngram"] == 0  # no token windows over float values


def test_float_fingerprint_sees_fractional_differences():
    from dsdebug.callbacks.data_inspector.fingerprint import fingerprint

    x = torch.rand(4, 8)  # in [0, 1): all zeros once truncated
    a, weights = fingerprint(x, None)
    assert int(a) == int(fingerprint(x.clone(), weights)[0])
    assert int(a) != int(fingerprint(x + 1e-3, weights)[0])
    assert int(a) != int(fingerprint(x.flip(0), weights)[0])  # order-sensitive


def test_log_sync_creates_its_dir_and_framework_channel_wins(tmp_path, fresh_channel):
    from dsdebug.callbacks import GradMonitor, LogSync
    from dsdebug.findings import configure_channel

    channel = configure_channel(tmp_path / "framework_run")  # what the framework does before the Trainer
    root = tmp_path / "not" / "yet" / "there"
    _fit(root, BoringModel(), [LogSync(every_n_steps=2), GradMonitor()], logger=False,
         enable_checkpointing=False)
    assert (root / "timeline.jsonl").is_file() and (root / "logs_merged.log").is_file()
    assert {r["code"] for r in _records(channel.path)} >= {"grad_summary"}
    assert not list(root.rglob("findings.jsonl"))  # the framework's configuration won


def test_info_findings_reach_the_console_once(fresh_channel):
    from dsdebug.findings import Finding, get_channel

    root, logger = logging.getLogger(), logging.getLogger("findings")
    saved = root.handlers[:], logger.handlers[:], logger.level
    root.handlers.clear()  # a plain script: no logging configured (pytest's capture handlers removed)
    logger.handlers.clear()
    try:
        handler = fresh_channel.console_handler()
        assert handler is not None and fresh_channel.console_handler() is None  # added once
        handler.setStream(stream := io.StringIO())
        get_channel().report(Finding("demo", "info", "hello", "an info finding"))
        assert stream.getvalue().count("[demo/hello]") == 1
        logger.removeHandler(handler)
        root.addHandler(logging.StreamHandler(io.StringIO()))  # the user's own logging setup wins
        assert fresh_channel.console_handler() is None
    finally:
        root.handlers[:], logger.handlers[:] = saved[0], saved[1]
        logger.setLevel(saved[2])


# ---- slow: a real install in a fresh venv, a plain 2-rank DDP project -----------------------
def _copy_repo(dst: Path) -> Path:
    skip_top = {".git", ".venv", ".dsdebug_path", "build", "dist", "logs", "outputs", "multirun", "wandb",
                "lightning_logs", ".pytest_cache", ".cache"}

    def ignore(folder: str, names: list[str]) -> set[str]:
        top = skip_top if Path(folder) == REPO else set()
        return {n for n in names if n in top or n == "__pycache__" or n.endswith(".egg-info")}

    shutil.copytree(REPO, dst, ignore=ignore)
    return dst


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


@pytest.mark.slow
def test_installed_checks_in_a_plain_ddp_project(tmp_path, shared_cache):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    # the heavy dependencies (torch, Lightning, ...) come from this test's own venv, not a download
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    (Path(purelib) / "shared_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    src = _copy_repo(tmp_path / "repo")
    pip = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                          "--no-cache-dir", str(src)], capture_output=True, text=True, timeout=600, env=_clean_env())
    assert_ok(pip)

    project = shutil.copytree(EXAMPLE, tmp_path / "project", ignore=shutil.ignore_patterns("__pycache__"))
    where = subprocess.run([str(py), "-c", "import dsdebug, importlib.resources as r; print(dsdebug.__file__); "
                            "print((r.files('dsdebug.conf') / 'train.yaml').is_file())"],
                           cwd=project, capture_output=True, text=True, env=_clean_env())
    assert_ok(where)
    file, conf = where.stdout.split()
    assert Path(file).is_relative_to(venv) and conf == "True", where.stdout  # a real install, not the checkout

    proc = subprocess.run([str(py), "train.py", "--root", str(project / "logs"), "--nan-step", "3", "--leak"],
                          cwd=project, capture_output=True, text=True, timeout=600, env=_clean_env())
    assert_ok(proc)
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out[-4000:]
    findings = project / "logs" / "lightning_logs" / "version_0" / "findings.jsonl"
    records = _records(findings)
    nan = [r for r in records if (r["check"], r["code"]) == ("grad_monitor", "nonfinite_grad")]
    assert nan and nan[0]["step"] == 3 and nan[0]["severity"] == "error", records
    assert "layer.weight" in nan[0]["message"]
    leak = [r for r in records if r["code"] == "train_val_overlap"]
    assert leak and leak[0]["details"]["exact"] == 64
    checks = {r["check"] for r in records}
    assert checks >= {"reproducibility", "comm_debug", "grad_monitor", "data_inspector", "profiler",
                      "freeze_verify"}, checks
    timeline = _records(project / "logs" / "timeline.jsonl")  # log_sync: every rank's lines, merged on rank 0
    assert {r.get("rank") for r in timeline} >= {0, 1}
    assert out.count("[freeze_verify/freeze_verified]") == 1  # info on the console, once

    # the installed entry point, from a directory that is not the checkout
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    args = SMOKE + SMALL_DEEPSEEK
    run = subprocess.run([str(venv / "bin" / "dsdebug-train"), "trainer.max_steps=3", *args,
                          f"paths.log_dir={tmp_path / 'cli_logs'}"], cwd=elsewhere, capture_output=True, text=True,
                         timeout=600, env=_clean_env(DSDEBUG_CACHE_DIR=str(shared_cache)))
    assert_ok(run)
    assert metrics(only_run_dir(tmp_path / "cli_logs"))
