"""`OptimizerCoverage`: every tensor the loss learns from is a registered parameter the optimizer updates.

The config example and the table of findings: the class docstring (`OptimizerCoverage`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Iterator

import torch
from torch import nn

from dsdebug.callbacks.base import DebugCallback
from dsdebug.callbacks.grad_access import display_name, optimizer_param_lrs
from dsdebug.config.args import Rule, integer

__all__ = ["OptimizerCoverage", "graph_leaves", "where_held"]


def graph_leaves(loss: torch.Tensor) -> list[torch.Tensor]:
    """The leaves the loss's backward accumulates a gradient into (its autograd graph's ``AccumulateGrad`` nodes),
    in the order the walk meets them. A Python walk over the graph's nodes; no tensor is read."""
    fn = getattr(loss, "grad_fn", None)
    if fn is None:
        return [loss] if loss.requires_grad else []
    seen, stack, leaves = {fn}, [fn], []
    while stack:
        node = stack.pop()
        variable = getattr(node, "variable", None)
        if variable is not None and type(node).__name__ == "AccumulateGrad":
            leaves.append(variable)
            continue
        for child, _ in getattr(node, "next_functions", ()):
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return leaves


def _tensors_of(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _tensors_of(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors_of(item, f"{path}[{key!r}]")


def where_held(root: nn.Module, ids: set[int]) -> dict[int, str]:
    """id -> the attribute path of each tensor of ``ids`` that a module holds outside its registered parameters and
    buffers (a plain attribute, a Python list or dict of tensors): ``net.blocks.1.scale``, ``net.extra[0]``."""
    out: dict[int, str] = {}
    for name, module in root.named_modules():
        prefix = f"{name}." if name else ""
        for attr, value in vars(module).items():
            if attr.startswith("_"):
                continue
            for path, t in _tensors_of(value, prefix + attr):
                if id(t) in ids and id(t) not in out:
                    out[id(t)] = path
    return out


class OptimizerCoverage(DebugCallback):
    """`OptimizerCoverage`: every tensor the loss learns from is a registered parameter the optimizer updates.

    A layer built on the first forward (after ``configure_optimizers``), a parameter replaced after the optimizer
    was built, weights kept in a plain Python list or as a tensor attribute with ``requires_grad=True`` (the module
    tree does not register them): each is used in every forward and gets a gradient at every backward, and none
    ever changes -- the optimizer does not hold it. The loss still falls (the rest trains); nothing else says so.
    ``freeze_verify`` checks the parameters it can enumerate when the fit starts; this check starts from the loss.

    How (every rank, local, no collective, no tensor read): at the first backward it walks the loss's autograd graph
    to its leaves (the ``AccumulateGrad`` nodes: every tensor the backward writes a gradient into) and compares them
    with what the optimizer's param groups hold (a torch optimizer, DeepSpeed ZeRO-1/2/3). It walks again whenever
    the LightningModule's parameters change (a Python pass over their ids before each backward: a module added,
    a parameter replaced) and every ``every_n_steps`` steps. Each leaf outside the optimizer is named: a registered
    parameter by its name, an unregistered tensor by the attribute that holds it. Leaves that are neither a
    parameter nor held by a module (an activation made to require grad, as ``enable_input_require_grads`` does
    for gradient checkpointing on a frozen base) are not weights and are left alone. Once per tensor.

    Example::

        python train.py debug=light                                  # on (light, full)
        python train.py +callbacks=optimizer_coverage callbacks.optimizer_coverage.every_n_steps=500

    | finding code | severity | when |
    |---|---|---|
    | ``not_in_optimizer`` | error | the loss learns from a tensor no optimizer param group holds: registered after the optimizer was built, replaced, or never registered |

    It logs no metrics. Resume: nothing carried over (the walk runs again at the resumed process's first backward).
    """
    name = "optimizer_coverage"
    policies = ("warn", "stop")
    policy_note = "skip: dropping the update does not make the optimizer hold the tensor"

    #: argument rules, declared: the config layer reads them before the check is built
    #: (config/check_args.json, written by python -m dsdebug.callbacks.arg_table)
    arg_rules: ClassVar[dict[str, Rule]] = {
        "every_n_steps": integer(1),
    }

    def __init__(self, every_n_steps: int = 1000, on_error: str = "warn") -> None:
        super().__init__(on_error=on_error)
        self.check_declared(every_n_steps=every_n_steps)
        self.every_n_steps = int(every_n_steps)
        self._param_ids: tuple[int, ...] | None = None
        self._reported: set[int] = set()
        self._walked_at: int | None = None

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            return
        ids = tuple(id(p) for p in pl_module.parameters())
        step = trainer.global_step
        changed = ids != self._param_ids
        if not changed and (self._walked_at == step or not self.due(step)):
            return
        self._param_ids, self._walked_at = ids, step
        held = optimizer_param_lrs(trainer)
        if held is None:  # an optimizer whose parameters this version cannot map: nothing to compare with
            return
        outside = [t for t in graph_leaves(loss) if id(t) not in held and id(t) not in self._reported]
        if not outside:
            return
        names = {id(p): n for n, p in pl_module.named_parameters()}
        found = where_held(pl_module, {id(t) for t in outside if id(t) not in names})
        named: list[tuple[str, str, torch.Tensor]] = []
        for t in outside:
            if id(t) in names:
                named.append((display_name(names[id(t)]), "registered after the optimizer was built, or replaced", t))
            elif id(t) in found:
                how = "a Parameter the module tree does not register" if isinstance(t, nn.Parameter) else \
                    "a tensor attribute with requires_grad, not a registered parameter"
                named.append((display_name(found[id(t)]), how, t))
            elif isinstance(t, nn.Parameter):
                named.append((f"<a Parameter {tuple(t.shape)} held outside the model>", "not registered", t))
        if not named:
            return
        self._reported.update(id(t) for _, _, t in named)
        first = named[0]
        listed = "; ".join(f"{n} {tuple(t.shape)} ({how})" for n, how, t in named[:5])
        more = f" (+{len(named) - 5} more)" if len(named) > 5 else ""
        self.report(trainer, "error", "not_in_optimizer",
                    f"the loss learns from {len(named)} tensor(s) no optimizer param group holds, first {first[0]}: "
                    f"{listed}{more}. They get a gradient at every backward and never change",
                    f"build every layer in __init__ (not on the first forward), register weights as nn.Parameter / "
                    f"nn.ParameterList / nn.ModuleList (not a Python list or a plain tensor attribute), and replace no "
                    f"parameter after configure_optimizers; a tensor that is not meant to train: requires_grad=False "
                    f"or register_buffer",
                    details={"tensors": [n for n, _, _ in named], "shapes": [list(t.shape) for _, _, t in named],
                             "how": [h for _, h, _ in named]})
