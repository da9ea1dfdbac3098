"""`Preflight`: the doctor's cheap probes on the run's first real batch, inside the run.

The config example and the table of findings: the class docstring (`Preflight`).
"""

from __future__ import annotations

import functools
import time
from typing import Any, ClassVar

import torch

from dsdebug.callbacks.base import DebugCallback
from dsdebug.config.args import Rule, boolean, integer, subset_of
from dsdebug.probes.on_the_run import first_rows, run_registered
from dsdebug.probes.ranks import gather, merge
from dsdebug.probes.registry import PROBES, ProbeInputs, is_pretrained
from dsdebug.probes.result import ProbeResult

__all__ = ["Preflight"]



class Preflight(DebugCallback):
    """`Preflight`: properties every correct training step has, checked on the run's first batch.

    Before the first training step, on the batch it is about to train on and the net as the strategy
    holds it (DDP, ZeRO-1/2/3), the probes of the preflight doctor (``doctor=true``) that cost no
    training step run on every rank:
    - ``init_loss``: the loss at initialisation against ln(vocab) (far above: output scale; far below:
      the model sees its targets); skipped for pretrained weights and on a resume;
    - ``causality``: outputs before position t do not change when tokens from t on change; targets are
      not among the inputs (labels shifted twice);
    - ``sample_independence``: one sample's outputs do not change when another sample changes (outputs
      only here; the doctor also checks gradients);
    - ``train_eval``: with dropout off, the eval-mode forward is finite and equals the train-mode one;
    - ``plan``: the LR schedule over the run (peak reached?), epochs over the dataset, the fraction of
      tokens counted in the loss.
    A probe first compares the net's outputs only; when one fails on any rank, every rank runs it again
    with a module trace to name the module where the property breaks (the doctor's culprit). The probe
    forwards run without gradients, the net's train/eval flags, dropout, buffers (BatchNorm statistics)
    and the random number generators are put back: the run trains exactly what it would without the check.
    The optimizer coverage, the one-batch overfit and the checkpoint round trip take steps: the doctor runs
    those (``python train.py <overrides> doctor=true``).

    Ranks: every rank runs every probe, with the same number of forwards (under ZeRO-3 each forward
    gathers parameters: a collective), agrees on the probes each rank's batch is too small for and on each
    probe's failure (an all-reduce each: two per probe, plus train_eval's own under ZeRO-3) and gathers the
    results (one all_gather_object) at the first batch; under ZeRO-3 a probe that raises is raised, not
    skipped (its rank would leave the gathers); rank 0 reports. Nothing after the first batch: the cost is a
    one-off ~8 forwards without gradients of the first ``samples`` rows of this rank's batch (2 of 8 on
    the default run), plus the plan's walk of the LR schedule over every step of the run (both measured
    in docs/benchmarks.md, "Costs the code refers to").

    Example::

        python train.py debug=light                                  # on by default in light and full
        python train.py +callbacks=preflight callbacks.preflight.probes=[causality,init_loss]

    | finding code | severity | when |
    |---|---|---|
    | ``<probe>`` (``init_loss``, ``causality``, ``sample_independence``, ``train_eval``, ``plan``) | error / warning | the probe failed / warned: the culprit (module, position, config key) and what to do |
    | ``preflight_summary`` | info | the probes run, their status and seconds |
    | ``preflight_skipped`` | info | the module has no ``net`` the probes can call with ``input_ids`` |
    """

    name = "preflight"
    # nothing kept across a resume: a resumed fit (global_step > 0) skips the probes unless on_resume

    #: argument rules, declared: the config layer reads them before the check is built
    #: (config/check_args.json, written by python -m dsdebug.callbacks.arg_table)
    arg_rules: ClassVar[dict[str, Rule]] = {
        "probes": subset_of(*PROBES),
        "on_resume": boolean(),
        "samples": integer(2),
    }

    def __init__(self, probes: list[str] | tuple[str, ...] = ("init_loss", "causality", "sample_independence",
                                                              "train_eval", "plan"),
                 on_resume: bool = False, samples: int = 2) -> None:
        super().__init__()
        self.check_declared(probes=probes, on_resume=on_resume, samples=samples)
        self.probes, self.on_resume, self.samples = tuple(probes), on_resume, samples
        self._done = False
        self.results: list[ProbeResult] = []

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # first in the callback list: the probe forwards run before any other check's step-0 hooks are
        # attached (reproducibility records the module calls of step 0 from its on_train_batch_start).
        # Lightning iterates trainer.callbacks by index: removing this one and inserting it at 0 keeps
        # every later callback at its index, so this setup loop neither skips nor repeats one.
        callbacks = trainer.callbacks
        if self in callbacks and callbacks[0] is not self:
            callbacks.remove(self)
            callbacks.insert(0, self)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._done:
            return
        self._done = True  # decided alike on every rank: the first batch of the fit
        resumed = trainer.global_step > 0
        if resumed and not self.on_resume:
            return
        net = getattr(pl_module, "net", None)
        if not isinstance(net, torch.nn.Module) or not isinstance(batch, dict) or "input_ids" not in batch:
            if trainer.global_rank == 0:
                self.report(trainer, "info", "preflight_skipped",
                            f"{type(pl_module).__name__} has no .net taking input_ids (or the batch has none): "
                            "the probes need a causal LM's net(input_ids=...)", rank=None)
            return
        started = time.perf_counter()
        mine = self.run_probes(trainer, pl_module, net, batch, resumed)  # COLLECTIVE (see the docstring)
        self.results = merge(gather(mine), trainer.world_size)  # COLLECTIVE
        self._report(trainer, time.perf_counter() - started)

    def run_probes(self, trainer: Any, pl_module: Any, net: torch.nn.Module, batch: dict,
                   resumed: bool) -> list[ProbeResult]:
        """The probes on this rank, twice for the ones any rank failed (then with a module trace): the registry's
        (probes/registry.py), run by its harness (probes/on_the_run.py run_registered). COLLECTIVE."""
        full = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        any_rank = functools.partial(self.any_rank, trainer)
        collective = bool(getattr(trainer.strategy, "zero_stage_3", False))  # ZeRO-3: every forward gathers
        # the first `samples` rows: each probe's forwards cost that share of the batch's; the plan reads the
        # whole batch (its size, the label fraction). Ranks agree inside a probe only where its forwards are
        # collective (a rank whose probe raised would miss the agreement elsewhere).
        inputs = ProbeInputs(net, first_rows(full, self.samples), full, pretrained=is_pretrained(net),
                             shifts_labels=bool(getattr(pl_module, "shifts_labels", True)), trainer=trainer,
                             pl_module=pl_module, agree=any_rank if collective else None)
        names = [n for n in self.probes if PROBES[n].after_resume or not resumed]
        return run_registered(names, inputs, any_rank, collective)

    def _report(self, trainer: Any, seconds: float) -> None:
        if trainer.global_rank != 0:
            return
        for r in self.results:
            if r.severity != "info":  # a pass or skip is one word of the summary line
                self.report(trainer, r.severity, r.probe, r.line(), r.advice,
                            details={"status": r.status, "culprit": r.culprit, "seconds": r.seconds, **r.details},
                            rank=r.details.get("rank"), step=0)
        line = ", ".join(f"{r.probe} {r.status}" for r in self.results)
        self.report(trainer, "info", "preflight_summary", f"preflight on the first batch in {seconds:.2f} s: {line}",
                    details={"seconds": round(seconds, 3),
                             "probes": {r.probe: {"status": r.status, "seconds": r.seconds, "message": r.message}
                                        for r in self.results}}, rank=None, step=0)
