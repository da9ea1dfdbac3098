"""Which checkpoint resume=auto|latest|latest_valid picks (this run dir first), and the config check
against the run that wrote it. Real checkpoint files with real manifests; no training."""

from __future__ import annotations

import csv
import json
import os
import time
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from dsdebug.checkpoint.checkpoints import resolve_ckpt_path
from dsdebug.checkpoint.integrity import CheckpointError, manifest_path, write_manifest
from dsdebug.checkpoint.resume import check_resume_config, config_differences


def _ckpt(run_dir: Path, step: int, age_s: float) -> Path:
    """A DDP-style checkpoint file with its manifest, the manifest ``age_s`` seconds old."""
    path = run_dir / "checkpoints" / f"step_{step:06d}.ckpt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": step}, path)
    write_manifest(path, {"global_step": step, "world_size": 1, "strategy": "DDPStrategy", "zero_stage": None})
    stamp = time.time() - age_s
    os.utime(manifest_path(path), (stamp, stamp))
    return path


def _cfg(log_dir: Path, resume: str | None, **sections) -> OmegaConf:
    return OmegaConf.create({"paths": {"log_dir": str(log_dir)}, "task_name": "train", "resume": resume,
                             "ckpt_path": None, **sections})


@pytest.fixture
def runs(tmp_path):
    """this run dir with checkpoints at steps 2 and 4; another run with a NEWER one at step 9."""
    root = tmp_path / "logs" / "train" / "runs"
    own, other, empty = root / "requeued", root / "other", root / "fresh"
    own_old, own_new = _ckpt(own, 2, 300), _ckpt(own, 4, 200)
    other_new = _ckpt(other, 9, 10)
    empty.mkdir(parents=True)
    return tmp_path / "logs", own, own_old, own_new, other_new, empty


@pytest.mark.parametrize("mode", ["auto", "latest", "latest_valid"])
def test_this_run_dir_wins_over_a_newer_checkpoint_of_another_run(runs, mode):
    log_dir, own, _, own_new, _, _ = runs
    assert resolve_ckpt_path(_cfg(log_dir, mode), own) == str(own_new)


def test_auto_in_an_empty_run_dir_starts_fresh_and_never_takes_another_run(runs):
    log_dir, _, _, _, other_new, empty = runs
    assert resolve_ckpt_path(_cfg(log_dir, "auto"), empty) is None
    # latest is the mode that looks beyond this run dir, when it has nothing of its own
    assert resolve_ckpt_path(_cfg(log_dir, "latest"), empty) == str(other_new)
    assert resolve_ckpt_path(_cfg(log_dir, "latest_valid"), empty) == str(other_new)


def test_auto_skips_a_corrupt_newest_of_its_own_not_to_another_run(runs, tmp_path):
    from dsdebug.findings import configure_channel

    log_dir, own, own_old, own_new, _, _ = runs
    channel = configure_channel(tmp_path / "findings")
    own_new.write_bytes(own_new.read_bytes()[:-8] + b"\0" * 8)  # same size, other bytes
    assert resolve_ckpt_path(_cfg(log_dir, "auto"), own) == str(own_old)
    assert [f.code for f in channel.local] == ["checkpoint_corrupt"]
    with pytest.raises(CheckpointError, match="step_000004.ckpt"):  # latest: the newest must verify
        resolve_ckpt_path(_cfg(log_dir, "latest"), own)


MODEL = {"net": {"_target_": "x.Net", "hidden_size": 64, "num_hidden_layers": 2}}
DATA = {"seq_len": 128, "batch_size": 8, "num_workers": 0, "cache_dir": "/a/cache", "max_tokens": None}
STRATEGY = {"_target_": "dsdebug.trainer.strategy.DebugDeepSpeedStrategy", "stage": 2}
TRAINER = {"devices": 2, "num_nodes": 1, "precision": "32-true", "accumulate_grad_batches": 1, "max_steps": 12}


def _written_by(run_dir: Path, **changes) -> Path:
    """A checkpoint in ``run_dir`` whose config_resolved.yaml has these dotted keys changed."""
    saved = {"model": json.loads(json.dumps(MODEL)), "data": dict(DATA), "strategy": dict(STRATEGY),
             "trainer": dict(TRAINER), "logger": {"csv": {}}}
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        node = saved
        for key in parents:
            node = node[key]
        node[last] = value
    ckpt = _ckpt(run_dir, 3, 0)
    (run_dir / "config_resolved.yaml").write_text(yaml.safe_dump(saved))
    return ckpt


def _now(tmp_path: Path, mode: str = "latest") -> OmegaConf:
    return _cfg(tmp_path, mode, model=MODEL, data=DATA, strategy=STRATEGY, trainer=TRAINER, logger={"wandb": {}})


def test_another_model_or_data_config_is_refused_naming_the_key(tmp_path):
    ckpt = _written_by(tmp_path / "a", model__net__hidden_size=128, data__seq_len=64)
    with pytest.raises(CheckpointError) as e:
        check_resume_config(_now(tmp_path), str(ckpt))
    line = str(e.value)
    assert "\n" not in line and str(ckpt) in line and "ckpt_path=" in line
    assert "model.net.hidden_size (128 -> 64)" in line and "data.seq_len (64 -> 128)" in line


def test_other_world_size_or_stage_is_a_warning_naming_the_key(tmp_path):
    from dsdebug.findings import configure_channel

    channel = configure_channel(tmp_path / "run")
    ckpt = _written_by(tmp_path / "b", trainer__devices=1, strategy__stage=3, data__batch_size=16)
    check_resume_config(_now(tmp_path), str(ckpt))
    (finding,) = channel.local
    assert finding.code == "resume_config_differs" and finding.severity == "warning"
    for key in ("trainer.devices (1 -> 2)", "strategy.stage (3 -> 2)", "data.batch_size (16 -> 8)"):
        assert key in finding.message, finding.message


def test_same_experiment_is_silent_and_where_keys_and_other_trainer_keys_are_not_compared(tmp_path):
    from dsdebug.findings import configure_channel

    channel = configure_channel(tmp_path / "run")
    # more steps, another cache dir or worker count: the same experiment
    ckpt = _written_by(tmp_path / "c", trainer__max_steps=6, data__cache_dir="/b/cache", data__num_workers=4)
    check_resume_config(_now(tmp_path, "auto"), str(ckpt))
    assert channel.local == []
    # an explicit ckpt_path is the user's choice: loaded as given, never compared
    other = _written_by(tmp_path / "d", model__net__hidden_size=128)
    explicit = _now(tmp_path, None)
    explicit.ckpt_path = str(other)
    check_resume_config(explicit, str(other))


def test_a_key_on_one_side_only_is_a_difference():
    diffs = config_differences({"model": {"net": {"a": 1}}}, {"model": {"net": {"a": 1, "b": 2}}})
    assert diffs == {"model.net.b": ("<absent>", 2)}


def test_in_place_keeps_rows_before_the_checkpoint_step_and_the_same_logger_dirs(tmp_path):
    """A crashed attempt logged steps 0-5, its newest checkpoint is step 3: the next attempt keeps
    rows 0-2 (CSV, history), the TensorBoard version and W&B id, and moves the last end aside."""
    from lightning.pytorch.loggers import CSVLogger

    from dsdebug.checkpoint.resume import prepare_loggers, settle_run_dir

    run = tmp_path / "run"
    ckpt = _ckpt(run, 3, 0)
    old = CSVLogger(str(run), name="csv", version="")
    for step in range(6):
        old.log_metrics({"train/loss": float(step)}, step=step)
    old.save()
    (run / "history.jsonl").write_text("".join(json.dumps({"step": s, "train/loss": s}) + "\n" for s in range(6)))
    (run / "crash.json").write_text("{}")
    (run / "metrics.json").write_text('{"status": "crashed"}')
    (run / "tensorboard" / "version_0").mkdir(parents=True)
    (run / "wandb_run_id").write_text("abc123\n")
    cfg = OmegaConf.create({"logger": {
        "tensorboard": {"_target_": "lightning.pytorch.loggers.TensorBoardLogger", "save_dir": str(run / "tensorboard"),
                        "name": None, "version": None},
        "wandb": {"_target_": "lightning.pytorch.loggers.wandb.WandbLogger"}}})
    OmegaConf.set_readonly(cfg, True)  # as prepare leaves it: the overrides are arguments, not config writes

    assert prepare_loggers(cfg, str(ckpt), run) == (3, {"tensorboard": {"version": 0, "purge_step": 3},
                                                        "wandb": {"id": "abc123"}})
    assert prepare_loggers(OmegaConf.create({"logger": {}}), str(_ckpt(tmp_path / "elsewhere", 3, 0)), run) == (None,
                                                                                                              {})

    new = CSVLogger(str(run), name="csv", version="")
    settle_run_dir([new], run, 3)
    new.log_metrics({"train/loss": 30.0, "val/loss": 7.0}, step=3)
    new.save()
    with open(run / "csv" / "metrics.csv") as f:
        rows = [(int(r["step"]), float(r["train/loss"])) for r in csv.DictReader(f)]
    assert rows == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0)]
    assert [json.loads(line)["step"] for line in (run / "history.jsonl").read_text().splitlines()] == [0, 1, 2]
    assert sorted(p.name for p in (run / "attempts" / "1").iterdir()) == ["crash.json", "metrics.json"]
    assert not (run / "crash.json").exists() and not (run / "metrics.json").exists()
