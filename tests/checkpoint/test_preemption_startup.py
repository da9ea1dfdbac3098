"""A preemption signal while the run is still starting (src/distributed/startup_signals.py): recorded
from the entry point's first line, the run ends as ``preempted`` (exit 0, nothing to save) and the same
command continues it (``resume=auto`` in the same run dir: a requeued SLURM job).

- during the imports (the handler is in place: /proc SigCgt), 1 process: stopped before fit;
- in fit's setup, before DeepSpeed builds the engine (a planted callback signals its own rank),
  1 process: the ranks agree at on_train_start, stopped at step 0;
- slow: the same on rank 1 of 2 (our launcher's child), then the requeue completes.
Mid-training: tests/checkpoint/test_preemption.py.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.helpers.procs import output, start_train, wait_for
from tests.helpers.runs import SMOKE, TINY_NET, assert_ok, metrics, run_train
from tests.planted.signals import ENV

PLANT = ["+callbacks.plant._target_=tests.planted.signals.SignalInSetup"]


def _command(run_dir: Path, *extra: str) -> list[str]:
    """The requeue command: the same every attempt (resume=auto in a fixed run dir)."""
    return [*SMOKE, *TINY_NET, "trainer.max_steps=2", "export.hf=false", *PLANT, *extra, "resume=auto",
            f"hydra.run.dir={run_dir}"]


def _catches(pid: int, signum: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def _findings(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "findings.jsonl").read_text().splitlines()]


def _assert_preempted_before_step_1(run_dir: Path, step) -> dict:
    m = metrics(run_dir)
    assert m["status"] == "preempted" and m["global_step"] == step and m["final_checkpoint"] is None, m
    assert not list(run_dir.glob("checkpoints/*")) and not (run_dir / "export").exists()
    (pre,) = [f for f in _findings(run_dir) if f["code"] == "preempted"]
    assert "nothing to save" in pre["message"], pre
    assert (run_dir / "report.md").is_file() and "| status | preempted |" in (run_dir / "report.md").read_text()
    return pre


def _requeue_completes(run_dir: Path, log_dir: Path, cache: Path, args: list[str]) -> None:
    assert_ok(run_train(args, log_dir, cache))
    m = metrics(run_dir)
    assert m["status"] == "completed" and m["global_step"] == 2 and m["resumed_from"] is None, m
    assert json.loads((run_dir / "attempts" / "1" / "metrics.json").read_text())["status"] == "preempted"


def test_signal_during_imports_ends_preempted_and_the_same_command_completes(tmp_path, shared_cache):
    run_dir = tmp_path / "run"
    proc = start_train(_command(run_dir), tmp_path, shared_cache)
    # ~1 s in: the entry point's handler is in place (train.py's first lines), the imports go on
    wait_for(lambda: _catches(proc.pid, signal.SIGUSR1), 60, "the start-up signal handler", proc)
    os.kill(proc.pid, signal.SIGUSR1)
    rc = proc.wait(timeout=240)
    stdout, stderr = output(tmp_path)
    assert rc == 0, f"exit {rc}\n{stdout[-3000:]}\n{stderr[-3000:]}"
    pre = _assert_preempted_before_step_1(run_dir, None)
    # caught from the entry point's first lines: before Hydra composed the config (the first place it is asked)
    assert pre["details"] == {"signal": "SIGUSR1", "stage": "while the config was composed", "checkpoint": None}, pre
    assert "preempted: SIGUSR1 received" in stdout and "Traceback" not in stderr
    _requeue_completes(run_dir, tmp_path, shared_cache, _command(run_dir))


def test_signal_in_fit_setup_stops_before_the_first_step(tmp_path, shared_cache):
    run_dir = tmp_path / "run"  # strategy=zero2 (the default): the signal lands before DeepSpeed's engine
    proc = run_train(_command(run_dir), tmp_path, shared_cache, env={ENV: "SIGTERM:0"})
    assert_ok(proc)
    pre = _assert_preempted_before_step_1(run_dir, 0)
    assert pre["details"] == {"signal": "SIGTERM", "stage": "start of fit", "checkpoint": None}, pre


@pytest.mark.slow  # 2 processes and a requeue; the 1-process start-up stops above are the fast cover
def test_signal_on_a_child_rank_in_setup_stops_every_rank_and_requeue_completes(tmp_path, shared_cache):
    run_dir = tmp_path / "run"
    args = _command(run_dir, "trainer=ddp_sim", "strategy=zero2")
    assert_ok(run_train(args, tmp_path, shared_cache, env={ENV: "SIGUSR1:1"}))
    pre = _assert_preempted_before_step_1(run_dir, 0)
    assert pre["details"]["signal"] == "a signal on another rank", pre
    _requeue_completes(run_dir, tmp_path, shared_cache, args)
