"""A finding on one rank only, for the node-local run dir tests (``+callbacks.plant._target_=tests.planted.ranks.ReportOnRank``):
the finding is written into that rank's own run dir and must reach rank 0's."""

from __future__ import annotations

from typing import Any

from dsdebug.callbacks.base import DebugCallback


class ReportOnRank(DebugCallback):
    name = "planted"

    def __init__(self, rank: int = 1) -> None:
        super().__init__()
        self.rank = rank

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.global_rank == self.rank:
            self.report(trainer, "info", "planted_on_rank", f"planted on rank {self.rank}")
