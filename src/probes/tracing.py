"""Forward traces for the probes that name a module: every module's output, in the order the
modules finish their forward (a child finishes before its parent), so the first module whose output
differs between two runs of the net is where a difference starts (or the code just before it).

Local: no collective. Works on any ``nn.Module``; outputs that are tuples, dicts or HF outputs are
read at their first tensor (``logits``/``last_hidden_state`` first)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn

__all__ = ["ModuleTrace", "first_tensor", "first_divergence", "logits_of", "differs"]


def first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    for key in ("logits", "last_hidden_state"):
        value = getattr(output, key, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        for item in output:
            if isinstance(item, torch.Tensor):
                return item
    return None


def logits_of(output: Any) -> torch.Tensor:
    """The logits a net returned: a tensor, or an object with ``.logits`` (every HF causal LM)."""
    out = output.logits if hasattr(output, "logits") else output
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"the net returned {type(output).__name__}; the doctor needs logits [B, T, V] or .logits")
    return out


class ModuleTrace:
    """``with ModuleTrace(net) as trace: net(x)`` -> ``trace.records``: [(key, tensor)] where key is
    ``(module name, call number)``, in completion order. The net's own root is recorded last.
    ``enabled=False`` records nothing (no hooks): a probe compares only the net's output first and traces
    the modules only once it knows where to look (every module's output of a large model is a lot of memory)."""

    def __init__(self, net: nn.Module, prefix_strip: str = "", enabled: bool = True) -> None:
        self.net, self.prefix_strip, self.enabled = net, prefix_strip, enabled
        self.records: list[tuple[tuple[str, int], torch.Tensor]] = []
        self.inputs: dict[tuple[str, int], torch.Tensor] = {}  # the first floating input of each call
        self._calls: dict[str, int] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> "ModuleTrace":
        if not self.enabled:
            return self
        for name, module in self.net.named_modules():
            self._handles.append(module.register_forward_hook(self._hook(name or "<net>")))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            t = first_tensor(output)
            if t is None or not t.is_floating_point():
                return
            n = self._calls.get(name, 0)
            self._calls[name] = n + 1
            self.records.append(((name, n), t.detach().float().clone()))
            x = first_tensor(inputs)
            if x is not None and x.is_floating_point():
                self.inputs[(name, n)] = x.detach().float().clone()
        return hook


def differs(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-4, atol: float = 1e-5) -> float:
    """Max abs difference when it is beyond tolerance (relative to a's scale), else 0.0; NaN
    appearing on one side only counts as a difference."""
    if a.shape != b.shape:
        return float("inf")
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return float("inf")
    a, b = a.masked_fill(nan_a, 0), b.masked_fill(nan_b, 0)
    diff = float((a - b).abs().max()) if a.numel() else 0.0
    scale = float(a.abs().max()) if a.numel() else 0.0
    return diff if diff > atol + rtol * scale else 0.0


def first_divergence(base: "ModuleTrace", other: "ModuleTrace", select: Callable[[torch.Tensor], torch.Tensor | None],
                     rtol: float = 1e-4, atol: float = 1e-5) -> tuple[str, float, str] | None:
    """The first module (completion order of ``base``) whose ``select``-ed output differs between
    two traces: (culprit, max abs difference, where). ``select`` returns None for outputs it cannot
    place (shape it does not know): those are not compared. When that module's input differs
    already, the difference arose in the code that feeds it (its parent's forward, between its
    children): the culprit is the parent, ``where`` says before which child."""
    others = dict(other.records)
    for key, a in base.records:
        b = others.get(key)
        if b is None:
            continue
        sa, sb = select(a), select(b)
        if sa is None or sb is None:
            continue
        d = differs(sa, sb, rtol, atol)
        if not d:
            continue
        name = key[0]
        xa, xb = base.inputs.get(key), other.inputs.get(key)
        sxa = select(xa) if xa is not None else None
        sxb = select(xb) if xb is not None else None
        if sxa is not None and sxb is not None and differs(sxa, sxb, rtol, atol) and name != "<net>":
            parent = name.rsplit(".", 1)[0] if "." in name else "<net>"
            return parent, d, f"in {parent}'s forward, before {name}"
        return name, d, f"in {name}"
    return None


@contextmanager
def restored_mode(net: nn.Module) -> Iterator[None]:
    """Put every module's train/eval flag back afterwards."""
    modes = {m: m.training for m in net.modules()}
    try:
        yield
    finally:
        for m, training in modes.items():
            m.training = training
