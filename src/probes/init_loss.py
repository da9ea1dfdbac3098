"""Probe: the loss at initialisation against what an untrained model gives.

An untrained causal LM spreads its probability over the vocabulary: its next-token loss is
~ln(vocab). Far above: the output (logits) scale is wrong at init (an init std, a missing
1/sqrt(d), a temperature). Far below: the model sees what it predicts (a causality leak: the
causality probe names where), unless the weights are pretrained.

Usable on any net: ``init_loss(net, batch)``. Local: no collective."""

from __future__ import annotations

import math

import torch

from dsdebug.probes.batch import as_batch, lm_loss, vocab_of
from dsdebug.probes.result import ProbeResult
from dsdebug.probes.tracing import ModuleTrace, logits_of, restored_mode

__all__ = ["init_loss"]

NAME = "init_loss"


@torch.no_grad()
def init_loss(net: torch.nn.Module, batch: dict, vocab: int | None = None, pretrained: bool = False,
              above: float = 0.25, below: float = 0.5, locate: bool = True) -> ProbeResult:
    """Fail when loss > ln(V) * (1 + ``above``) + 1 nat, or (random init only) loss < ln(V) * ``below``.
    ``locate=False``: no module trace (the culprit of a failure is ``<net>``; run again to name it)."""
    batch = as_batch(batch)
    with restored_mode(net):
        net.eval()
        with ModuleTrace(net, enabled=locate) as trace:
            logits = logits_of(net(input_ids=batch["input_ids"]))
    vocab = vocab or vocab_of(net, logits)
    expected = math.log(vocab)
    loss = float(lm_loss(logits, batch))
    std = float(logits.float().std())
    details = {"loss": round(loss, 4), "ln_vocab": round(expected, 4), "vocab": vocab, "logits_std": round(std, 4)}
    if not math.isfinite(loss):
        culprit = _first_nonfinite(trace.records) or "<net>"
        return ProbeResult(NAME, "fail", f"loss at init is {loss}: the first non-finite output is {culprit}",
                           culprit, f"look at {culprit}'s forward at init (a division, log, sqrt or an "
                           "uninitialised tensor)", details)
    if loss > expected * (1 + above) + 1.0:
        head = _logits_module(trace.records, logits) or "<net>"
        return ProbeResult(
            NAME, "fail", f"loss at init {loss:.2f} is far above ln(vocab)={expected:.2f} for an untrained model; "
            f"logits std {std:.2f} (near 0 expected at init), produced by {head}", head,
            f"scale down {head}'s init (std ~0.02, or 1/sqrt(fan_in)) or whatever scales the logits "
            "(a temperature, a missing 1/sqrt(d))", details)
    if not pretrained and loss < expected * below:
        return ProbeResult(
            NAME, "fail", f"loss at init {loss:.2f} is far below ln(vocab)={expected:.2f}: an untrained model "
            "cannot be that good, it sees what it predicts", "inputs/labels",
            "see the causality probe: a missing causal mask, or labels not shifted (the target of position t "
            "among its inputs)", details)
    note = " (pretrained weights: low is expected)" if pretrained and loss < expected * below else ""
    return ProbeResult(NAME, "pass", f"loss at init {loss:.2f} vs ln(vocab) {expected:.2f}{note}", details=details)


def _logits_module(records: list, logits: torch.Tensor) -> str | None:
    """The innermost module that output the logits: the first to finish with exactly these values."""
    target = logits.detach().float()
    for (name, _), t in records:
        if name != "<net>" and t.shape == target.shape and torch.equal(t, target):
            return name
    return None


def _first_nonfinite(records: list) -> str | None:
    for (name, _), t in records:
        if not torch.isfinite(t).all():
            return name
    return None
