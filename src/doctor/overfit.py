"""Probe: overfit one batch. A few dozen steps on one fixed batch with the run's optimizer, LR
schedule and clipping: the loss must fall far (a model that cannot memorise 8 sequences will not
learn a corpus). When it does not, the evidence says why, most telling first: an LR of ~0 (a tiny ``optim.lr``), clipping that shrinks every update by orders
of magnitude, parameters frozen or disconnected (the coverage probe), a loss that rises (LR too high).

``overfit(stepper, batch)``; COLLECTIVE with a StrategyStepper."""

from __future__ import annotations

import math
from typing import Any

from dsdebug.probes.result import ProbeResult

__all__ = ["overfit", "explain"]

NAME = "overfit"


def overfit(stepper: Any, batch: dict, steps: int = 16, drop: float = 0.7, coverage_failed: str = "",
            lr_key: str = "optim.lr") -> tuple[ProbeResult, list[float]]:
    """Pass when the last loss <= ``drop`` x the first (it fell by 30 %; the probe stops at the first step
    where it has on every rank, after 3 steps at least: a healthy net on one batch does so in
    a dozen steps; a frozen, clipped or LR-starved one does not). Returns (result, losses). The steps run at
    each param group's peak LR (the schedule paused: the plan probe judges the schedule), with the
    run's optimizer and clipping; the stepper stays in that mode (a checkpoint replay after it)."""
    stepper.hold_peak_lr = True
    infos = []
    for k in range(steps):
        infos.append(stepper.step(batch))
        fallen = math.isfinite(infos[-1].loss) and infos[-1].loss <= drop * infos[0].loss
        if k >= 2 and stepper.agree(fallen):  # every rank's loss fell far: done (COLLECTIVE, every step)
            break
    steps = len(infos)
    losses = [i.loss for i in infos]
    first, last = losses[0], losses[-1]
    details = {"steps": steps, "first": round(first, 4), "last": round(last, 4), "losses": [round(x, 4) for x in losses],
               "lrs": [i.lr for i in infos], "grad_norms": [i.grad_norm for i in infos]}
    if math.isfinite(last) and last <= drop * first:
        return ProbeResult(NAME, "pass", f"one batch, {steps} steps: loss {first:.2f} -> {last:.2f}",
                           details=details), losses
    culprit, why, advice = explain(infos, stepper.gradient_clip(), coverage_failed, lr_key)
    return ProbeResult(NAME, "fail", f"one batch, {steps} steps: loss {first:.2f} -> {last:.2f} (should fall below "
                       f"{drop * first:.2f}); {why}", culprit, advice, details), losses


def explain(infos: list, clip: float | None, coverage_failed: str = "", lr_key: str = "optim.lr") -> tuple[str, str, str]:
    """(culprit, evidence, advice) for a loss that did not fall, most telling evidence first."""
    losses = [i.loss for i in infos]
    lrs = [i.lr for i in infos if i.lr is not None]
    norms = [i.grad_norm for i in infos if i.grad_norm]
    if not all(math.isfinite(x) for x in losses):
        step = next(k for k, x in enumerate(losses) if not math.isfinite(x))
        return lr_key, f"the loss became non-finite at probe step {step}", f"lower {lr_key}, or run +callbacks=nan_triage"
    if coverage_failed:
        return coverage_failed, f"parameters do not train ({coverage_failed}, see the coverage probe)", \
            "fix what the coverage probe names"
    if lrs and max(lrs) < 1e-6:
        return lr_key, f"the LR over the probe is at most {max(lrs):.2g}: updates are ~0", \
            f"raise {lr_key}, or shorten the warmup (optim.scheduler.warmup_ratio / warmup_steps)"
    if clip and norms and min(norms) > 100 * clip:
        return "optim.grad_clip", f"gradient norms {min(norms):.3g}..{max(norms):.3g} against a clip of {clip:g}: every " \
            f"update is shrunk {min(norms) / clip:.0f}x", "raise optim.grad_clip (or find why gradients are so large: " \
            "the init scale, an unnormalised loss)"
    if losses[-1] > losses[0]:
        return lr_key, f"the loss rose ({losses[0]:.2f} -> {losses[-1]:.2f}): steps overshoot", f"lower {lr_key}"
    if lrs and max(lrs) < 1e-4:
        return lr_key, f"the LR over the probe is at most {max(lrs):.2g}", f"raise {lr_key} or shorten the warmup"
    return "<model>", "no LR, clipping or coverage cause found: the model cannot fit one batch", \
        "check the model's capacity and the loss (labels, ignore_index); run the causality and init_loss probes"
