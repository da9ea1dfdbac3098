"""Probe: train/eval consistency. The eval-mode forward is finite and equals the train-mode forward
once stochastic layers are off (dropout p=0).

Breaks by a layer whose eval path differs from its train path beyond randomness: BatchNorm's
running statistics against the batch's, a hand-written dropout that rescales in eval, a branch on
``self.training`` that changes the math, an eval-only path that divides by an untrained statistic
(non-finite). The first module (forward order) whose outputs part is named.

Works on a copy of the net (its dropout is zeroed). Usable on any net:
``train_eval(net, batch)``. Local: no collective."""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from dsdebug.probes.batch import as_batch
from dsdebug.probes.result import ProbeResult
from dsdebug.probes.tracing import ModuleTrace, differs, first_divergence, logits_of

__all__ = ["train_eval", "without_dropout", "dropout_off"]

NAME = "train_eval"


def without_dropout(net: nn.Module) -> nn.Module:
    """``net`` (in place) with every dropout off: ``nn.Dropout*`` p=0 and float attributes named
    ``*dropout*`` (HF attention reads ``self.attention_dropout`` in train mode) set to 0."""
    for module in net.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for attr, value in list(vars(module).items()):
            if "dropout" in attr.lower() and isinstance(value, float) and 0.0 < value < 1.0:
                setattr(module, attr, 0.0)
    return net


@contextmanager
def dropout_off(net: nn.Module) -> Iterator[nn.Module]:
    """``without_dropout`` for the duration of the block, every value and train/eval flag put back
    after (for probes on the run's own net)."""
    saved = [(m, "p", m.p) for m in net.modules() if isinstance(m, nn.modules.dropout._DropoutNd)]
    saved += [(m, attr, value) for m in net.modules() for attr, value in list(vars(m).items())
              if "dropout" in attr.lower() and isinstance(value, float) and 0.0 < value < 1.0]
    modes = {m: m.training for m in net.modules()}
    try:
        yield without_dropout(net)
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)
        for module, training in modes.items():
            module.training = training


@torch.no_grad()
def train_eval(net: nn.Module, batch: dict, copy_net: bool = True, seed: int = 0, locate: bool = True) -> ProbeResult:
    """``copy_net=False``: on ``net`` itself, its dropout and modes put back after. ``locate=False``: no
    module trace (a failure names ``<net>``; run again to name the module)."""
    with dropout_off(copy.deepcopy(net) if copy_net else net) as probe:
        return _train_eval(probe, as_batch(batch), seed, locate)


def _train_eval(probe: nn.Module, batch: dict, seed: int, locate: bool) -> ProbeResult:
    ids = batch["input_ids"]
    torch.manual_seed(seed)
    probe.train()
    with ModuleTrace(probe, enabled=locate) as train_trace:
        train_out = logits_of(probe(input_ids=ids))
    probe.eval()
    with ModuleTrace(probe, enabled=locate) as eval_trace:
        eval_out = logits_of(probe(input_ids=ids))
    details: dict = {}
    if not torch.isfinite(eval_out).all():
        module = next((name for (name, _), t in eval_trace.records if not torch.isfinite(t).all()), "<net>")
        details["module"] = module
        return ProbeResult(NAME, "fail", f"the eval-mode forward is not finite; first non-finite output: {module}",
                           module, f"look at {module}'s eval path (running statistics, a division by an "
                           "untrained value, a branch on self.training)", details)
    diff = differs(train_out, eval_out, rtol=1e-3, atol=1e-4)
    if diff:
        found = first_divergence(train_trace, eval_trace, lambda x: x, rtol=1e-3, atol=1e-4)
        module = found[0] if found else "<net>"
        details.update(module=module, where=found[2] if found else "in the net", max_abs_diff=diff)
        kind = type(dict(probe.named_modules()).get(module, probe)).__name__
        return ProbeResult(
            NAME, "fail", f"train and eval forwards differ (max |diff| {diff:.3g}) with dropout off; they part "
            f"at {module} ({kind})", module,
            f"make {module} compute the same in eval as in train (BatchNorm -> LayerNorm for sequences; a custom "
            "dropout must be identity in eval and rescale by 1/(1-p) in train; no other branch on self.training)",
            details)
    return ProbeResult(NAME, "pass", "train and eval forwards agree with dropout off; eval is finite", details=details)
