"""Rank death: SIGKILL one of 2 ranks mid-training -> the other exits non-zero within 60 s (not the
30-minute collective timeout), a finding names the dead rank, no process of the run is left, and
the last checkpoint still verifies."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from dsdebug.checkpoint.integrity import verify_checkpoint
from tests.helpers.runs import SMOKE, only_run_dir
from tests.helpers.procs import alive, output, rank_pids, start_train, tree, wait_for

pytestmark = pytest.mark.slow  # rank death: a real 2-process run killed mid-step

ARGS = SMOKE + [
    "trainer=ddp_sim",
    "trainer.max_steps=500",
    "trainer.val_check_interval=100",
    "callbacks.model_checkpoint.every_n_train_steps=2",
    "export.hf=false",
]


@pytest.mark.parametrize("strategy,victim", [("zero2", 1), ("ddp", 0)])
def test_sigkill_of_one_rank_stops_the_run_fast_and_cleanly(strategy, victim, tmp_path, shared_cache):
    proc = start_train(ARGS + [f"strategy={strategy}"], tmp_path, shared_cache)
    try:
        pids = rank_pids(proc)
        # two checkpoints (not one plus its manifest: killed before `latest` moved, none would verify)
        wait_for(lambda: len(list(tmp_path.glob("train/runs/*/checkpoints/step_*.ckpt"))) >= 2, 240,
                 "two checkpoints", proc)
        everything = [p.pid for p in tree(proc.pid)]
        assert set(pids.values()) <= set(everything)
        killed_at = time.time()
        os.kill(pids[victim], signal.SIGKILL)
        survivor = pids[1 - victim]
        wait_for(lambda: not alive([survivor]), 60, f"rank {1 - victim} to exit after rank {victim} was killed")
        took = time.time() - killed_at
        print(f"rank {1 - victim} exited {took:.1f} s after rank {victim} was SIGKILLed")
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            for p in tree(proc.pid)[::-1]:
                p.kill()
    assert took < 60, took
    assert rc != 0
    assert alive(everything) == [], "orphan processes left behind"

    run_dir = only_run_dir(tmp_path)
    findings = [json.loads(line) for line in (run_dir / "findings.jsonl").read_text().splitlines()]
    died = [f for f in findings if f["code"] == "rank_died"]
    assert died and all(f["rank"] == victim for f in died), died
    assert f"rank {victim}" in died[0]["message"]
    if victim == 1:  # rank 0 survives to say so in one line
        _, stderr = output(tmp_path)
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert errors and "rank 1" in errors[-1] and "SIGKILL" in errors[-1], stderr[-3000:]

    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    manifest = verify_checkpoint(run_dir / "checkpoints" / latest)
    assert manifest["global_step"] >= 2
