"""Checks with a planted bug of their own, for the fault-isolation tests (src/callbacks/isolation.py).

``RaisingCheck`` is a well-behaved check (one all-reduce of the loss every step in ``on_train_batch_end``,
rank 0 writing an ``alive`` info finding with the reduced value) until ``step`` on ``rank`` (None: every
rank), where it raises in ``hook`` at ``where``:

- ``before``: before its all-reduce, while the other ranks are already inside it (the hang the side
  channel prevents);
- ``after``: after it (nothing pending; the others go on to the next check's collective);
- ``region``: inside a ``collective_region`` while the other ranks are in its all-reduce (the run stops);
- ``hook=on_train_batch_start``: in a hook without a collective (the others meet the notice at the next
  step's all-reduce);
- ``hook=forward``: in a forward hook it put on the model (``guarded``);
- ``hook=state_dict``: when a checkpoint is written.

``+callbacks.raiser._target_=tests.planted.isolation.RaisingCheck +callbacks.raiser.step=3 +callbacks.raiser.rank=1``
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from dsdebug.callbacks.base import DebugCallback
from dsdebug.distributed import collectives


class RaisingCheck(DebugCallback):
    name = "raiser"

    def __init__(self, step: int = 3, rank: int | None = None, hook: str = "on_train_batch_end",
                 where: str = "before", error: str = "key", name: str = "raiser") -> None:
        super().__init__()
        self.name = name  # several in one run: each its own findings
        self.step, self.rank, self.hook, self.where, self.error = int(step), rank, hook, where, error

    @property
    def state_key(self) -> str:  # several in one Trainer: each its own checkpoint state
        return self._generate_state_key(name=self.name)

    def _due(self, trainer: Any, hook: str, where: str | None = None) -> bool:
        return (hook == self.hook and (where is None or where == self.where) and trainer.global_step == self.step
                and self.rank in (None, trainer.global_rank))

    def _raise(self) -> None:
        if self.error == "key":
            raise KeyError("grad_norm")  # the bug of issue 32, planted
        raise ZeroDivisionError("planted division by zero")

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self.hook == "forward":
            self._trainer = trainer
            net = getattr(pl_module, "net", pl_module)
            net.register_forward_hook(self.guarded(self._forward_hook, "a forward hook on the model"))

    def _forward_hook(self, module: Any, args: Any, output: Any) -> None:
        if self._trainer.training and self._due(self._trainer, "forward"):
            self._raise()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._due(trainer, "on_train_batch_start"):
            self._raise()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step  # after the update: the step just taken is step - 1
        if self._due(trainer, "on_train_batch_end", "before"):
            self._raise()
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if self.where == "region":  # inside a block of collectives agreed once, the all-reduce in it
            with collectives.collective_region():
                if self._due(trainer, "on_train_batch_end", "region"):
                    self._raise()
                collectives.reduce(trainer, torch.tensor([1.0], dtype=torch.float64), "sum")
        value = collectives.reduce(trainer, torch.tensor([float(loss.detach())], dtype=torch.float64), "sum")
        if self._due(trainer, "on_train_batch_end", "after"):
            self._raise()
        if trainer.global_rank == 0:
            self.report(trainer, "info", "alive", f"step {step}: reduced loss {float(value.sum()):.4f}",
                        details={"step": step}, rank=None)

    def state_dict(self) -> dict[str, Any]:
        if self.hook == "state_dict":
            self._raise()
        return {}


class BadArgumentCheck(DebugCallback):
    """A check that finds the user's config wrong at setup: a ConfigError is the user's, never isolated."""

    name = "bad_argument"

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        from dsdebug.errors import ConfigError

        raise ConfigError("callbacks.bad_argument.pattern='x*' matches no parameter; valid: a regex of a name")


class SwitchAllOffAt(Callback):
    """Not a check: at the end of ``step``'s batch it switches every check off through the guard's own failure
    path (as if each had raised there: ``check_failed``, release), then two steps later writes what the
    switched-off checks left running to ``<run dir>/left_behind.json``: hang-watchdog threads, dsdebug logging
    handlers, torch's deterministic flag, the profiler, a saved-tensors hook,
    module hooks and MoE router observers of checks that are off.

    ``+callbacks.off._target_=tests.planted.isolation.SwitchAllOffAt +callbacks.off.step=3``"""

    def __init__(self, step: int = 3) -> None:
        self.step = int(step)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        from dsdebug.callbacks import isolation

        if trainer.global_step == self.step:
            for cb in trainer.callbacks:
                if isinstance(cb, DebugCallback) and type(cb).isolated and not isolation.is_off(cb):
                    isolation._fail(cb, trainer, "on_train_batch_end", RuntimeError("planted: switched off"))
        elif trainer.global_step == self.step + 2:
            Path(trainer.default_root_dir, "left_behind.json").write_text(json.dumps(left_behind(pl_module)))


def left_behind(pl_module: Any) -> dict[str, Any]:
    from dsdebug.callbacks import isolation

    def off(fn: Any) -> bool:
        return isinstance(fn, isolation._Guarded) and isolation.is_off(fn.check)

    hooks = [f"{name}: {fn.where}" for name, m in pl_module.named_modules()
             for d in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks) for fn in d.values() if off(fn)]
    moe = getattr(pl_module, "moe", None)
    return {
        "watchdog_threads": [t.name for t in threading.enumerate() if "watchdog" in t.name and t.is_alive()],
        "log_handlers": [type(h).__name__ for h in logging.getLogger().handlers
                         if type(h).__module__.startswith("dsdebug")],
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "profiler_on": bool(torch.autograd._profiler_enabled()),
        "saved_tensors_hook": torch._C._autograd._top_saved_tensors_default_hooks(False) is not None,
        "model_hooks": hooks,
        "moe_observers": [fn.where for fn in getattr(moe, "listeners", ()) if off(fn)],
    }


class CrashAt(Callback):
    """Not a check: the run itself fails at the end of ``step``'s batch (an error in the user's code)."""

    def __init__(self, step: int = 5) -> None:
        self.step = int(step)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("planted: the user's code failed")
