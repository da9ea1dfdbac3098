"""Planted bugs for comm_debug and log_sync (planted callbacks: ``+callbacks.plant._target_=tests.planted.comm.X``)."""

from __future__ import annotations

import time

from lightning.pytorch import Callback


class SleepOnRank(Callback):
    """Rank ``rank`` sleeps ``seconds`` at the start of step ``step`` (or of every step):
    a stuck rank (hang) or a slow one (straggler)."""

    def __init__(self, rank: int = 1, step: int = 2, seconds: float = 600.0, every_step: bool = False) -> None:
        self.rank, self.step, self.seconds, self.every_step = rank, step, seconds, every_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and (self.every_step or trainer.global_step == self.step):
            time.sleep(self.seconds)


class RaiseAtStep(Callback):
    """A job that crashes at step ``step``."""

    def __init__(self, step: int = 2) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"planted crash at step {self.step}")


class SigkillAtStep(Callback):
    """Rank ``rank`` SIGKILLs itself at the start of step ``step`` (the OOM killer, a lost node).
    Writes the time of the kill to ``stamp`` first, so a test can measure how long the rest
    of the job takes to end."""

    def __init__(self, rank: int = 1, step: int = 2, stamp: str | None = None) -> None:
        self.rank, self.step, self.stamp = rank, step, stamp

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            import os
            import signal

            if self.stamp:
                with open(self.stamp, "w") as f:
                    f.write(f"{time.time()}\n")
            os.kill(os.getpid(), signal.SIGKILL)
