"""Runs that several tests read, each made once per session (the first test that asks pays for it).

A 2-process run spends ~20 s of CPU starting up (two interpreters importing torch, Lightning,
DeepSpeed, transformers) before its first step, so the suite makes one run per strategy and one
run per group of planted bugs, and every test reads the run dir it needs:

- ``healthy_run("ddp" | "zero3")``: 2 processes, debug=full, 6 steps, checkpoints at 3 and 6. The
  ddp and zero3 strategy runs (tests/distributed/test_distributed.py: learning, checkpoints, exports),
  debug=full reports only info (tests/callbacks/test_presets.py), and each check's healthy 2-process
  case: comm share (comm_debug), per-rank stats and timeline (log_sync), traces per rank (profiler),
  replay and records on every rank (reproducibility), disjoint batches per rank (data_inspector),
  all parameters verified (freeze_verify), the DDP reference grad norms for grad_monitor under
  ZeRO-3, one console line per message (tests/trainer/test_console.py), the report of a healthy run.
- ``strategy_run(s)``: the other strategies' 2-process runs (zero1 and zero3_offload plain runs;
  zero2 and zero2_offload are the jobs of SWEEP, a multirun that also has two failing jobs).
- ``planted_ddp_run``: one 2-process DDP run with the planted bugs of three checks whose signals do
  not touch (data_inspector, log_sync, grad_monitor).
- ``grad_run(name)``: grad_monitor's and freeze_verify's planted runs (1 process ZeRO-2 and DDP;
  2 processes ZeRO-3 in make test-all only).
- ``data_run(name)``: reproducibility's, data_inspector's and profiler's 1-process runs (healthy,
  healthy again, planted).

Each test reads its own check's findings and artifacts in the shared run dir, so it still fails
when that check breaks. The healthy runs use debug=full, so they also show that the checks leave
training alone: the strategy tests' learning assertions hold with every check on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tests.helpers.findings import read_findings
from tests.helpers.runs import SMOKE, TINY_NET, assert_ok, only_run_dir, run_train, train_in_process

# 6 steps, validation and a checkpoint every 3 (the resume test restarts from step 3)
TWO_PROC = SMOKE + [
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
_failed: dict[str, str] = {}  # a shared run that failed is not made again by each test that reads it


def _memo(name: str, make: Any) -> Any:
    """``_runs[name]``, made by ``make()`` the first time; a failure is remembered and repeated to
    every later reader at once (a timed-out 2-process run would otherwise cost each of them 10 min)."""
    if name in _failed:
        raise AssertionError(f"the shared run {name!r} failed earlier in this session: {_failed[name]}")
    if name not in _runs:
        try:
            _runs[name] = make()
        except BaseException as e:
            _failed[name] = f"{type(e).__name__}: {str(e)[-2000:]}"
            raise
    return _runs[name]


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
    for zero2 and zero2_offload (process: the sweep's), a plain run otherwise."""
    if strategy in HEALTHY:
        return healthy_run(strategy, tmp_path_factory, cache)
    if strategy in ("zero2", "zero2_offload"):
        return sweep_job(strategy, tmp_path_factory, cache), sweep_run(tmp_path_factory, cache)[1]
    return _once(strategy, strategy_args(strategy), tmp_path_factory, cache)


def zero2_rerun(tmp_path_factory: Any, cache: Path) -> tuple[Path, Any]:
    """The zero2 strategy run's command line again, as a plain run (not a sweep job): the same
    seed and config must give the sweep job's loss curve bit for bit (make test-all only)."""
    return _once("zero2_rerun", strategy_args("zero2"), tmp_path_factory, cache)


# One multirun for three uses: jobs with optim.lr=-1 fail validation in their own process in
# ~1 s, before any rank starts; the optim.lr=3e-3 jobs (the default lr) are ordinary 2-process
# runs of strategy_args(), with ZeRO-2 and ZeRO-2 + CPU offload. tests/distributed/test_sweeps.py checks
# the sweep; tests/distributed/test_distributed.py reads the two jobs as those strategies' runs, and
# compares the zero2 job with a plain re-run of its command line (same seed and config: the same
# loss curve, bit for bit, also inside a sweep).
SWEEP = ["-m", "optim.lr=-1,3e-3", "strategy=zero2,zero2_offload", *TWO_PROC]


def sweep_run(tmp_path_factory: Any, cache: Path) -> tuple[Path, Any]:
    """(log dir, finished process) of SWEEP, once per session; the sweep exits 1 (failed jobs)."""
    def make() -> tuple[Path, Any]:
        log_dir = tmp_path_factory.mktemp("sweep")
        return log_dir, run_train(SWEEP, log_dir, cache, timeout=600)

    return _memo("sweep", make)


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
    def make() -> tuple[Path, Any]:
        log_dir = tmp_path_factory.mktemp(name)
        proc = run_train(args, log_dir, cache, timeout=600, env=env)
        assert_ok(proc)
        return only_run_dir(log_dir), proc

    return _memo(name, make)


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
    "+callbacks.slow._target_=tests.planted.comm.SleepOnRank", "+callbacks.slow.rank=1",
    "+callbacks.slow.every_step=true", "+callbacks.slow.seconds=1.0",
    "+callbacks.nan._target_=tests.planted.grads.NaNForward", "+callbacks.nan.module=mlp.2",
    "+callbacks.nan.step=5", "+callbacks.nan.rank=1",
]


def planted_ddp_run(tmp_path_factory: Any, cache: Path) -> tuple[Path, Any]:
    """(run dir, finished process) of PLANTED_DDP, run once per session; it must complete."""
    return _once("planted_ddp", PLANTED_DDP, tmp_path_factory, cache)


# ---- 1-process runs that two or three test files read -------------------------------------------
# grad_monitor and freeze_verify (tests/callbacks/test_cb_{grad_monitor,freeze_verify}.py): each run
# carries several planted gradient bugs (tests/planted/grads.py) and a parameter recorder; the
# 2-process ZeRO-3 one trains only layer 0 as well.
_GRAD_BASE = SMOKE + ["export.hf=false", "+callbacks=[grad_monitor,freeze_verify]"]
_PLANT = "+callbacks.{0}._target_=tests.planted.grads.{1}"
GRAD_RUNS = {
    # 1 process (in this process), ZeRO-2 (DeepSpeed skip path), a net with dead parameters, three
    # gradient bugs
    "zero2_dead_net": _GRAD_BASE + [
        "trainer.max_steps=6", "trainer.val_check_interval=6", "export.fp32=false",
        "model.net._target_=tests.planted.grads.NetWithDeadParams", "model.net.hidden_size=32",
        "callbacks.grad_monitor.on_error=skip", "callbacks.grad_monitor.every_n_steps=1",
        "callbacks.grad_monitor.warmup_steps=2",
        _PLANT.format("nan", "CorruptGrad"), "+callbacks.nan.param=layers.0.weight", "+callbacks.nan.step=2",
        _PLANT.format("big", "CorruptGrad"), "+callbacks.big.param=layers.1.weight", "+callbacks.big.step=3",
        "+callbacks.big.mode=scale",
        _PLANT.format("spike", "CorruptGrad"), "+callbacks.spike.param=layers.1.weight", "+callbacks.spike.step=5",
        "+callbacks.spike.mode=scale", "+callbacks.spike.factor=30",
        _PLANT.format("rec", "ParamRecorder"), "+callbacks.rec.steps=[1,2,3]"],
    # 1 process, plain DDP (torch optimizer skip path), on_error=stop at a NaN in step 3
    "ddp_stop": _GRAD_BASE + [
        "trainer.max_steps=6", "trainer.val_check_interval=6", "strategy=ddp",
        "model.net._target_=tests.planted.grads.NetWithDeadParams", "model.net.hidden_size=32", "+model.net.dead=false",
        "callbacks.grad_monitor.on_error=stop",
        _PLANT.format("nan", "CorruptGrad"), "+callbacks.nan.param=lm_head.weight", "+callbacks.nan.step=3",
        _PLANT.format("rec", "ParamRecorder"), "+callbacks.rec.steps=[2,3]"],
    # 2 processes, ZeRO-3: train only layer 0; a NaN in one of its gradients on rank 1 at step 3,
    # exploding gradients on rank 0 at step 4 (on_error=skip: DeepSpeed's overflow path, forced)
    "zero3_2proc": _GRAD_BASE + [
        "trainer=ddp_sim", "strategy=zero3", "trainer.max_steps=5", "trainer.val_check_interval=5",
        "export.fp32=false", "callbacks.grad_monitor.every_n_steps=2",
        "callbacks.freeze_verify.train_only=[model.layers.0.*]", "callbacks.freeze_verify.check_after_steps=2",
        _PLANT.format("nan", "CorruptGrad"), "+callbacks.nan.param=model.layers.0.mlp.up_proj.weight",
        "+callbacks.nan.step=3", "+callbacks.nan.rank=1",
        "callbacks.grad_monitor.on_error=skip",
        _PLANT.format("big", "CorruptGrad"), "+callbacks.big.param=model.layers.0.self_attn.o_proj.weight",
        "+callbacks.big.step=4", "+callbacks.big.mode=scale", "+callbacks.big.rank=0",
        _PLANT.format("rec", "ParamRecorder"), "+callbacks.rec.steps=[0,4]"],
}


# trained in this process (no command line is asserted on; a failed fit raises)
_GRAD_IN_PROCESS = {"zero2_dead_net"}


def grad_run(name: str, tmp_path_factory: Any, cache: Path) -> tuple[Any, Path]:
    """(finished process, run dir) of GRAD_RUNS[name], once per session (the process may have failed:
    ``ddp_stop`` exits 3 on purpose); the process is None for a run trained in this process."""
    if name not in _runs:
        log_dir = tmp_path_factory.mktemp(name)
        if name in _GRAD_IN_PROCESS:
            run_dir = log_dir / "run"
            train_in_process(GRAD_RUNS[name], run_dir, cache)
            _runs[name] = (None, run_dir)
        else:
            _runs[name] = (run_train(GRAD_RUNS[name], log_dir, cache), only_run_dir(log_dir))
    return _runs[name]


# reproducibility, data_inspector and profiler (tests/callbacks/test_cb_{reproducibility,data_inspector,
# profiler}.py): 5 steps of 1 process each, in this process; several planted bugs share one run
# (tests/planted/data.py)
_DATA_CALLBACKS = "+callbacks=[reproducibility,data_inspector,profiler]"
_PROFILE_WINDOW = ["callbacks.profiler.wait=1", "callbacks.profiler.warmup=1", "callbacks.profiler.active=2"]
_LEAN_WINDOW = ["callbacks.profiler.wait=1", "callbacks.profiler.warmup=1", "callbacks.profiler.active=1",
                "callbacks.profiler.record_shapes=false", "callbacks.profiler.profile_memory=false"]  # small traces
_TINY_DDP = [*TINY_NET, "strategy=ddp"]  # 1-process runs: seconds
DATA_RUNS = {
    # healthy, 1 process, replay on
    "healthy": [_DATA_CALLBACKS, *_PROFILE_WINDOW, *_TINY_DDP, "callbacks.reproducibility.replay_steps=2"],
    # the same without replay or profiler, with a dataloader worker, comparing its data order
    # with "healthy"
    "healthy_again": ["+callbacks=[reproducibility,data_inspector]", *_TINY_DDP, "callbacks.reproducibility.replay_steps=0",
                      "callbacks.data_inspector.compare_with=latest", "data.num_workers=1"],
    # planted: noise module, val leak, seed-ignoring sampler, pre-shifted labels, slow collate
    "planted": [_DATA_CALLBACKS, *_LEAN_WINDOW, "callbacks.data_inspector.compare_with=latest",
                "data._target_=tests.planted.data.BuggyDataModule", "+data.collate_delay=0.5",
                "model.net._target_=tests.planted.data.NoisyLM", "strategy=ddp"],
}
_DATA_ORDER = ["healthy", "healthy_again", "planted"]  # share one log dir: "latest" finds the earlier ones


def data_run(name: str, tmp_path_factory: Any, cache: Path) -> tuple[Path, list[dict]]:
    """(run dir, findings) of DATA_RUNS[name], trained in this process once per session; the earlier
    runs of _DATA_ORDER first, in the same log dir (``compare_with=latest`` compares with them)."""
    key = f"data:{name}"
    if key in _runs:
        return _runs[key]
    for earlier in _DATA_ORDER[: _DATA_ORDER.index(name)]:
        data_run(earlier, tmp_path_factory, cache)
    if "data:log_dir" not in _runs:
        _runs["data:log_dir"] = tmp_path_factory.mktemp("data_order_runs")
    log_dir = _runs["data:log_dir"]
    run_dir = log_dir / "train" / "runs" / f"{_DATA_ORDER.index(name)}_{name}"
    args = SMOKE + ["trainer.max_steps=5", "export.fp32=false", "export.hf=false", *DATA_RUNS[name],
                    f"paths.log_dir={log_dir}"]
    at_start = os.environ.pop("PYTHONHASHSEED", None)  # as from a user's shell: not exported
    try:
        train_in_process(args, run_dir, cache)
    finally:
        if at_start is not None:
            os.environ["PYTHONHASHSEED"] = at_start
    _runs[key] = (run_dir, read_findings(run_dir))
    return _runs[key]
