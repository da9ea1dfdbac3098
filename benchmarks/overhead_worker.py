"""The worker of ``overhead.py`` (split from it): one cell, every rank, fits every variant in turn.

Run as ``overhead.py --worker ...``; rank 0 writes ``cell.json`` after every fit, with each fit's
wall step times and every rank's CPU step times (``harness.fit``).
"""

from __future__ import annotations

import argparse
import logging
import signal
import statistics
import threading
from pathlib import Path
from typing import Any

import harness
from overhead_cells import cadence_window, cadences, cell_overrides, variant_overrides


def _global_state() -> dict[str, Any]:
    """Process-wide state a callback could leave behind after its fit (off must mean zero cost)."""
    import torch
    import torch.distributed as dist

    return {
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "threads": sorted(t.name for t in threading.enumerate()),
        "root_handlers": len(logging.getLogger().handlers),
        "collectives": {n: id(getattr(dist, n)) for n in ("all_reduce", "all_gather", "broadcast", "barrier")},
        "sigterm": repr(signal.getsignal(signal.SIGTERM)),
    }


def worker(args: argparse.Namespace) -> None:
    out = Path(args.out)
    variants = args.variants.split(",")
    results: dict[str, Any] = {"cell": args.cell, "warmup": args.warmup, "window": args.window, "fits": []}
    before = None
    # train.py applies malloc_tuning on every rank (dsdebug.train.run); these fits come from
    # entry.build directly, so the worker applies it the same way (--override malloc_tuning=false: not)
    from dsdebug.trainer.allocator import tune_malloc

    tune_malloc(harness.compose([*cell_overrides(args.cell), *args.override], out / "runs" / "prime")
                .get("malloc_tuning", True))
    if args.prime:  # the first fit of a process is slower (allocator, lazy imports, thread pools)
        harness.fit([*cell_overrides(args.cell), "debug=none", *args.override, f"trainer.max_steps={args.prime}"],
                    out / "runs" / "prime")
    for r in range(args.rounds):
        for variant in harness.rotated(variants, r):
            run_dir = out / "runs" / f"r{r}_{variant}"
            overrides = [*cell_overrides(args.cell), *variant_overrides(variant), *args.override]
            cfg = harness.compose([*harness.QUIET, *overrides], run_dir)
            window = cadence_window(cfg, args.window)
            fit = harness.fit([*overrides, f"trainer.max_steps={args.warmup + window}"], run_dir)
            fit["window"], fit["cadences"] = window, list(cadences(cfg))
            state = _global_state()
            if before is None:
                before = state
            leaked = {k: [before[k], v] for k, v in state.items() if k != "threads" and v != before[k]}
            new_threads = sorted(set(state["threads"]) - set(before["threads"]))  # one that ended is fine
            if new_threads:
                leaked["threads"] = new_threads
            if fit["rank"] == 0:
                results["fits"].append({"round": r, "variant": variant, **fit, "leaked": leaked})
                harness.write_json(out / "cell.json", results)
            logging.getLogger(__name__).warning("bench %s round %d %s: %s", args.cell, r, variant,
                                                statistics.fmean(fit["step_s"][args.warmup:]))
