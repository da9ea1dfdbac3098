"""A scheduler's preemption signal inside a submitit job (``+callbacks.plant._target_=tests.planted.submitit.X``)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from lightning.pytorch import Callback


class SignalJobAtStep(Callback):
    """At step ``step`` of the job's first run, send ``signal`` to the submitit job process (this
    training's parent), as submitit's local controller or SLURM does before a time limit, and hold
    the step until the job process has passed it on to this process: the preemption checkpoint then
    falls on the next step boundary whatever the machine's load. ``step < 0``: never."""

    def __init__(self, step: int = 2, signame: str = "SIGUSR2") -> None:
        self.step, self.signum = step, getattr(signal, signame)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        marker = Path(trainer.default_root_dir) / "planted_signal_sent"
        if trainer.global_step != self.step or marker.exists():
            return
        marker.write_text(str(os.getppid()))
        preemption = next(c for c in trainer.callbacks if type(c).__name__ == "PreemptionCheckpoint")
        os.kill(os.getppid(), self.signum)
        deadline = time.monotonic() + 120
        while preemption.received is None and time.monotonic() < deadline:
            time.sleep(0.01)
