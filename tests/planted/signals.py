"""A preemption signal while fit is still starting (``+callbacks.plant._target_=tests.planted.signals.SignalInSetup``):
the rank sends itself the signal in ``setup``, after the Trainer exists and before DeepSpeed/DDP set up
the model and optimizer, where a scheduler's signal lands in the first minute of a job. Without the
start-up recorder (src/distributed/startup_signals.py) the process dies by the signal's default action."""

from __future__ import annotations

import os
import signal
from typing import Any

from lightning.pytorch import Callback


ENV = "DSDEBUG_TEST_SIGNAL_IN_SETUP"  # "SIGUSR1:1": that signal to rank 1; unset: nothing (the requeued attempt)


class SignalInSetup(Callback):
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        signame, _, rank = os.environ.get(ENV, "").partition(":")
        if signame and trainer.global_rank == int(rank or 0):
            os.kill(os.getpid(), getattr(signal, signame))
