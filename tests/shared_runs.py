"""2-process runs that several test files read, each made once per session.

A 2-process run spends ~20 s of CPU starting up (two interpreters importing torch, Lightning,
DeepSpeed, transformers) before its first step, so the suite makes one healthy run per
strategy and lets every test that needs "a healthy 2-process run" read it:

- ``tests/distributed/test_distributed.py``: the ddp and zero3 strategy runs (learning, checkpoints,
  exports) and the zero3 resume source (``strategy_run`` gives every strategy's run; the
  sweep below gives two of them);
- ``tests/callbacks/test_presets.py``: debug=full on a healthy run reports only info;
- the callback tests' healthy 2-process cases: comm share (comm_debug), per-rank stats and
  timeline (log_sync), traces per rank (profiler), replay and records on every rank
  (reproducibility), disjoint batches per rank (data_inspector), all parameters verified
  (freeze_verify), and the DDP reference grad norms for grad_monitor under ZeRO-3.

Each of those tests reads its own callback's findings and artifacts in the shared run dir,
so it still fails when that callback breaks. The runs use debug=full, so they also show that
the seven checks leave training alone: the strategy tests' learning and exact-resume
assertions hold with every check on.

PLANTED_DDP does the same for planted bugs of three checks that do not interfere, and SWEEP
for a multirun whose 2-process jobs are also strategy runs (below).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.conftest import FAST, TINY_NET, assert_ok, only_run_dir, run_train

# 6 steps, validation and a checkpoint every 3 (the resume test restarts from step 3)
TWO_PROC = [a for a in FAST if not a.startswith(("trainer.max_steps", "trainer.val_check_interval",
                                                  "trainer.limit_val_batches"))] + [
    "trainer=ddp_sim",
    "trainer.max_steps=6",
    "trainer.val_check_interval=3",
    "trainer.limit_val_batches=1",
    "callbacks.model_checkpoint.every_n_train_steps=3",
    "export.hf=false",
]
# every check on, with cadences that fall inside 6 steps: grad norms and per-rank stats every
# 2 steps, one replayed step, the profiler recording step 2 without shapes and memory (with
# them, a window cost ~60 s of CPU under 2-process ZeRO-3 here, more than the rest of the run;
# the 1-process profiler tests record both)
DEBUG_FULL = [
    "debug=full",
    "callbacks.profiler.wait=1",
    "callbacks.profiler.active=1",
    "callbacks.profiler.record_shapes=false",
    "callbacks.profiler.profile_memory=false",
    "callbacks.reproducibility.replay_steps=1",
    "callbacks.grad_monitor.every_n_steps=2",
    "callbacks.log_sync.every_n_steps=2",
]
HEALTHY = {strategy: TWO_PROC + [f"strategy={strategy}", *DEBUG_FULL] for strategy in ("ddp", "zero3")}
# as from a user's shell, where PYTHONHASHSEED is not exported (the reproducibility tests check
# that the child rank inherits the callback's value)
ENV = {"PYTHONHASHSEED": "random"}

_runs: dict[str, tuple[Path, Any]] = {}


def healthy_run(strategy: str, tmp_path_factory: Any, cache: Path) -> tuple[Path, Any]:
    """(run dir, finished process) of HEALTHY[strategy] ("ddp" or "zero3"), run once per session."""
    return _once(strategy, HEALTHY[strategy], tmp_path_factory, cache, env=ENV)


# The other strategies' runs (tests/distributed/test_distributed.py): TWO_PROC without checks. zero1 uses
# another seed, so the reproducibility test can show that a seed changes the loss.
OTHER_SEED = {"zero1": ["seed=43"]}


def strategy_args(strategy: str) -> list[str]:
    if strategy in HEALTHY:
        return HEALTHY[strategy]
    return TWO_PROC + [f"strategy={strategy}", *OTHER_SEED.get(strategy, [])]


def strategy_run(strategy: str, tmp_path_factory: Any, cache: Path) -> tuple[Path, Any]:
    """(run dir, finished process) of the 2-process run of ``strategy`` (6 steps, checkpoints at
    3 and 6), once per session: the healthy debug=full run for ddp and zero3, the sweep's job
    for zero2_offload (process: the sweep's), a plain run otherwise."""
    if strategy in HEALTHY:
        return healthy_run(strategy, tmp_path_factory, cache)
    if strategy == "zero2_offload":
        return sweep_job(strategy, tmp_path_factory, cache), sweep_run(tmp_path_factory, cache)[1]
    return _once(strategy, strategy_args(strategy), tmp_path_factory, cache)


# One multirun for three uses: jobs with optim.lr=-1 fail validation in their own process in
# ~1 s, before any rank starts; the optim.lr=3e-3 jobs (the default lr) are ordinary 2-process
# runs of strategy_args(), with ZeRO-2 and ZeRO-2 + CPU offload. tests/distributed/test_sweeps.py checks
# the sweep; tests/distributed/test_distributed.py reads the zero2_offload job as that strategy's run, and
# the zero2 job as the re-run of the zero2 strategy run (same seed and config: the same loss
# curve, bit for bit, also inside a sweep).
SWEEP = ["-m", "optim.lr=-1,3e-3", "strategy=zero2,zero2_offload", *TWO_PROC]


def sweep_run(tmp_path_factory: Any, cache: Path) -> tuple[Path, Any]:
    """(log dir, finished process) of SWEEP, once per session; the sweep exits 1 (failed jobs)."""
    if "sweep" not in _runs:
        log_dir = tmp_path_factory.mktemp("sweep")
        _runs["sweep"] = (log_dir, run_train(SWEEP, log_dir, cache, timeout=600))
    return _runs["sweep"]


def sweep_job(strategy: str, tmp_path_factory: Any, cache: Path) -> Path:
    """The dir of the sweep's completed job for ``strategy`` (lr 3e-3)."""
    log_dir, proc = sweep_run(tmp_path_factory, cache)
    for status in (log_dir / "train" / "multiruns").glob("*/*/job_status.json"):
        job = json.loads(status.read_text())
        if f"strategy={strategy}" in job["overrides"] and "optim.lr=0.003" in job["overrides"]:
            assert job["status"] == "completed", (job, proc.stderr[-5000:])
            return status.parent
    raise AssertionError(f"no strategy={strategy} job in the sweep\n{proc.stderr[-5000:]}")


def _once(name: str, args: list[str], tmp_path_factory: Any, cache: Path, env: dict | None = None) -> tuple[Path, Any]:
    if name not in _runs:
        log_dir = tmp_path_factory.mktemp(name)
        proc = run_train(args, log_dir, cache, timeout=600, env=env)
        assert_ok(proc)
        _runs[name] = (only_run_dir(log_dir), proc)
    return _runs[name]


# One planted 2-process DDP run for three checks whose plants do not touch each other's
# signals: the distributed sampler is off (data_inspector: identical batches on both ranks),
# rank 1 sleeps 1 s at every step (log_sync: a straggler), and on rank 1 the forward pass of
# the MLP's output layer returns NaN at the last step (grad_monitor: non-finite loss on rank 1;
# being the last step, no later step trains on the NaN weights). None of them depends on the
# model: a small plain net.
PLANTED_DDP = [a for a in TWO_PROC if not a.startswith("callbacks.model_checkpoint")] + [
    *TINY_NET, "strategy=ddp", "export.fp32=false", "trainer.use_distributed_sampler=false",
    "+callbacks=[comm_debug,log_sync,grad_monitor,data_inspector]",
    "callbacks.log_sync.every_n_steps=2", "callbacks.grad_monitor.every_n_steps=2",
    "callbacks.data_inspector.every_n_steps=2",
    "+callbacks.slow._target_=tests.planted_comm.SleepOnRank", "+callbacks.slow.rank=1",
    "+callbacks.slow.every_step=true", "+callbacks.slow.seconds=1.0",
    "+callbacks.nan._target_=tests.planted_grads.NaNForward", "+callbacks.nan.module=mlp.2",
    "+callbacks.nan.step=5", "+callbacks.nan.rank=1",
]


def planted_ddp_run(tmp_path_factory: Any, cache: Path) -> tuple[Path, Any]:
    """(run dir, finished process) of PLANTED_DDP, run once per session; it must complete."""
    return _once("planted_ddp", PLANTED_DDP, tmp_path_factory, cache)


def read_findings(run_dir: Path) -> list[dict]:
    """Every record of the run's findings.jsonl (all checks, all ranks)."""
    path = run_dir / "findings.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
