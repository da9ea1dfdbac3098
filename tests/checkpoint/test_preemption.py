"""Preemption: SIGTERM (rank 0) or SIGUSR1 (one child rank) -> checkpoint at the next step boundary,
exit 0; the same command again with `resume=auto` (a SLURM requeue) continues in its own run dir, and
interrupted + resumed equals uninterrupted bit for bit. (`resume=latest` from a new run dir:
tests/trainer/test_train_single.py, tests/checkpoint/test_ckpt_integrity.py; the choice of checkpoint:
tests/checkpoint/test_resume_modes.py.)"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import pytest

from tests.helpers.runs import SMOKE, assert_ok, error_lines, metrics, only_run_dir, run_train, train_losses
from tests.helpers.procs import output, rank_pids, start_train, wait_for

pytestmark = pytest.mark.slow  # preemption: real 2-process runs signalled mid-step and resumed

ARGS = SMOKE + [
    "trainer=ddp_sim",
    "strategy=zero2",
    "trainer.max_steps=12",
    "trainer.val_check_interval=6",
    "callbacks.model_checkpoint.every_n_train_steps=3",
    "+callbacks=reproducibility",
    "export.hf=false",
]


# A SLURM job requeued after USR1: the same command again, in the same run dir (explicit here; under
# SLURM it derives from the job id), with every logger on (W&B offline)
WANDB_OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}


def _requeue_args(run_dir, resume="auto"):
    return [a for a in ARGS if a != "logger=csv"] + ["logger=many", f"resume={resume}", f"hydra.run.dir={run_dir}"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, shared_cache):
    """step -> train/loss of the run nobody interrupted (both resumes must match it bit for bit)."""
    full_dir = tmp_path_factory.mktemp("uninterrupted")
    assert_ok(run_train(ARGS, full_dir, shared_cache))
    return train_losses(only_run_dir(full_dir))


def _preempt(log_dir, shared_cache, signum, rank, args=ARGS, env=None):
    proc = start_train(args, log_dir, shared_cache, env=env)
    pids = rank_pids(proc)
    # a periodic checkpoint at step 3 proves training is under way; signal right after
    wait_for(lambda: any(log_dir.glob("train/runs/*/checkpoints/step_000003.ckpt/manifest.json")), 240,
             "the step-3 checkpoint", proc)
    os.kill(pids[rank], signum)
    rc = proc.wait(timeout=240)
    stdout, stderr = output(log_dir)
    assert rc == 0, f"exit {rc}\n{stdout[-3000:]}\n{stderr[-5000:]}"
    return only_run_dir(log_dir)


@pytest.mark.parametrize("signame,rank", [("SIGTERM", 0), ("SIGUSR1", 1)])
def test_signal_checkpoints_at_step_boundary_and_resume_is_bitwise(signame, rank, tmp_path_factory, shared_cache,
                                                                   request):
    log_dir = tmp_path_factory.mktemp(f"preempt_{signame}")
    requeue = _requeue_args(log_dir / "train" / "runs" / "requeued")
    if signame == "SIGTERM":
        run_dir = _preempt(log_dir, shared_cache, signal.SIGTERM, rank)
    else:  # the first attempt of a requeued job: resume=auto in an empty run dir starts fresh
        run_dir = _preempt(log_dir, shared_cache, signal.SIGUSR1, rank, args=requeue, env=WANDB_OFFLINE)
        assert run_dir.name == "requeued" and metrics(run_dir)["resumed_from"] is None
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

    if signame == "SIGTERM":
        return  # the resume is the same for both signals: checked once, in place, below
    _requeue_in_place(log_dir, run_dir, ckpt, step, requeue, shared_cache, request.getfixturevalue("uninterrupted"))


def _requeue_in_place(log_dir, run_dir, ckpt, step, requeue, shared_cache, uninterrupted):
    # another run beside it with a NEWER checkpoint (a copy of this run's step 3): never taken
    other = log_dir / "train" / "runs" / "other"
    shutil.copytree(run_dir / "checkpoints" / "step_000003.ckpt", other / "checkpoints" / "step_000003.ckpt")
    shutil.copy(run_dir / "config_resolved.yaml", other / "config_resolved.yaml")
    future = time.time() + 60
    os.utime(other / "checkpoints" / "step_000003.ckpt" / "manifest.json", (future, future))

    # resume=latest in this run dir takes its own checkpoint, and a changed model is one line naming the key
    changed = _requeue_args(run_dir, resume="latest") + ["model.net.num_hidden_layers=3"]
    proc = run_train(changed, log_dir, shared_cache, env=WANDB_OFFLINE)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = error_lines(proc)
    assert str(ckpt) in line and "model.net.num_hidden_layers (4 -> 3)" in line and str(other) not in line, line
    assert "Traceback" not in proc.stderr
    assert metrics(run_dir)["status"] == "preempted"  # the refused attempt changed nothing that was there

    # the requeued job: the same command again continues in place, bit for bit
    assert_ok(run_train(requeue, log_dir, shared_cache, env=WANDB_OFFLINE))
    m = metrics(run_dir)
    assert m["resumed_from"] == str(ckpt) and m["global_step"] == 12 and m["status"] == "completed"
    assert train_losses(run_dir) == uninterrupted  # one metrics.csv: the first attempt's rows kept
    assert json.loads((run_dir / "attempts" / "1" / "metrics.json").read_text())["status"] == "preempted"
    # the same W&B run (offline: one dir per attempt, one id) and the same TensorBoard dir
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    offline = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(d.name.endswith(f"-{run_id}") for d in offline), offline
    tb = run_dir / "tensorboard"
    # one events file per attempt, plus one per attempt for what is sent after fit (the findings and the
    # incidents; the logger closed its writer at the end of fit): all in the one dir, merged by TensorBoard
    assert not list(tb.glob("version_*")) and 2 <= len(list(tb.glob("events.out.tfevents.*"))) <= 4
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb))
    events.Reload()
    assert sorted(e.step for e in events.Scalars("train/loss")) == list(range(12))
