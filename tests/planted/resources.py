"""Planted resource bugs for the memory and throughput tests, selected by Hydra overrides:

``+callbacks.planted._target_=tests.planted.resources.LeakFrom +callbacks.planted.step=6``
(keeps ``mb`` MB alive per step from ``step`` on, like a list of losses with their graphs),
``model.net._target_=tests.planted.resources.OOMAtStep +model.net.step=3`` (forward raises
CUDA's out-of-memory error at training step ``step``), ``+callbacks.planted._target_=
tests.planted.resources.SlowFrom +callbacks.planted.step=8`` (from ``step`` on every step takes
``1 + factor`` times as long: a node that slows down).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from lightning.pytorch import Callback

from tests.planted.data import HealthyTinyLM


class LeakFrom(Callback):
    def __init__(self, step: int, mb: int = 16) -> None:
        self.step, self.mb = step, mb
        self.kept: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step >= self.step:
            self.kept.append(torch.ones(self.mb * 2**20 // 4))  # touched: resident, never freed


class OOMAtStep(HealthyTinyLM):
    """The healthy tiny net whose training forward runs out of memory at optimizer step ``step``."""

    def __init__(self, vocab_size: int = 4096, hidden: int = 64, step: int = 3, **_: object) -> None:
        super().__init__(vocab_size, hidden)
        self.step, self.calls = step, 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.training:
            if self.calls == self.step:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB "
                                             "total capacity; 77.80 GiB already allocated)")
            self.calls += 1
        return super().forward(input_ids)


class SlowFrom(Callback):
    """From ``step`` on, each step also sleeps ``factor`` x the median of its own earlier steps (in
    backward: slow compute), so the node is (1 + factor)x slower whatever the machine's load."""

    def __init__(self, step: int, factor: float = 3.0) -> None:
        self.step, self.factor = step, factor
        self.times: list[float] = []
        self._t0 = 0.0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._t0 = time.perf_counter()

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        if trainer.global_step >= self.step and self.times:
            time.sleep(self.factor * statistics.median(self.times))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step < self.step:
            self.times.append(time.perf_counter() - self._t0)
