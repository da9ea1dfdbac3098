"""`OutcomeMonitor`: what the run achieves -- train/val gap, validation worse than an untrained model,
non-finite validation, a loss too low to be true.

The config example and the table of findings: the class docstring (`OutcomeMonitor`).
"""

from __future__ import annotations

import functools
import math
from typing import Any, ClassVar

import torch

from dsdebug.callbacks.base import DebugCallback
from dsdebug.callbacks.grad_access import step_loss, untrained_vocab
from dsdebug.config.args import Rule, boolean, integer, number
from dsdebug.probes.on_the_run import first_rows, run_registered
from dsdebug.probes.registry import PROBES, ProbeInputs, is_pretrained
from dsdebug.probes.result import ProbeResult
from dsdebug.distributed import collectives

__all__ = ["OutcomeMonitor"]


class OutcomeMonitor(DebugCallback):
    """`OutcomeMonitor`: what the run achieves, judged at each validation.

    The other checks watch the mechanics of a step; this one watches the outcome, from the training
    loss (its mean since the last validation) and ``val/loss``:
    - validation non-finite while training is finite: the eval path breaks (an eval-only branch,
      a cache, a mask built differently) -- an error;
    - validation above an untrained model's loss (``(1 + prior_margin)`` x ln(vocab) for a causal LM)
      while training is not (below 1.05 x ln(vocab)): with >= ``memorise_epochs`` passes over the data the run memorised a
      few samples (it has nothing to generalise from); with fewer it is an eval-mode bug (dropout or
      batch norm left in train mode at eval, a train/eval branch, a different mask at eval);
    - the train/val gap growing ``gap_evals`` validations in a row to > ``gap_ratio`` x the train loss
      (overfitting in progress; with many epochs over few samples: memorisation);
    - the training loss (its mean since the last validation, and at the end) below ``low_fraction`` x an
      untrained model's: more than natural text allows
      (>= ~1-2 nats/token): the model sees what it predicts (leakage) or memorised (many epochs).

    A rule that suspects the net or the data runs the probe that settles it, on the spot
    (``probe_on_the_spot``), on the run's net and its last training batch: ``loss_implausibly_low`` before
    memorisation is possible -> the causality probe (a module that sees the future, labels among the
    inputs: an error naming it; else "not a leak in the net or the labels": look at train/val overlap);
    ``val_nonfinite`` and the eval-mode branch of ``val_above_untrained`` -> the train/eval probe (the
    module where train and eval part). The probe leaves the run untouched (no gradient, buffers, RNG and
    modes put back).

    Ranks: rank 0 judges from ITS training loss (logged per rank) and the reduced ``val/loss`` (the
    same on every rank). With ``probe_on_the_spot``, rank 0's choice of probes is broadcast at each
    validation and at the end (one small collective) and every rank runs them (ZeRO-3 forwards gather
    parameters). Cost: one tensor add per training step (no device sync); the host reads the mean at
    each validation and at the end, where the rules are judged.

    Example::

        python train.py +callbacks=outcome_monitor callbacks.outcome_monitor.gap_ratio=0.2

    | finding code | severity | when |
    |---|---|---|
    | ``val_nonfinite`` | error | val/loss NaN/Inf while the training loss is finite |
    | ``val_above_untrained`` | warning | val/loss > (1 + ``prior_margin``) ln(vocab) while the training loss is below 1.05 ln(vocab): memorisation or an eval-mode bug (which, from the epochs) |
    | ``train_val_gap`` | warning | val - train grew ``gap_evals`` validations in a row to > ``gap_ratio`` x train |
    | ``loss_implausibly_low`` | warning | training loss < ``low_fraction`` x ln(vocab): leakage, or memorisation after many epochs |
    | ``causality_on_the_spot`` | error / info | after ``loss_implausibly_low`` (leakage branch): the module or the labels that leak; info when neither does |
    | ``train_eval_on_the_spot`` | error / info | after ``val_nonfinite`` or ``val_above_untrained`` (eval-mode branch): the module where eval parts from train |
    | ``outcome_summary`` | info | at the end: validations seen, last train and val loss, gap, epochs |

    Resume (``state_attrs``): the gaps seen and the codes already reported.
    """
    name = "outcome_monitor"
    state_attrs = ("_gaps", "_reported")

    #: argument rules, declared: the config layer reads them before the check is built
    #: (config/check_args.json, written by python -m dsdebug.callbacks.arg_table)
    arg_rules: ClassVar[dict[str, Rule]] = {
        "prior_margin": number(0),
        "memorise_epochs": integer(2),
        "gap_ratio": number(0, open_low=True),
        "gap_evals": integer(2),
        "low_fraction": number(0, 1, open_high=True, note="0 = off"),
        "probe_on_the_spot": boolean(),
    }

    def __init__(self, prior_margin: float = 0.25, memorise_epochs: int = 3, gap_ratio: float = 0.3,
                 gap_evals: int = 3, low_fraction: float = 0.1, probe_on_the_spot: bool = True) -> None:
        super().__init__()
        self.check_declared(prior_margin=prior_margin, memorise_epochs=memorise_epochs, gap_ratio=gap_ratio,
                            gap_evals=gap_evals, low_fraction=low_fraction, probe_on_the_spot=probe_on_the_spot)
        self.probe_on_the_spot = probe_on_the_spot
        self._wanted: list[str] = []  # probes the rules just asked for (rank 0's decide)
        self._batch: dict | None = None  # the last training batch (a reference, no copy)
        self.prior_margin, self.memorise_epochs = float(prior_margin), memorise_epochs
        self.gap_ratio, self.gap_evals, self.low_fraction = float(gap_ratio), gap_evals, float(low_fraction)
        self._gaps: list[float] = []
        self._reported: list[str] = []
        self._train_sum, self._train_n = 0.0, 0
        self._last: dict[str, Any] = {}
        self.prior: float | None = None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        vocab = untrained_vocab(trainer, pl_module)
        net = getattr(pl_module, "net", None)
        # pretrained weights (from_pretrained sets name_or_path) start far below ln(vocab), and a fine-tune
        # may end below its tenth: the untrained model's loss is no yardstick for them
        self.prior = math.log(vocab) if vocab and vocab > 1 and not is_pretrained(net) else None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = step_loss(pl_module, outputs)  # this rank's; summed where it lives: no device sync
        if loss is not None:
            self._train_sum, self._train_n = self._train_sum + loss.detach(), self._train_n + 1
        if self.probe_on_the_spot and isinstance(batch, dict) and "input_ids" in batch:
            self._batch = batch

    def _train_mean(self) -> float:
        mean = float(self._train_sum) / self._train_n  # the one host read, at a validation / the end
        self._train_sum, self._train_n = 0.0, 0
        return mean

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        # not on_validation_epoch_end: Lightning calls callbacks' before the module's, which logs val/loss
        if trainer.sanity_checking or self._train_n == 0:
            return
        val = trainer.callback_metrics.get("val/loss")
        if val is None:
            return
        train = self._train_mean()
        if math.isfinite(train):
            self._judge_low(trainer, train)
        self.judge(trainer, train, float(val), passes=trainer.current_epoch + 1)
        self._probe(trainer, pl_module)  # COLLECTIVE with probe_on_the_spot (every rank, each validation)

    # ---- the rules (rank 0 reports; pure given the numbers) -----------------------------------
    def judge(self, trainer: Any, train: float, val: float, passes: int) -> list[str]:
        step, found = trainer.global_step, []
        self._last = {"train": train, "val": val, "step": step, "passes": passes}
        if not math.isfinite(val) and math.isfinite(train):
            self._want("train_eval")
            found.append(self._once(trainer, "error", "val_nonfinite",
                                    f"val/loss is {val} at step {step} while the training loss is finite ({train:.4g})",
                                    "the eval path breaks: an eval-only branch (model.eval() changes dropout/batch "
                                    "norm/caches), a mask or position ids built differently at eval, fp16 overflow "
                                    "without the training loss scaler; the doctor's train/eval probe names the module"))
            return [f for f in found if f]
        prior = self.prior
        # training at or below an untrained model's loss (x1.05: the first steps' noise around ln(vocab))
        if prior is not None and math.isfinite(train) and val > (1 + self.prior_margin) * prior and train < 1.05 * prior:
            if passes >= self.memorise_epochs:
                why, advice = (f"after {passes} passes over the training data the model memorised its few samples",
                               "give the run more distinct data (data.max_tokens, a bigger corpus) or fewer steps")
            else:
                self._want("train_eval")
                why, advice = ("in under " f"{self.memorise_epochs} passes: an eval-mode bug, not memorisation",
                               "compare the train-mode and eval-mode forward on one batch (dropout/batch norm, an "
                               "eval-only branch, the attention mask at eval); the doctor's train/eval probe names "
                               "the module where they part")
            found.append(self._once(trainer, "warning", "val_above_untrained",
                                    f"val/loss {val:.4g} at step {step} is above an untrained model's "
                                    f"ln(vocab) = {prior:.4g} (x{val / prior:.2f}) while training is at {train:.4g}: "
                                    f"{why}", advice))
        if math.isfinite(train) and math.isfinite(val):
            gap = val - train
            self._gaps.append(gap)
            tail = self._gaps[-self.gap_evals:]
            growing = len(tail) == self.gap_evals and all(b > a for a, b in zip(tail, tail[1:]))
            if growing and train > 0 and gap > self.gap_ratio * train:
                memo = passes >= self.memorise_epochs
                found.append(self._once(trainer, "warning", "train_val_gap",
                                        f"the train/val gap grew {self.gap_evals} validations in a row to {gap:.4g} "
                                        f"(val {val:.4g} vs train {train:.4g}, > {self.gap_ratio:g} x train) at step "
                                        f"{step}" + (f", after {passes} passes: memorisation" if memo else
                                                     ": overfitting"),
                                        "keep the checkpoint with the best val/loss; more distinct data, fewer "
                                        "epochs, weight decay or dropout"))
        return [f for f in found if f]

    def _judge_low(self, trainer: Any, train: float) -> None:
        if self.prior is None or self.low_fraction <= 0 or train >= self.low_fraction * self.prior:
            return
        passes = trainer.current_epoch + 1
        if passes >= self.memorise_epochs:
            why = f"after {passes} passes over the data: it memorised a few samples"
            advice = "more distinct data (data.max_tokens) or fewer steps; a rising val/loss confirms memorisation"
        else:
            self._want("causality")
            why = "in under " f"{self.memorise_epochs} passes: the model likely sees what it predicts (leakage)"
            advice = ("check causality (the attention mask; position t must not see t+1), labels copied into the "
                      "inputs, train/val overlap (debug=data); the doctor's causality probe names the module")
        self._once(trainer, "warning", "loss_implausibly_low",
                   f"training loss {train:.4g} (mean over the steps up to {trainer.global_step}) is below {self.low_fraction:g} x an "
                   f"untrained model's ln(vocab) = {self.prior:.4g}, more than natural text allows: {why}", advice)

    def _want(self, probe: str) -> None:
        if probe not in self._wanted and f"{probe}_on_the_spot" not in self._reported:
            self._wanted.append(probe)

    def _probe(self, trainer: Any, pl_module: Any) -> None:
        """Run the probes the rules asked for (rank 0's list, broadcast: COLLECTIVE) on every rank; rank 0
        reports each once."""
        if not self.probe_on_the_spot:
            return
        wanted = collectives.broadcast(trainer, list(self._wanted), src=0) if trainer.world_size > 1 else self._wanted
        self._wanted = []
        if not wanted:
            return
        net, batch = getattr(pl_module, "net", None), self._batch
        if not isinstance(net, torch.nn.Module) or batch is None:
            return  # alike on every rank: the same module class, a training batch on each
        batch = first_rows(batch, 2)  # the probe's forwards (and its module trace) on 2 rows, as preflight's
        any_rank = functools.partial(self.any_rank, trainer)
        collective = bool(getattr(trainer.strategy, "zero_stage_3", False))  # ZeRO-3: every forward gathers
        inputs = ProbeInputs(net, batch, shifts_labels=bool(getattr(pl_module, "shifts_labels", True)),
                             agree=any_rank if collective else None)  # (as preflight's)
        wanted = [name for name in wanted if PROBES[name].on_the_spot]  # the same list on every rank
        results = run_registered(wanted, inputs, any_rank, collective)
        for r in results:
            self._reported.append(f"{r.probe}_on_the_spot")
            if trainer.global_rank == 0:
                self._report_probe(trainer, r)

    def _report_probe(self, trainer: Any, r: ProbeResult) -> None:
        code = f"{r.probe}_on_the_spot"
        details = {"status": r.status, "culprit": r.culprit, "seconds": r.seconds, **r.details}
        if r.status == "fail":
            self.report(trainer, "error", code, f"the {r.probe} probe, run on the spot on the last training batch: "
                        f"{r.message}", r.advice, details, rank=None)
        elif r.probe == "causality" and r.status == "pass":
            self.report(trainer, "info", code, f"the causality probe, run on the spot on the last training batch, "
                        f"passed: the net does not see the future and the labels are not among the inputs "
                        f"({r.message})", "then the low loss comes from the data: train/val overlap or repeated "
                        "sequences (debug=data checks the overlap)", details, rank=None)
        else:
            self.report(trainer, "info", code, f"the {r.probe} probe, run on the spot, says {r.status}: {r.message}",
                        "", details, rank=None)

    def _once(self, trainer: Any, severity: str, code: str, message: str, advice: str) -> str | None:
        if code in self._reported:
            return None
        self._reported.append(code)
        if trainer.global_rank == 0:
            self.report(trainer, severity, code, message, advice, dict(self._last), rank=None)
        return code

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._train_n:  # steps since the last validation (or a run without one)
            train = self._train_mean()
            if math.isfinite(train):
                self._judge_low(trainer, train)
        self._probe(trainer, pl_module)  # COLLECTIVE with probe_on_the_spot (every rank, once at the end)
        if trainer.global_rank == 0:
            last = self._last
            text = (f"last validation at step {last['step']}: train {last['train']:.4g}, val {last['val']:.4g}, "
                    f"{last['passes']} pass(es) over the data" if last else "no validation ran")
            self.report(trainer, "info", "outcome_summary", f"{text}; findings: {', '.join(self._reported) or 'none'}",
                        details={**last, "gaps": self._gaps[-20:], "reported": list(self._reported),
                                 "untrained_loss": self.prior}, rank=None)
