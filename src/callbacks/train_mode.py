"""`TrainMode`: every training step runs the module tree in the train/eval modes the run started with.

The config example and the table of findings: the class docstring (`TrainMode`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from dsdebug.callbacks.base import DebugCallback
from dsdebug.config.args import Rule, integer

__all__ = ["TrainMode", "flipped_modules", "top_of"]

_DROPOUT = nn.modules.dropout._DropoutNd
_NORM = nn.modules.batchnorm._NormBase  # BatchNorm*, InstanceNorm* (running statistics)


def flipped_modules(modes: list[tuple[str, nn.Module, bool]]) -> list[str]:
    """The names of the modules whose ``training`` flag differs from the one recorded (in tree order)."""
    return [name for name, module, training in modes if module.training != training]


def top_of(names: list[str]) -> list[str]:
    """The roots of the flipped subtrees: the names none of whose ancestors is in ``names`` (a name in ``<>`` is the
    root, the ancestor of every other)."""
    chosen = set(names)
    if any(n.startswith("<") for n in chosen):
        return [n for n in names if n.startswith("<")]
    return [n for n in names if not any(n.startswith(a + ".") for a in chosen if a != n)]


class TrainMode(DebugCallback):
    """`TrainMode`: every training step runs the module tree in the train/eval modes the run started with.

    User code that calls ``model.eval()`` during training -- a sample printer in a callback, an evaluation helper in
    ``training_step``, generation for a log -- and never ``train()`` again leaves dropout off and normalisation
    layers on their running statistics (not updated any more) for every later step, until Lightning's next
    validation puts the modes back (and with no validation, for the rest of the run). The loss looks fine; the
    model trains without its regularisation. Nothing else shows it.

    How (every rank, local, no collective, no device read): at the first training batch it records each module's
    ``training`` flag -- the modes the run was built with, a BatchNorm frozen on purpose (``bn.eval()`` before the
    fit) included -- and every ``every_n_steps`` training batches, before the forward, compares the flags with them
    (a Python pass over the modules, no tensor touched). A change is reported once at its onset, naming the top of
    each flipped subtree and what it switches (dropout, running statistics); when the modes are back, a later change
    is reported again. A module tree already wholly in eval mode at the first training batch is reported too.

    Example::

        python train.py debug=light                                   # on (light, full)
        python train.py +callbacks=train_mode callbacks.train_mode.every_n_steps=10

    | finding code | severity | when |
    |---|---|---|
    | ``eval_mode_in_training`` | error | a module that trained at the first step is in eval mode at a later training step, or the whole tree is in eval mode at the first |
    | ``train_mode_changed`` | warning | a module in eval mode at the first step (frozen on purpose) is in train mode later |

    It logs no metrics. Resume: nothing carried over; the resumed process records the modes at its first batch.
    """
    name = "train_mode"
    policies = ("warn", "stop")
    policy_note = "skip: the update of the step is not what the modes change"

    #: argument rules, declared: the config layer reads them before the check is built
    #: (config/check_args.json, written by python -m dsdebug.callbacks.arg_table)
    arg_rules: ClassVar[dict[str, Rule]] = {
        "every_n_steps": integer(1),
    }

    def __init__(self, every_n_steps: int = 1, on_error: str = "warn") -> None:
        super().__init__(on_error=on_error)
        self.check_declared(every_n_steps=every_n_steps)
        self.every_n_steps = int(every_n_steps)
        self._modes: list[tuple[str, nn.Module, bool]] | None = None
        self._flipped: frozenset[str] = frozenset()
        self._batches = 0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._batches += 1
        if self._modes is None:
            root = f"<{type(pl_module).__name__}>"  # the LightningModule itself
            self._modes = [(name or root, module, module.training) for name, module in pl_module.named_modules()]
            if all(not m.training for _, m, _ in self._modes):
                self._report_flip(trainer, [root], to_eval=True, first=True)
            return
        if (self._batches - 1) % self.every_n_steps:
            return
        names = flipped_modules(self._modes)
        if frozenset(names) == self._flipped:
            return
        self._flipped = frozenset(names)
        if names:
            training = dict((n, t) for n, _, t in self._modes)
            to_eval = [n for n in names if training[n]]
            to_train = [n for n in names if not training[n]]
            if to_eval:
                self._report_flip(trainer, to_eval, to_eval=True)
            if to_train:
                self._report_flip(trainer, to_train, to_eval=False)

    def _report_flip(self, trainer: Any, names: list[str], to_eval: bool, first: bool = False) -> None:
        modules = {n: m for n, m, _ in self._modes}
        tops = top_of(names)
        shown = ", ".join(tops[:4]) + (f" (+{len(tops) - 4} more)" if len(tops) > 4 else "")
        affected = [modules[n] for n in names]
        dropout = sum(isinstance(m, _DROPOUT) for m in affected)
        norms = sum(isinstance(m, _NORM) for m in affected)
        effect = [f"{dropout} dropout layer(s) off" if to_eval else f"{dropout} dropout layer(s) on"] if dropout else []
        if norms:
            effect.append(f"{norms} norm layer(s) on their running statistics, not updated" if to_eval else
                          f"{norms} norm layer(s) frozen at the start update their statistics again")
        effect = "; ".join(effect) or "every branch on self.training flips (HF attention dropout, custom layers)"
        step = trainer.global_step
        details = {"modules": tops, "flipped": len(names), "dropout": dropout, "norms": norms}
        if not to_eval:
            self.report(trainer, "warning", "train_mode_changed",
                        f"{shown} in train mode at training step {step}, but in eval mode at the first step "
                        f"({len(names)} module(s)): {effect}",
                        "if a module was frozen on purpose (bn.eval()), something switched it back (a model.train() "
                        "in user code, a validation restoring modes): freeze it again in on_train_batch_start",
                        details=details)
            return
        where = ("at the first training step: the whole module tree is in eval mode" if first else
                 f"in eval mode at training step {step}, in train mode at the first step ({len(names)} module(s))")
        self.report(trainer, "error", "eval_mode_in_training", f"{shown} {where}: {effect}",
                    "a model.eval() in user code during training (a sample printer, an evaluation or generation "
                    "helper in a callback or training_step) is never undone: call model.train() after it, or run "
                    "it inside a block that restores the modes", details=details)
