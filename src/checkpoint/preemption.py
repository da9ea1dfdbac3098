"""Preemption: SIGTERM / SIGUSR1 -> a verified checkpoint at the next optimizer step, clean exit.

Schedulers announce the end of a job with a signal and a grace period (SLURM: ``--signal=USR1@90``
then SIGTERM; Kubernetes and most clouds: SIGTERM). Lightning's own SIGTERM handling raises
``SIGTERMException`` at the next batch without a checkpoint, and its handler broadcasts from
inside the signal handler (a collective that can interleave with one already in flight). Here:

- the handler only records the signal; nothing runs inside it;
- at every optimizer-step boundary the ranks agree (one all-reduce of a flag) whether any rank
  got a signal, so they all stop at the same step even when only one was signalled;
- a signal recorded while the run was starting (``distributed/startup_signals.py``: from the
  entry point's first line) is taken over; at ``on_train_start`` the ranks agree on it once, and
  fit ends before its first step (nothing to save, the same ``preempted`` finding and status);
- then every rank saves ``checkpoints/preempt_step_<N>.ckpt`` (manifest + verify, see
  ``integrity.py``), a ``preempted`` finding names the signal and step, and fit ends;
  ``train.py`` skips the exports and exits 0; the same command with ``resume=auto`` in the same
  run dir (a requeued job) continues from that step, as does ``resume=latest``.

The checkpoint also carries every rank's RNG state (python, numpy, torch, CUDA) so that a resumed
run draws the same random numbers (dropout, sampling) as the uninterrupted one.
"""

from __future__ import annotations

import logging
import random
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback

from dsdebug.distributed.collectives import any_rank
from dsdebug.distributed import startup_signals
from dsdebug.errors import ConfigError

__all__ = ["PreemptionCheckpoint", "SIGNALS"]

log = logging.getLogger(__name__)

SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGCONT")


def _rng_state() -> dict[str, Any]:
    # plain lists/ints/tensors only: a DDP checkpoint loads with torch.load(weights_only=True)
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class PreemptionCheckpoint(Callback):
    def __init__(self, dirpath: str | Path, signals: list[str] | tuple[str, ...] = ("SIGTERM", "SIGUSR1"),
                 enabled: bool = True) -> None:
        bad = [s for s in signals if s not in SIGNALS]
        if bad:
            raise ConfigError(f"preemption.signals: {bad[0]!r} is not a valid signal; valid: {', '.join(SIGNALS)}")
        self.dirpath = Path(dirpath)
        self.signals = [getattr(signal, s) for s in signals] if enabled else []
        self.received: int | None = None
        self.path: Path | None = None  # the preemption checkpoint, once written
        self.step: int | None = None
        self.before_first_step = False  # stopped at on_train_start: a signal while the run was starting
        self._last_step = -1
        self._rng_to_restore: dict[str, Any] | None = None

    # ----------------------------------------------------------------- signals
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if not self.signals:
            return
        connector = trainer._signal_connector

        def register() -> None:  # replaces Lightning's, keeping its restore-on-teardown
            connector.received_sigterm = False
            # the start-up recorder is not put back after fit: the signal's default action is
            connector._original_handlers = startup_signals.take_over(connector._get_current_signal_handlers())
            for signum in self.signals:
                signal.signal(signum, self._on_signal)

        connector.register_signal_handlers = register

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum

    @property
    def stopped(self) -> bool:
        """This fit ended on a preemption signal (with a checkpoint, or before its first step)."""
        return self.path is not None or self.before_first_step

    def _stop_before_first_step(self, trainer: Any) -> bool:
        """A signal while the run was starting (imports, DeepSpeed init, an op build) on any rank:
        every rank stops before the first step; the newest checkpoint, if any, is where it resumes."""
        if self.received is None and startup_signals.received() in self.signals:
            self.received = startup_signals.received()
        if not any_rank(trainer, self.received is not None):  # collective, once per fit
            return False
        from dsdebug.findings import Finding, get_channel

        self.before_first_step, self.step = True, trainer.global_step
        if trainer.is_global_zero:
            name = signal.Signals(self.received).name if self.received is not None else "a signal on another rank"
            get_channel().report(Finding(
                check="preemption", severity="warning", code="preempted",
                message=f"{name} received while the run was starting; stopped before the first step "
                        f"(step {trainer.global_step}), nothing to save",
                advice="run the same command again (resume=auto in this run dir continues from its newest "
                       "checkpoint, if an earlier attempt left one)",
                step=trainer.global_step, details={"signal": name, "stage": "start of fit", "checkpoint": None},
            ))
        trainer.should_stop = True
        return True

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.signals or trainer.global_step == self._last_step:
            return  # inside a gradient-accumulation window: not a step boundary
        self._last_step = trainer.global_step
        if not any_rank(trainer, self.received is not None):  # collective
            return
        from dsdebug.findings import Finding, get_channel
        from dsdebug.checkpoint.integrity import save_verified

        step = trainer.global_step
        self.path = self.dirpath / f"preempt_step_{step:06d}.ckpt"
        self.step = step
        save_verified(trainer, self.path)
        if trainer.is_global_zero:
            name = signal.Signals(self.received).name if self.received is not None else "a signal on another rank"
            get_channel().report(Finding(
                check="preemption", severity="warning", code="preempted",
                message=f"{name} received; saved {self.path.name} at step {step} and stopped",
                advice="run the same command with resume=auto in this run dir (hydra.run.dir=<it>; SLURM requeue: "
                       "examples/slurm/train.sbatch), or resume=latest",
                step=step, details={"signal": name, "checkpoint": str(self.path)},
            ))
        trainer.should_stop = True

    # ------------------------------------------------------------- RNG state
    def state_dict(self) -> dict[str, Any]:
        # called on every rank by trainer.save_checkpoint: gather all ranks' RNG states, since
        # only rank 0's copy of the checkpoint dict is written
        trainer = getattr(self, "_trainer", None)
        state = _rng_state()
        if trainer is not None and trainer.world_size > 1 and torch.distributed.is_initialized():
            states: list[Any] = [None] * trainer.world_size
            torch.distributed.all_gather_object(states, state)
        else:
            states = [state]
        return {"rng_states": states}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._rng_to_restore = state_dict

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._trainer = trainer

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.signals and self._stop_before_first_step(trainer):
            return
        # restore last, after Lightning's own setup drew from the RNGs
        if self._rng_to_restore is None:
            return
        states = self._rng_to_restore.get("rng_states") or []
        if len(states) == trainer.world_size:
            _set_rng_state(states[trainer.global_rank])
        else:
            log.warning("checkpoint has RNG states for %d rank(s), this run has %d: RNG not restored",
                        len(states), trainer.world_size)
        self._rng_to_restore = None
