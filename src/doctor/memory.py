"""Probe: memory forecast. Model states for the active layout (DDP, ZeRO-1/2/3, offload: the ZeRO
paper's bytes per rank) plus the activations one micro-step saved for backward (measured), against
the device's memory (a GPU's total; on CPU the host's available memory shared by the local ranks):
an OOM predicted before the run, with the advice ordered for this layout.

``forecast(...)`` is pure arithmetic; ``device_bytes()`` reads the device. Local: no collective."""

from __future__ import annotations

import os
from typing import Any

import torch

from dsdebug.probes.result import ProbeResult

__all__ = ["forecast", "device_bytes"]

NAME = "memory"
GiB = 2**30


def device_bytes(device: torch.device | None = None, local_ranks: int = 1) -> tuple[int, str]:
    """(bytes one rank may use, what they are). GPU: the device's total memory. CPU: the host's
    available memory plus what this process holds already, shared by ``local_ranks``."""
    if device is not None and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(total), f"{torch.cuda.get_device_name(device)} ({total / GiB:.1f} GiB)"
    available = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        import psutil

        available = int(psutil.virtual_memory().available)
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        rss = 0
    share = available // max(1, local_ranks) + rss
    return share, f"host memory available to each of {local_ranks} local rank(s) ({share / GiB:.1f} GiB)"


def forecast(states: dict, activation_bytes: int, device_total: int, device_name: str, layout: str,
             advice: list[str], micro_batches: int = 1, headroom: float = 0.9) -> ProbeResult:
    """``states``: ``paper_bytes`` of the layout (on the device: ``accelerator``)."""
    on_device = float(states.get("accelerator", states.get("total", 0.0)))
    need = on_device + activation_bytes
    details = {"layout": layout, "states_bytes": int(on_device), "activation_bytes": int(activation_bytes),
               "forecast_bytes": int(need), "device_bytes": int(device_total), "device": device_name,
               "params_b": int(states.get("params", 0)), "grads_b": int(states.get("grads", 0)),
               "optimizer_b": int(states.get("optimizer", 0))}
    text = (f"{layout}: model states {on_device / GiB:.2f} GiB + activations {activation_bytes / GiB:.2f} GiB "
            f"(one micro-step) = {need / GiB:.2f} GiB per rank vs {device_name}")
    if need > headroom * device_total:
        steps = "; then ".join(f"{i + 1}. {a}" for i, a in enumerate(advice)) or "use a smaller model or batch"
        culprit = "activations" if activation_bytes > on_device else "model states"
        return ProbeResult(NAME, "fail", f"predicted out of memory: {text}; the larger part is the {culprit}",
                           culprit, steps, details)
    return ProbeResult(NAME, "pass", f"{text}: fits ({need / max(1, device_total):.0%})", details=details)


def model_states(strategy: Any, module: Any, world: int) -> tuple[dict, str]:
    """(``paper_bytes`` for this run's layout and dtypes, the layout name)."""
    from dsdebug.models.model_states import bytes_per_param, layout_of, paper_bytes

    layout, _ = layout_of(strategy)
    psi = sum(int(getattr(p, "ds_numel", p.numel())) for p in module.parameters())
    param_b, grad_b, k = bytes_per_param(strategy, module)
    return paper_bytes(layout, psi, world, param_b, grad_b, k), layout
