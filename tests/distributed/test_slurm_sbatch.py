"""examples/slurm/train.sbatch, run by bash with stand-ins for srun and scontrol: it starts the same
command every attempt (resume=auto, the job's run dir), requeues exactly when the run was
preempted, and survives the SIGTERM SLURM sends the batch shell on preemption."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.runs import REPO
from tests.helpers.procs import wait_for

SCRIPT = REPO / "examples" / "slurm" / "train.sbatch"

# srun stand-in: records its command line, optionally waits for the test's go-ahead, then leaves
# metrics.json with FAKE_STATUS in the run dir it was given (as train.py does) and exits FAKE_RC
FAKE_SRUN = """#!/bin/bash
printf '%s\\n' "$@" > srun_args.txt
if [ -n "${FAKE_WAIT:-}" ]; then
    touch srun_started
    for _ in $(seq 600); do [ -e go ] && break; sleep 0.05; done
fi
for arg in "$@"; do case "$arg" in hydra.run.dir=*) run_dir="${arg#hydra.run.dir=}";; esac; done
mkdir -p "$run_dir"
echo "{\\"status\\": \\"$FAKE_STATUS\\"}" > "$run_dir/metrics.json"
exit "${FAKE_RC:-0}"
"""
FAKE_SCONTROL = """#!/bin/bash
echo "$@" >> scontrol_calls.txt
"""


def _sbatch_dir(tmp_path: Path) -> tuple[Path, dict]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": sys.executable,
           "SLURM_JOB_ID": "4242", "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_NNODES": "2"}
    for key in ("SLURM_RESTART_COUNT", "RUN_DIR", "MAX_REQUEUES"):
        env.pop(key, None)
    return tmp_path, env


def _calls(submit: Path) -> list[str]:
    path = submit / "scontrol_calls.txt"
    return path.read_text().splitlines() if path.is_file() else []


@pytest.mark.parametrize("status,rc,restarts,requeued", [
    ("preempted", 0, "0", True),      # USR1 before the time limit: checkpoint, exit 0, back to the queue
    ("completed", 0, "3", False),     # the last attempt finished the run
    ("crashed", 1, "0", False),       # a failure is not requeued over and over
    ("preempted", 0, "20", False),    # MAX_REQUEUES (20) reached
])
def test_requeues_exactly_when_preempted(tmp_path, status, rc, restarts, requeued):
    submit, env = _sbatch_dir(tmp_path)
    env.update(FAKE_STATUS=status, FAKE_RC=str(rc), SLURM_RESTART_COUNT=restarts)
    proc = subprocess.run(["bash", str(SCRIPT), "strategy=zero3"], cwd=submit, env=env, capture_output=True, text=True)
    assert proc.returncode == rc, proc.stdout + proc.stderr
    assert _calls(submit) == (["requeue 4242"] if requeued else []), proc.stdout
    args = (submit / "srun_args.txt").read_text().splitlines()
    # every attempt runs the same command: resume=auto in the job's own run dir, overrides passed on
    assert args[args.index("train.py") + 1] == "trainer=multi_gpu" and "resume=auto" in args and "strategy=zero3" in args
    assert "hydra.run.dir=logs/train/runs/slurm-4242" in args and "trainer.num_nodes=2" in args
    assert json.loads((submit / "logs/train/runs/slurm-4242/metrics.json").read_text())["status"] == status


def test_the_batch_shell_outlives_sigterm_until_the_ranks_saved(tmp_path):
    submit, env = _sbatch_dir(tmp_path)
    env.update(FAKE_STATUS="preempted", FAKE_WAIT="1")
    proc = subprocess.Popen(["bash", str(SCRIPT)], cwd=submit, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: (submit / "srun_started").exists(), 60, "srun to start", proc)
    proc.send_signal(signal.SIGTERM)  # SLURM preempting the job: the shell gets it too
    (submit / "go").touch()           # ... and the ranks finish saving afterwards
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "SIGTERM: waiting" in out and _calls(submit) == ["requeue 4242"], out
