"""The probe registry: every probe that runs on a net and a batch, once, for every harness.

Three harnesses run them: the preflight doctor (``doctor=true``, doctor/callback.py: on a local copy
of the net, before a run), the run's own ``preflight`` check (callbacks/preflight.py: on the first
batch, ``debug=light``) and ``outcome_monitor`` (callbacks/outcome_monitor.py: on the spot, when the
loss says one should run). Each reads :data:`PROBES`: how to call the probe from :class:`ProbeInputs`,
what batch it needs, whether it means anything after a resume or on the spot. How a probe is run --
guarded, agreed across ranks, traced when a rank failed -- is probes/on_the_run.py, the same for all
three: a probe that raises is a ``skip`` naming the error (it says nothing about the property), unless
it raised inside a collective forward (ZeRO-3), where the error is raised.

Adding a probe: docs/architecture.md, "Adding a probe".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dsdebug.probes.causality import causality
from dsdebug.probes.init_loss import init_loss
from dsdebug.probes.plan import plan_of_run
from dsdebug.probes.result import ProbeResult
from dsdebug.probes.sample_independence import sample_independence
from dsdebug.probes.train_eval import dropout_off, train_eval

__all__ = ["PROBES", "Probe", "ProbeInputs", "is_pretrained", "too_small"]


@dataclass
class ProbeInputs:
    """What a harness hands a probe. ``batch``: the rows the probe's forwards run on; ``full_batch``: the
    whole batch (the plan reads its size and label fraction); ``thorough``: the doctor's variant (a backward
    where the probe has one) instead of a run's cheap one; ``agree``: the run's any-rank agreement (None: one
    process decides alone); ``plan_args``: what the doctor knows about the update (clip, gradient norm, the
    values adjusted) for the plan."""

    net: torch.nn.Module
    batch: dict
    full_batch: dict | None = None
    pretrained: bool = False
    shifts_labels: bool = True
    thorough: bool = False
    trainer: Any = None
    pl_module: Any = None
    agree: Callable[[bool], bool] | None = None
    plan_args: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Probe:
    """``call(inputs, locate)``: ``locate=False`` compares outputs only (a failure names ``<net>``), ``True``
    traces the modules to name the first that breaks. ``min_rows``/``min_tokens``: the batch it needs (less:
    skipped, decided alike on every rank); ``after_resume``: meaningful on a trained net; ``on_the_spot``:
    outcome_monitor may run it mid-run; ``breaks``: what a failure means (the tables in docs/debugging.md)."""

    name: str
    call: Callable[[ProbeInputs, bool], ProbeResult]
    breaks: str
    min_rows: int = 1
    min_tokens: int = 2
    after_resume: bool = True
    on_the_spot: bool = False


def _sample_independence(x: ProbeInputs, locate: bool) -> ProbeResult:
    with dropout_off(x.net):  # the run's own net: its dropout would differ between the two forwards
        return sample_independence(x.net, x.batch, locate=locate, grads=x.thorough)


PROBES: dict[str, Probe] = {p.name: p for p in (
    Probe("init_loss", lambda x, locate: init_loss(x.net, x.batch, pretrained=x.pretrained, locate=locate),
          "output scale wrong at init; the model sees its targets", after_resume=False),
    Probe("causality", lambda x, locate: causality(x.net, x.batch, shifts_labels=x.shifts_labels, locate=locate),
          "position t depends on inputs after t; labels not shifted", on_the_spot=True),
    Probe("sample_independence", _sample_independence, "one sample's output depends on another sample", min_rows=2),
    Probe("train_eval", lambda x, locate: train_eval(x.net, x.batch, copy_net=False, locate=locate, agree=x.agree),
          "the eval path computes something else than train (dropout off)", on_the_spot=True),
    Probe("plan", lambda x, locate: plan_of_run(x.trainer, x.pl_module, x.full_batch or x.batch, **x.plan_args),
          "LR schedule never peaks, clipping shrinks every update, tiny dataset", min_tokens=1),
)}


def too_small(probe: Probe, batch: dict) -> str | None:
    """Why ``batch`` is too small for ``probe`` (None: it is not)."""
    ids = batch["input_ids"]
    if probe.min_tokens > 1 and (ids.dim() < 2 or int(ids.shape[1]) < probe.min_tokens):
        return "a rank's sequences hold 1 token"
    if int(ids.shape[0]) < probe.min_rows:
        return f"a rank's batch has {int(ids.shape[0])} row(s): nothing to compare it with"
    return None


def is_pretrained(net: Any) -> bool:
    """Loaded from pretrained weights (an HF model's ``name_or_path``): its initial loss is not ln(vocab)."""
    return bool(getattr(net, "name_or_path", "") or getattr(getattr(net, "config", None), "_name_or_path", ""))
