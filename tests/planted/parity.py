"""Planted replica divergence for the replica_parity tests (and reproducibility's rank pointer).

``+callbacks.drift._target_=tests.planted.parity.PerturbParam +callbacks.drift.param=model.layers.1.mlp.down_proj.weight
+callbacks.drift.step=3 +callbacks.drift.rank=1``: at the start of ``step`` (before its forward) rank
``rank`` alone adds ``delta`` to one element of ``param`` in place, as a silent bit flip or a
rank-local op would. ``in_forward=true`` does it in a forward pre-hook of the parameter's module
instead, on every forward of that step: a replayed forward then sees other weights than the
real one, on that rank only. Parameter names are the net's own (no ``net.`` prefix).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback


class PerturbParam(Callback):
    def __init__(self, param: str, step: int, rank: int = 1, delta: float = 1e-3, in_forward: bool = False):
        self.param, self.step, self.rank, self.delta, self.in_forward = param, step, rank, delta, in_forward

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.trainer = trainer
        named = {(n[4:] if n.startswith("net.") else n): p for n, p in pl_module.named_parameters()}
        self.p = named[self.param]
        if self.in_forward:
            modules = {(n[4:] if n.startswith("net.") else n): m for n, m in pl_module.named_modules()}
            modules[self.param.rsplit(".", 1)[0]].register_forward_pre_hook(lambda *_: self._maybe_perturb())

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not self.in_forward:
            self._maybe_perturb()

    def _maybe_perturb(self) -> None:
        t = self.trainer
        if t.global_step == self.step and t.global_rank == self.rank and t.training:
            with torch.no_grad():
                self.p.data.view(-1)[0] += self.delta
