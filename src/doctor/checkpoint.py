"""Probe: checkpoint round trip. Save, train on, disturb the frozen parameters, load: every weight
(frozen ones included) must be bit-identical to the saved ones, and the next step's loss after the
load must equal the one the uninterrupted run had (the optimizer state and LR schedule came back too).

Breaks by a state_dict that leaves parameters out (frozen ones, a renamed module), a load that is
not strict, optimizer state or schedule not restored, a ZeRO-3 partition not gathered.

``checkpoint_round_trip(stepper, batch, path, train=...)``: ``train`` runs the steps between save
and load (the overfit probe, so no extra steps) and returns the losses; COLLECTIVE with a
StrategyStepper."""

from __future__ import annotations

from typing import Any, Callable

import torch

from dsdebug.probes.result import ProbeResult

__all__ = ["checkpoint_round_trip"]

NAME = "checkpoint"


def checkpoint_round_trip(stepper: Any, batch: dict, path: str,
                          train: Callable[[], list[float]] | None = None) -> tuple[ProbeResult, Any]:
    """Returns (result, what ``train`` returned)."""
    stepper.save(path)
    saved = stepper.snapshot()
    rng = torch.get_rng_state()
    if train is None:
        losses = [stepper.step(batch).loss, stepper.step(batch).loss]
        trained = None
    else:
        trained = train()
        losses = trained[1] if isinstance(trained, tuple) else trained
    stepper.perturb()
    stepper.load(path)
    loaded = stepper.snapshot()
    torch.set_rng_state(rng)
    replay = [stepper.step(batch).loss, stepper.step(batch).loss]
    frozen = {n for n, p in stepper.named_parameters() if not p.requires_grad}
    diff = [n for n in saved if n not in loaded or not torch.equal(saved[n], loaded[n])]
    details = {"params": len(saved), "frozen": len(frozen), "differ": diff[:20],
               "next_loss": losses[1] if len(losses) > 1 else None, "replayed": replay[1]}
    if diff:
        first = diff[0]
        kind = "frozen " if first in frozen else ""
        return ProbeResult(
            NAME, "fail", f"{len(diff)} parameter(s) differ after save + load, first {kind}{first}: the checkpoint "
            "does not bring them back", first, f"make sure the checkpoint holds {first} (a state_dict that leaves "
            "frozen or renamed parameters out, a non-strict load, DeepSpeed's exclude_frozen_parameters)",
            details), trained
    if len(losses) > 1 and losses[1] != replay[1]:
        return ProbeResult(
            NAME, "fail", f"weights come back bit-identical but the next step's loss does not ({losses[1]!r} vs "
            f"{replay[1]!r} after the load): optimizer state, LR schedule or RNG is not restored",
            "optimizer/scheduler state", "save and load the optimizer and scheduler state with the weights", details), trained
    return ProbeResult(NAME, "pass", f"save + load: all {len(saved)} parameters ({len(frozen)} frozen) bit-identical, "
                       "next-step loss identical", details=details), trained
