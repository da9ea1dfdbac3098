"""Preemption: SIGTERM (rank 0) or SIGUSR1 (one child rank) -> checkpoint at the next step boundary,
exit 0; `resume=latest` continues, and interrupted + resumed equals uninterrupted bit for bit."""

from __future__ import annotations

import json
import signal

import pytest

from tests.conftest import FAST, assert_ok, metrics, only_run_dir, run_dirs, run_train, train_losses
from tests.procs import output, rank_pids, start_train, wait_for

ARGS = [a for a in FAST if not a.startswith(("trainer.max_steps", "trainer.val_check_interval"))] + [
    "trainer=ddp_sim",
    "strategy=zero2",
    "trainer.max_steps=12",
    "trainer.val_check_interval=6",
    "callbacks.model_checkpoint.every_n_train_steps=3",
    "+callbacks=reproducibility",
    "export.hf=false",
]


def _preempt(log_dir, shared_cache, signum, rank):
    proc = start_train(ARGS, log_dir, shared_cache)
    pids = rank_pids(proc)
    # a periodic checkpoint at step 3 proves training is under way; signal right after
    wait_for(lambda: any(log_dir.glob("train/runs/*/checkpoints/step_000003.ckpt/manifest.json")), 240,
             "the step-3 checkpoint", proc)
    import os

    os.kill(pids[rank], signum)
    rc = proc.wait(timeout=240)
    stdout, stderr = output(log_dir)
    assert rc == 0, f"exit {rc}\n{stdout[-3000:]}\n{stderr[-5000:]}"
    return only_run_dir(log_dir)


@pytest.mark.parametrize("signame,rank", [("SIGTERM", 0), ("SIGUSR1", 1)])
def test_signal_checkpoints_at_step_boundary_and_resume_is_bitwise(signame, rank, tmp_path_factory, shared_cache):
    log_dir = tmp_path_factory.mktemp(f"preempt_{signame}")
    run_dir = _preempt(log_dir, shared_cache, getattr(signal, signame), rank)
    m = metrics(run_dir)
    assert m["status"] == "preempted"
    step = m["global_step"]
    assert 3 <= step < 12, step
    ckpt = run_dir / "checkpoints" / f"preempt_step_{step:06d}.ckpt"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["global_step"] == step and manifest["world_size"] == 2
    assert (run_dir / "checkpoints" / "latest").read_text().strip() in (ckpt.name, f"step_{step:06d}.ckpt")
    assert not (run_dir / "export").exists(), "a preempted run must not spend its grace time on exports"
    findings = [json.loads(line) for line in (run_dir / "findings.jsonl").read_text().splitlines()]
    pre = [f for f in findings if f["code"] == "preempted"]
    assert len(pre) == 1 and pre[0]["step"] == step
    assert pre[0]["details"]["signal"] == (signame if rank == 0 else "a signal on another rank")

    if signame != "SIGTERM":
        return  # the resume is the same for both signals: checked once, below
    # resume=latest continues from the preemption checkpoint, in a new run dir
    assert_ok(run_train(ARGS + ["resume=latest"], log_dir, shared_cache))
    resumed = [d for d in run_dirs(log_dir) if d != run_dir]
    assert len(resumed) == 1
    assert metrics(resumed[0])["resumed_from"].endswith(f"_{step:06d}.ckpt")
    assert metrics(resumed[0])["global_step"] == 12

    # the uninterrupted run, step for step, bit for bit (CPU, reproducibility callback on)
    full_dir = tmp_path_factory.mktemp("uninterrupted")
    assert_ok(run_train(ARGS, full_dir, shared_cache))
    full = train_losses(only_run_dir(full_dir))
    first, second = train_losses(run_dir), train_losses(resumed[0])
    assert sorted(first) == list(range(step)) and sorted(second) == list(range(step, 12))
    assert {**first, **second} == full
