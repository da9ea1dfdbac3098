"""Probe: optimizer coverage and gradient flow, over one real training step.

Every parameter that requires grad must be owned by the optimizer (a parameter created or replaced
after the optimizer was built, or left out of its param groups, never trains), receive a non-zero
gradient (a disconnected branch, a detach, an unused head), and move after the step (an LR of 0 in
its group); a frozen parameter must not move (an in-place update in forward, weight decay on it).

``coverage(stepper, batch)`` works with ``TorchStepper`` (a plain module and optimizer) and the run's
``StrategyStepper``. COLLECTIVE with a StrategyStepper (every rank, same point)."""

from __future__ import annotations

from typing import Any

import torch

from dsdebug.probes.result import ProbeResult

__all__ = ["coverage"]

NAME = "coverage"


def coverage(stepper: Any, batch: dict) -> tuple[ProbeResult, Any]:
    """(result, the step's StepInfo): the step's loss and gradient norm feed the run-plan and
    memory probes."""
    named = stepper.named_parameters()
    owned = stepper.owned()
    before = stepper.snapshot()
    info = stepper.step(batch, grads=True, measure=True)
    after = stepper.snapshot()
    unowned, no_grad, not_moved, frozen_moved = [], [], [], []
    for name, p in named:
        moved = not torch.equal(before[name], after[name])
        if not p.requires_grad:
            if moved:
                frozen_moved.append(name)
            continue
        if id(p) not in owned:
            unowned.append(name)
        elif not info.grads.get(name):  # None or exactly 0
            no_grad.append(name)
        elif not moved:
            not_moved.append(name)
    details = {"params": len(named), "trainable": sum(p.requires_grad for _, p in named), "unowned": unowned[:20],
               "no_grad": no_grad[:20], "not_moved": not_moved[:20], "frozen_moved": frozen_moved[:20],
               "loss": info.loss, "grad_norm": info.grad_norm, "lr": info.lr}
    if unowned:
        return ProbeResult(
            NAME, "fail", f"{len(unowned)} trainable parameter(s) not owned by the optimizer, first {unowned[0]}: "
            "created or replaced after the optimizer was built, or left out of its param groups; they never "
            "train", unowned[0], "build every module before configure_optimizers (not in setup/on_fit_start "
            "hooks after it), and pass every trainable parameter to the optimizer's param groups", details), info
    if no_grad:
        return ProbeResult(
            NAME, "fail", f"{len(no_grad)} trainable parameter(s) get no gradient, first {no_grad[0]}: not "
            "connected to the loss (unused, detached, or behind an integer/argmax op)", no_grad[0],
            f"connect {no_grad[0]} to the loss, or freeze it (requires_grad=False) if it is not meant to train",
            details), info
    if not_moved:
        return ProbeResult(
            NAME, "fail", f"{len(not_moved)} parameter(s) with a gradient did not move after a step, first "
            f"{not_moved[0]} (the step's LR, first param group: {info.lr})",
            not_moved[0], "check the LR of its param group and the schedule's first value (warmup starting at 0)",
            details), info
    if frozen_moved:
        return ProbeResult(
            NAME, "fail", f"{len(frozen_moved)} frozen parameter(s) changed during a step, first {frozen_moved[0]} "
            "(an in-place update in forward, or an optimizer that updates it anyway)", frozen_moved[0],
            f"do not modify {frozen_moved[0]} in place; keep frozen parameters out of the optimizer (or register "
            "running statistics as buffers)", details), info
    trainable = details["trainable"]
    return ProbeResult(NAME, "pass", f"all {trainable} trainable parameters are owned, get a gradient and move; "
                       f"{len(named) - trainable} frozen ones stay", details=details), info
