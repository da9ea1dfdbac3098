"""Running a probe on the run's own net, mid-run: nothing about the run may change, and every rank
makes the same forwards.

- ``untouched(net)``: buffers (BatchNorm statistics, counters), train/eval flags and the RNG streams
  (CPU and this rank's CUDA device) are put back after the block; no gradient is kept.
- ``probe_agreed(name, call, any_rank)``: ``call(locate=False)`` compares outputs only (cheap, no module
  trace); when it failed on any rank without naming a module, every rank calls ``call(locate=True)``
  to name it. ``any_rank(flag) -> bool`` is the run's agreement (an all-reduce): COLLECTIVE, every rank
  calls it once or twice alike. Under ZeRO-3 each forward gathers parameters: every rank must run the
  same probes in the same order.
- ``guarded(name, fn, collective)``: the one rule of every harness (the doctor, preflight,
  outcome_monitor): a probe that raises is a ``skip`` naming the error (it could not judge the property:
  a check must not crash the run it checks, and an error of the net's own is met again by the doctor's
  probes that step through the strategy) -- unless ``collective`` (ZeRO-3: each forward gathers parameters): a rank
  that left the probe half-way would leave the others waiting in the next gather, so the error is raised
  (the run would meet it too).
- A failure stays a failure: the traced rerun replaces it only with its own (culprit-naming) failure.
- ``run_registered(names, inputs, any_rank, collective)``: the registry's probes (probes/registry.py) on
  the run's own net, each agreed as above, the ones a rank's batch is too small for skipped on every rank.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Iterator

import torch

from dsdebug.distributed.collectives import collective_region
from dsdebug.probes.result import ProbeResult

__all__ = ["first_rows", "guarded", "probe_agreed", "run_registered", "untouched"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def untouched(net: torch.nn.Module) -> Iterator[None]:
    buffers = [(b, b.detach().clone()) for b in net.buffers()]
    modes = {m: m.training for m in net.modules()}
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        try:
            yield
        finally:
            for b, saved in buffers:
                b.copy_(saved)
            for m, training in modes.items():
                m.training = training


def guarded(name: str, fn: Callable[[], ProbeResult], collective: bool = False) -> ProbeResult:
    started = time.perf_counter()
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - a probe must not crash the run it checks
        if collective:
            log.error("probe %s raised %s on this rank inside a collective forward; raising it (the other ranks "
                      "are in the same probe)", name, type(e).__name__)
            raise
        log.warning("probe %s could not run: %s: %s", name, type(e).__name__, " ".join(str(e).split())[:200])
        log.debug("probe %s raised", name, exc_info=True)
        result = ProbeResult(name, "skip", f"the probe could not run: {type(e).__name__}: "
                             f"{' '.join(str(e).split())[:200]}", "<probe>",
                             "the property was not judged; the traceback is in the log at DEBUG level")
    result.seconds = round(time.perf_counter() - started, 3)
    return result


def probe_agreed(name: str, call: Callable[[bool], ProbeResult], any_rank: Callable[[bool], bool],
                 collective: bool = False) -> ProbeResult:
    region = collective_region if collective else contextlib.nullcontext  # ZeRO-3: the forwards gather
    with region():
        result = guarded(name, lambda: call(False), collective)
    unnamed = result.status == "fail" and result.culprit in ("", "<net>")
    if any_rank(unnamed):  # COLLECTIVE
        with region():
            again = guarded(name, lambda: call(True), collective)
        if result.status == "fail" and again.status == "fail":
            result = again
    return result


def run_registered(names: list[str], inputs: Any, any_rank: Callable[[bool], bool],
                   collective: bool = False) -> list[ProbeResult]:
    """The registered probes ``names``, in order, on the run's own net (``inputs.net``), left untouched.
    COLLECTIVE: every rank calls it with the same names; the batch-size skips are decided together first."""
    from dsdebug.probes.registry import PROBES, too_small

    skipped = {}
    for name in names:  # COLLECTIVE: one agreement per probe, before any forward
        reason = too_small(PROBES[name], inputs.batch)
        if any_rank(reason is not None):
            skipped[name] = reason or "a rank's batch is too small for it"
    out = []
    with untouched(inputs.net):
        for name in names:  # COLLECTIVE: the same calls, in the same order, on every rank
            call = PROBES[name].call
            out.append(ProbeResult(name, "skip", skipped[name]) if name in skipped else
                       probe_agreed(name, lambda locate, call=call: call(inputs, locate), any_rank, collective))
    return out


def first_rows(batch: dict, rows: int) -> dict:
    """The batch's tensors, cut to their first ``rows`` rows where they are per-row (same leading size as
    ``input_ids``): the probes' forwards cost that share of the batch's."""
    full = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    n = int(full["input_ids"].shape[0])
    return {k: v[:rows] if v.dim() and v.shape[0] == n else v for k, v in full.items()}
