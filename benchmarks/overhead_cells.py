"""The overhead benchmark's variants, cells and cadences (benchmarks/overhead.py drives them, overhead_worker.py
fits them, overhead_report.py judges them against ``TARGETS``): shared here so none of the three imports another."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["CALLBACKS", "DEFAULT_CELLS", "DEFAULT_RUN_STEPS", "PRESETS", "TARGETS", "cadence_window", "cadences",
           "cell_overrides", "variant_overrides"]

PRESETS = ["none", "light", "full"]
CALLBACKS = ["reproducibility", "comm_debug", "grad_monitor", "data_inspector", "profiler", "freeze_verify",
             "log_sync",
             # the forensics checks
             "replica_parity", "loss_spike", "layer_health", "moe_router", "memory", "throughput", "mixed_precision",
             "nan_triage"]
DEFAULT_CELLS = ["zero2:1", "zero2:2", "zero3:1", "zero3:2"]
DEFAULT_RUN_STEPS = 300  # conf/trainer/default.yaml max_steps
TARGETS = {"light": 0.02, "full": 0.15}


def variant_overrides(variant: str) -> list[str]:
    if variant in PRESETS:
        return [f"debug={variant}"]
    return ["debug=none", f"+callbacks={variant}"]


def cadences(cfg: Any, longest: int = 50) -> tuple[int, ...]:
    """The callbacks' ``every_n_steps`` cadences up to ``longest`` steps."""
    found = set()
    for conf in (cfg.get("callbacks") or {}).values():
        n = conf.get("every_n_steps") if hasattr(conf, "get") else None
        if isinstance(n, int) and 0 < n <= longest:
            found.add(n)
    return tuple(sorted(found))


def cadence_window(cfg: Any, base: int, longest: int = 50) -> int:
    """``base`` rounded up to a multiple of every callback cadence (``every_n_steps`` <= longest)."""
    period = 1
    for n in cadences(cfg, longest):
        period = period * n // math.gcd(period, n)
    return -(-base // period) * period


def cell_overrides(cell: str) -> list[str]:
    stage, ranks = cell.split(":")
    return [f"strategy={stage}", "trainer=cpu" if ranks == "1" else "trainer=ddp_sim",
            *([] if ranks in ("1", "2") else [f"trainer.devices={ranks}"])]
