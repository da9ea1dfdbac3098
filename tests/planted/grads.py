"""Planted bugs (and a witness) for the grad_monitor and freeze_verify tests.

Used from the command line of a real run, e.g.
``+callbacks.nan._target_=tests.planted.grads.CorruptGrad +callbacks.nan.param=model.layers.0.weight
+callbacks.nan.step=2`` or ``model.net._target_=tests.planted.grads.NetWithDeadParams``.
Parameter names are the net's own (no ``net.`` prefix).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback
from torch import nn


def _named(pl_module: Any) -> dict[str, torch.nn.Parameter]:
    return {(n[4:] if n.startswith("net.") else n): p for n, p in pl_module.named_parameters()}


class CorruptGrad(Callback):
    """At ``step`` (on ``rank``, None = every rank) the gradient of ``param`` gets one NaN
    element (``mode=nan``) or is multiplied by ``factor`` (``mode=scale``), before any reduction."""

    def __init__(self, param: str, step: int, mode: str = "nan", factor: float = 1e6, rank: int | None = None,
                 every: bool = False):
        """``every``: at every step from ``step`` on (a broken hook), not at that step only."""
        self.param, self.step, self.mode, self.factor, self.rank = param, step, mode, factor, rank
        self.every = every

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.trainer = trainer
        _named(pl_module)[self.param].register_hook(self._corrupt)

    def _corrupt(self, grad: torch.Tensor) -> torch.Tensor:
        at = self.trainer.global_step >= self.step if self.every else self.trainer.global_step == self.step
        if not at or self.rank not in (None, self.trainer.global_rank):
            return grad
        if self.mode == "scale":
            return grad * self.factor
        grad = grad.clone()
        grad.view(-1)[grad.numel() // 2] = float("nan")
        return grad


class NaNForward(Callback):
    """At ``step`` on ``rank`` the output of module ``module`` becomes NaN (a forward bug)."""

    def __init__(self, module: str, step: int, rank: int | None = None):
        self.module, self.step, self.rank = module, step, rank

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.trainer = trainer
        modules = {(n[4:] if n.startswith("net.") else n): m for n, m in pl_module.named_modules()}
        modules[self.module].register_forward_hook(self._poison)

    def _poison(self, module: Any, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        if self.trainer.global_step == self.step and self.trainer.training and \
                self.rank in (None, self.trainer.global_rank):
            return output * float("nan")
        return output


class ParamRecorder(Callback):
    """Witness: per-parameter (sum, sum of squares) before and after each of ``steps``, written
    by rank 0 to ``<run_dir>/param_record.json``. Under ZeRO-3 it gathers the full parameters
    (a collective, on every rank)."""

    def __init__(self, steps: list[int]):
        self.steps = set(int(s) for s in steps)
        self.record: dict[str, dict] = {}

    def _sums(self, trainer: Any, pl_module: Any) -> dict[str, list[float]]:
        from contextlib import nullcontext

        params = _named(pl_module)
        ctx = nullcontext()
        if getattr(trainer.strategy, "zero_stage_3", False):
            import deepspeed

            ctx = deepspeed.zero.GatheredParameters(list(params.values()))
        with ctx, torch.no_grad():
            return {n: [float(p.double().sum()), float(p.double().pow(2).sum())] for n, p in params.items()}

    def _save(self, trainer: Any, pl_module: Any, when: str) -> None:
        if trainer.global_step in self.steps:
            sums = self._sums(trainer, pl_module)  # every rank (ZeRO-3 gathers)
            if trainer.global_rank == 0:
                self.record.setdefault(str(trainer.global_step), {})[when] = sums
                Path(trainer.default_root_dir, "param_record.json").write_text(json.dumps(self.record))

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._save(trainer, pl_module, "before")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # global_step already counts this batch's update: record it under the step it belonged to
        step = trainer.global_step - 1
        if step in self.steps:
            sums = self._sums(trainer, pl_module)
            if trainer.global_rank == 0:
                self.record.setdefault(str(step), {})["after"] = sums
                Path(trainer.default_root_dir, "param_record.json").write_text(json.dumps(self.record))


def all_finite(sums: dict[str, list[float]]) -> bool:
    return all(math.isfinite(v) for pair in sums.values() for v in pair)


class NetWithDeadParams(nn.Module):
    """A tiny LM with three planted reasons for parameters that never learn:
    ``unused`` is never called in forward, ``detached``'s output is detached, and the net
    itself sets ``frozen.weight.requires_grad = False`` (although the config trains it).
    ``dead=False`` gives the same net without them (healthy)."""

    def __init__(self, vocab_size: int = 4096, hidden_size: int = 32, dead: bool = True, **_: Any):
        super().__init__()
        self.dead = dead
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(2))
        self.unused = nn.Linear(hidden_size, hidden_size)
        self.detached = nn.Linear(hidden_size, hidden_size)
        self.frozen = nn.Linear(hidden_size, hidden_size)
        if dead:
            self.frozen.weight.requires_grad_(False)  # the planted mistake: frozen in model code
        self.lm_head = nn.Linear(hidden_size, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        if self.dead:
            h = h + self.detached(h).detach()  # the planted mistake: no gradient flows back
        else:
            h = h + self.detached(h) + self.unused(h)
        h = h + self.frozen(h)
        return self.lm_head(h)


def changed_params(run_dir: Path, step: int) -> list[str]:
    rec = json.loads((run_dir / "param_record.json").read_text())[str(step)]
    return [n for n in rec["before"] if rec["before"][n] != rec["after"][n]]
