"""Checkpoint integrity: manifests written last, verified resume, latest_valid fallback, rotation
only after verification, and a full disk that costs nothing already saved."""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid

import pytest
import torch

from dsdebug.checkpoint.integrity import (
    CheckpointError,
    finalize_checkpoint,
    manifest_path,
    verify_checkpoint,
    write_manifest,
)
from tests.helpers.bad_input import cli_error_lines
from tests.helpers.runs import SMOKE, TINY_NET, error_lines, metrics, only_run_dir, run_dirs, run_train, train_in_process

META = {"global_step": 2, "world_size": 1, "strategy": "DebugDeepSpeedStrategy", "zero_stage": 2}


def _fake_ds_checkpoint(root):
    ckpt = root / "step_000002.ckpt"
    (ckpt / "checkpoint").mkdir(parents=True)
    torch.save({"w": torch.arange(1000.0)}, ckpt / "checkpoint" / "mp_rank_00_model_states.pt")
    torch.save({"m": torch.ones(5000)}, ckpt / "checkpoint" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (ckpt / "latest").write_text("checkpoint")
    return ckpt


def test_manifest_lists_every_file_and_verifies(tmp_path):
    ckpt = _fake_ds_checkpoint(tmp_path)
    manifest = write_manifest(ckpt, META)
    assert set(manifest["files"]) == {"checkpoint/mp_rank_00_model_states.pt",
                                      "checkpoint/zero_pp_rank_0_mp_rank_00_optim_states.pt", "latest"}
    assert json.loads(manifest_path(ckpt).read_text()) == manifest
    assert not [p for p in ckpt.iterdir() if ".tmp-" in p.name], "temp file left behind"
    assert verify_checkpoint(ckpt)["global_step"] == 2


@pytest.mark.parametrize("damage,words", [
    ("flip", "sha256 differs"), ("truncate", "truncated"), ("delete", "missing")])
def test_damaged_shard_is_named(tmp_path, damage, words):
    ckpt = _fake_ds_checkpoint(tmp_path)
    write_manifest(ckpt, META)
    shard = ckpt / "checkpoint" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(bytes(data[:-100]))
    else:
        shard.unlink()
    with pytest.raises(CheckpointError) as e:
        verify_checkpoint(ckpt)
    assert str(shard) in str(e.value) and words in str(e.value) and "\n" not in str(e.value)


def test_torn_write_is_caught_before_the_manifest(tmp_path):
    ckpt = _fake_ds_checkpoint(tmp_path)
    shard = ckpt / "checkpoint" / "mp_rank_00_model_states.pt"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a half-written archive
    with pytest.raises(CheckpointError, match="not a complete torch archive|corrupted|unreadable"):
        write_manifest(ckpt, META)
    assert not manifest_path(ckpt).exists()
    with pytest.raises(CheckpointError, match="no manifest"):
        verify_checkpoint(ckpt)


def test_rotation_waits_for_verification(tmp_path, monkeypatch):
    """save_top_k=2: the 3rd save fails its verification -> the two older checkpoints survive."""
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    import dsdebug.checkpoint.integrity as integrity

    real = integrity.write_manifest
    calls = {"n": 0}

    def flaky(ckpt, meta):
        calls["n"] += 1
        if calls["n"] == 3:
            raise CheckpointError(f"checkpoint file {ckpt} is corrupted (planted)")
        return real(ckpt, meta)

    monkeypatch.setattr(integrity, "write_manifest", flaky)
    cb = integrity.VerifiedModelCheckpoint(dirpath=tmp_path, filename="step_{step:06d}", every_n_train_steps=1,
                                           save_top_k=2, monitor="step", mode="max", auto_insert_metric_name=False)
    trainer = L.Trainer(max_steps=5, callbacks=[cb], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1, limit_val_batches=0)
    with pytest.raises(CheckpointError, match="planted"):
        trainer.fit(BoringModel())
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "step_000001.ckpt" in names and "step_000002.ckpt" in names, names
    for name in ("step_000001.ckpt", "step_000002.ckpt"):
        verify_checkpoint(tmp_path / name)
    assert (tmp_path / "latest").read_text().strip() == "step_000002.ckpt"
    assert not (tmp_path / "step_000003.ckpt.manifest.json").exists()


def test_finalize_refuses_an_empty_checkpoint(tmp_path):
    class T:  # the trainer surface finalize_checkpoint uses
        is_global_zero, world_size, global_step, current_epoch, precision = True, 1, 1, 0, "32-true"
        strategy = object()

    (tmp_path / "empty.ckpt").mkdir()
    with pytest.raises(CheckpointError, match="no files"):
        finalize_checkpoint(T(), tmp_path / "empty.ckpt")


# ---------------------------------------------------------------- real runs
ONE_PROC = SMOKE + [
    "trainer.max_steps=4", "callbacks.model_checkpoint.every_n_train_steps=2", "export.fp32=false",
    "export.hf=false"]
# the same with a small plain net: checkpoints of ~9 MB instead of ~140 MB (what these tests check
# does not depend on the model; the full-disk test needs the big ones)
SMALL_ONE_PROC = ONE_PROC + TINY_NET


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory, shared_cache):
    log_dir = tmp_path_factory.mktemp("integrity")
    run_dir = log_dir / "train" / "runs" / "0_first"
    train_in_process(SMALL_ONE_PROC + [f"paths.log_dir={log_dir}"], run_dir, shared_cache)
    return log_dir, run_dir


def _fresh_copy(tmp_path, log_dir):
    dst = tmp_path / "logs"
    shutil.copytree(log_dir, dst)
    return dst, only_run_dir(dst)


def test_corrupt_shard_names_the_file(two_checkpoints, tmp_path, shared_cache, capsys):
    """step 2 good, step 4 with a corrupted shard, step 6 a save killed half way (no manifest)."""
    log_dir, _ = _fresh_copy(tmp_path, two_checkpoints[0])
    run = only_run_dir(log_dir)
    partial = run / "checkpoints" / "step_000006.ckpt"
    shutil.copytree(run / "checkpoints" / "step_000004.ckpt", partial)
    (partial / "manifest.json").unlink()
    shard = next((run / "checkpoints" / "step_000004.ckpt" / "checkpoint").glob("*optim_states.pt"))
    with open(shard, "r+b") as f:
        f.seek(1000)
        f.write(b"\0" * 64)
    # resume=latest: the partial step 6 is never "latest"; step 4 is, and it fails verification
    # (the command line's layers in this process: tests/helpers/bad_input.py)
    lines = cli_error_lines(SMALL_ONE_PROC + ["resume=latest"], log_dir, shared_cache, capsys)
    assert len(lines) == 1 and str(shard) in lines[0] and "resume=latest_valid" in lines[0], lines
    verify_checkpoint(run / "checkpoints" / "step_000002.ckpt")  # nothing was touched
    failed = [d for d in run_dirs(log_dir) if d != run]
    assert all(not (d / "checkpoints").exists() for d in failed)
    shutil.rmtree(failed[0])

    # latest_valid falls back to step 2, reports the skipped one, and trains on
    train_in_process(SMALL_ONE_PROC + ["resume=latest_valid", "trainer.max_steps=6", f"paths.log_dir={log_dir}"],
                     log_dir / "train" / "runs" / "1_resumed", shared_cache)
    resumed = [d for d in run_dirs(log_dir) if d != run][0]
    m = metrics(resumed)
    assert m["resumed_from"].endswith("step_000002.ckpt") and m["global_step"] == 6
    skipped = [json.loads(line) for line in (resumed / "findings.jsonl").read_text().splitlines()]
    assert [f["code"] for f in skipped] == ["checkpoint_corrupt"] and shard.name in skipped[0]["message"]


@pytest.mark.slow  # a real run that fills a small disk; its one-line error: docs/bad_inputs.md row 37
def test_disk_full_during_checkpoint(tmp_path, shared_cache):
    """A real full disk (a small tmpfs): the failing save is one line naming the file; the verified
    checkpoints before it are intact and were not rotated away."""
    mnt = tmp_path / "small_disk"
    mnt.mkdir()
    # one zero2 checkpoint of the tiny model is ~140 MB: room for two, not three
    rc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=330m", f"tmpfs-{uuid.uuid4().hex[:6]}", str(mnt)],
                        capture_output=True, text=True)
    if rc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill (needs root/CAP_SYS_ADMIN): {rc.stderr.strip()}")
    try:
        args = [a for a in ONE_PROC if not a.startswith("trainer.max_steps")] + [
            "trainer.max_steps=8", "callbacks.model_checkpoint.save_top_k=2"]
        proc = run_train(args, mnt / "logs", shared_cache)
        assert proc.returncode == 2, proc.stderr[-3000:]
        lines = error_lines(proc)
        assert len(lines) == 1, proc.stderr[-3000:]
        assert "step_000006.ckpt" in lines[0] and "free" in lines[0], lines[0]
        run = only_run_dir(mnt / "logs")
        ckpts = sorted(p.name for p in (run / "checkpoints").glob("*.ckpt"))
        assert ckpts == ["step_000002.ckpt", "step_000004.ckpt"], ckpts  # partial step 6 removed
        for name in ckpts:
            verify_checkpoint(run / "checkpoints" / name)
        assert (run / "checkpoints" / "latest").read_text().strip() == "step_000004.ckpt"
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


DDP = [a for a in SMALL_ONE_PROC if not a.startswith("trainer.max_steps")] + ["strategy=ddp", "trainer.max_steps=2"]


def test_ddp_checkpoint_resumes_with_weights_only(tmp_path, shared_cache):
    """The DDP checkpoint file (weights, optimizer, loops, RNG states) loads with weights_only=True."""
    runs = tmp_path / "train" / "runs"
    train_in_process(DDP + [f"paths.log_dir={tmp_path}"], runs / "0_first", shared_cache)
    run = only_run_dir(tmp_path)
    ckpt = run / "checkpoints" / "step_000002.ckpt"
    torch.load(ckpt, map_location="cpu", weights_only=True)  # no pickled code in it
    train_in_process(DDP[:-1] + ["trainer.max_steps=3", "resume=latest", f"paths.log_dir={tmp_path}"],
                     runs / "1_resumed", shared_cache)
    resumed = [d for d in run_dirs(tmp_path) if d != run][0]
    assert metrics(resumed)["global_step"] == 3


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_checkpoint_with_pickled_code_is_refused(tmp_path, shared_cache):
    ckpt = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "payload": _Evil()}, ckpt)
    proc = run_train(DDP + [f"ckpt_path={ckpt}"], tmp_path / "logs", shared_cache)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = error_lines(proc)
    assert "weights_only=True" in line and "pwned" not in proc.stdout
