"""Sweeps through Hydra's submitit launchers (hydra-submitit-launcher): one job = one training run.

What runs where (``python train.py -m hydra/launcher=slurm ...``):

- the Hydra process composes the sweep, pickles the launcher and submits ONE sbatch job array:
  an array task per sweep job, ``%array_parallelism`` of them at a time. It then waits for the
  results and prints the sweep summary (src/distributed/sweep.py);
- an array task is ``srun python -m submitit.core._submit``: ``tasks_per_node x nodes``
  processes, and every one of them runs the Hydra job function (src/trainer/cli.py ``run``);
- each of those starts ``train.py`` for this job (`run_job_in_subprocess`), which inherits
  SLURM_PROCID, SLURM_NTASKS, ...: Lightning's ``SLURMEnvironment`` makes the job's tasks the
  ranks of one run, so ``trainer.devices x trainer.num_nodes`` must equal
  ``tasks_per_node x nodes``. The preset ``hydra/launcher=slurm`` derives the launcher's numbers
  from the trainer's; `check_sweep` refuses a sweep whose jobs contradict them, in one line,
  before anything is submitted (a job that cannot run must not wait in the queue first);
- under ``submitit_local`` a job is one submitit process (``tasks_per_node=1``) whose ``train.py``
  starts its own ``trainer.devices`` ranks, as under Hydra's basic launcher.

Preemption: three signal handlers, one checkpoint, one requeue.

- submitit's own handler (its job process, ``SUBMITIT_PREEMPT_SIGNAL``, USR2 by default, which
  SLURM sends ``signal_delay_s`` before the time limit) pickles the job and ``scontrol requeue``s
  at once: the training would die mid-step, without a checkpoint. `JobSignals` holds it back
  while ``train.py`` runs, passes the signal on (SLURM signals the whole step too; a duplicate is
  harmless) and calls it only after the training saved ``preempt_step_N.ckpt`` and exited with
  status ``preempted``. submitit then requeues as it would have (counting time-outs against
  ``max_num_timeout``); the requeued job runs in the same job dir.
- ``train.py`` handles submitit's signal too (`child_overrides` adds it to ``preemption.signals``).
- Lightning's SLURM auto-requeue (SIGUSR1 -> ``hpc_ckpt`` + ``scontrol requeue``) is not installed
  while ``preemption.enabled``: src/checkpoint/preemption.py replaces Lightning's signal
  registration, so nothing requeues the job a second time.
- SIGTERM: submitit ignores it in its own process; ``train.py`` checkpoints on it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from typing import Any, Callable

from dsdebug.errors import ConfigError

__all__ = ["JobSignals", "check_shape", "check_sweep", "child_overrides", "current_job", "launcher_kind"]

log = logging.getLogger(__name__)

_KINDS = {"SlurmLauncher": "submitit_slurm", "LocalLauncher": "submitit_local"}
_PASSED_ON = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)


def launcher_kind(hydra_cfg: Any) -> str | None:
    """``submitit_slurm`` / ``submitit_local`` for the launcher in a composed ``hydra`` node."""
    target = str((hydra_cfg.get("launcher") or {}).get("_target_", ""))
    return _KINDS.get(target.rsplit(".", 1)[-1]) if "hydra_submitit_launcher" in target else None


def check_shape(kind: str, tasks_per_node: Any, nodes: Any, cfg: Any, where: str = "hydra.launcher") -> None:
    """Every task of a SLURM job is one rank: tasks per node x nodes = devices x num_nodes."""
    devices, num_nodes = cfg.trainer.devices, cfg.trainer.get("num_nodes", 1)
    if kind == "submitit_local":
        if tasks_per_node != 1:
            raise ConfigError(
                f"{where}.tasks_per_node={tasks_per_node}: submitit_local would start that many independent copies "
                f"of each job; valid: 1 (the job starts its trainer.devices={devices} ranks itself)")
        return
    _devices_a_number(kind, cfg)
    if (tasks_per_node, nodes) != (devices, num_nodes):
        raise ConfigError(
            f"trainer.devices={devices} x trainer.num_nodes={num_nodes} does not match {where}.tasks_per_node="
            f"{tasks_per_node} x {where}.nodes={nodes} (each SLURM task is one rank of the job's run; one job "
            f"array has one shape); valid: equal numbers, e.g. hydra/launcher=slurm, which derives them from the "
            f"trainer (a sweep over trainer.devices or trainer.num_nodes needs one multirun per shape)")
    accelerator = str(cfg.trainer.get("accelerator", "cpu"))
    launcher = cfg.hydra.launcher
    if accelerator in ("gpu", "cuda") and not any(launcher.get(k) for k in ("gpus_per_node", "gpus_per_task", "gres")):
        raise ConfigError(
            f"trainer.accelerator={accelerator} but {where}.gpus_per_node is not set: SLURM would give the job no "
            f"GPU; valid: {where}.gpus_per_node={devices} (or gpus_per_task / gres)")


def _devices_a_number(kind: str, cfg: Any) -> None:
    devices = cfg.trainer.devices
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ConfigError(
            f"trainer.devices={devices}: under hydra/launcher={kind} every SLURM task is one rank, so the "
            f"processes per node must be a number; valid: trainer.devices=<GPUs per node> (hydra/launcher=slurm "
            f"asks SLURM for that many tasks per node)")


def check_sweep(master: Any, jobs: list[Any]) -> None:
    """Before submission: the launcher is built from the sweep's master config (sweep overrides
    left out), so its task numbers hold for every job; each job's trainer must agree."""
    kind = launcher_kind(master.hydra)
    if kind is None:
        return
    if kind == "submitit_slurm":
        for cfg in (master, *jobs):  # before reading the launcher's numbers: the preset interpolates them
            _devices_a_number(kind, cfg)
    launcher = master.hydra.launcher
    tasks, nodes = launcher.get("tasks_per_node", 1), launcher.get("nodes", 1)
    for job in jobs:
        check_shape(kind, tasks, nodes, job)


def current_job() -> Any:
    """submitit's JobEnvironment when this process is a submitit job, else None."""
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return None
    import submitit

    return submitit.JobEnvironment()


def child_overrides(cfg: Any, rank: int) -> list[str]:
    """Extra overrides for this task's ``train.py``: submitit's preemption signal is a preemption
    signal; a task other than the first is a rank that logs to rank<N>.log and writes no .hydra/."""
    from submitit import JobEnvironment

    extra = []
    pre = cfg.get("preemption") or {}
    signals = list(pre.get("signals", ["SIGTERM", "SIGUSR1"]))
    usr = f"SIG{JobEnvironment.USR_SIG}"
    if pre.get("enabled", True) and usr not in signals:
        extra.append(f"preemption.signals=[{','.join([*signals, usr])}]")
    if rank != 0:
        extra += ["hydra.output_subdir=null", f"hydra.job.name=rank{rank}"]
    return extra


class JobSignals:
    """While the job's ``train.py`` runs: note a preemption signal and pass it on, instead of
    letting submitit requeue (or the default action end) this process before the checkpoint."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.proc: subprocess.Popen | None = None
        self.saved: dict[int, Any] = {}

    def __enter__(self) -> JobSignals:
        for signum in _PASSED_ON:
            self.saved[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self.saved.items():
            signal.signal(signum, handler)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)

    def requeue(self) -> str | None:
        """Hand the preemption to submitit now that the checkpoint is written. On the job's first
        task submitit requeues it and ends this process (SLURM: ``scontrol requeue``; local: the
        controller restarts it); returns why not otherwise (e.g. timed out too many times)."""
        from submitit import JobEnvironment
        from submitit.core.utils import UncompletedJobError

        usr = JobEnvironment._usr_sig()
        handler: Callable[..., Any] | Any = self.saved.get(usr)
        if not callable(handler):
            return f"no submitit handler for {usr.name}"
        log.info("training saved its preemption checkpoint; submitit requeues the job")
        try:
            handler(usr, None)  # submitit's checkpoint_and_try_requeue: sys.exit() once requeued
        except (UncompletedJobError, subprocess.SubprocessError, OSError) as e:
            return " ".join(str(e).split())
        return None
