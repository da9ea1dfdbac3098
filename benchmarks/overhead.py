"""What debugging costs: step time of debug=none / light / full and of each callback alone.

    python benchmarks/overhead.py                       # the default set (make bench)
    python benchmarks/overhead.py --cells zero2:2 --rounds 5 --variants none,light,grad_monitor

Method (docs/benchmarks.md has the results):

* A *cell* is a ZeRO stage x a number of ranks (``zero2:1``, ``zero3:2``, ...). Each cell is one
  process group that fits every variant in turn (harness.py): the same default model, data,
  seed and optimizer, built as ``train.py strategy=<stage> debug=<variant>`` builds them.
* Each fit runs ``warmup + window`` optimizer steps. Its steady step time is the window's
  median step plus the excess of its periodic steps (multiples of a callback cadence) spread
  over the window (harness.window_stats): periodic work is charged at its real rate, a random
  slow step caused by something else on the machine is not. A variant's window is ``--window`` rounded up to a multiple of its
  callbacks' cadences (``every_n_steps`` up to 50: light's 50-step cadence gets a 50-step
  window), so periodic work (per-layer norms, fingerprint gathers, rank stats) is charged at
  its real rate. Rarer work (gradient histograms every 100 steps) happens at step 0 and is
  counted as one-off. One-off work (the profiler window, the replay self-check, the freeze check, callback
  setup) is what the variant spends before the window beyond its steady rate.
* Variants run interleaved: round ``r`` runs them in the list order rotated by ``r``. Each
  variant's overhead is its ratio to the ``none`` fit *of the same round* (neighbours in
  time, so machine drift cancels), and the reported number is the median over rounds.
* ``default run`` overhead = steady overhead + one-off seconds / (the default run's 300 steps
  at the ``none`` rate): what a user of ``train.py debug=<variant>`` pays over a whole default
  run. Targets: light <= 2 %, full <= 15 %.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

from overhead_cells import (CALLBACKS, DEFAULT_CELLS, DEFAULT_RUN_STEPS, PRESETS, TARGETS,  # noqa: E402,F401
                            cadence_window, cadences, cell_overrides, variant_overrides)


# ---- driver: cells as subprocesses, then the tables -----------------------------------------

def summarize(cell: dict[str, Any]) -> dict[str, Any]:
    """Per variant: steady overhead (median over rounds of mean/none_mean - 1), one-off seconds."""
    warmup = cell["warmup"]
    by_round: dict[int, dict[str, dict]] = {}
    for fit in cell["fits"]:
        by_round.setdefault(fit["round"], {})[fit["variant"]] = {
            **harness.window_stats(fit["step_s"], warmup, fit.get("window", cell["window"]),
                                   tuple(fit.get("cadences", ()))), "setup_s": fit["setup_s"],
            "tokens_per_step": fit["tokens_per_step"], "leaked": fit["leaked"],
            "window": fit.get("window", cell["window"]),
            "cpu_s": window_cpu_s(fit, warmup, fit.get("window", cell["window"])),
            **direct_share(fit, warmup)}
    rows: dict[str, Any] = {}
    variants = {v for fits in by_round.values() for v in fits}
    for variant in sorted(variants, key=lambda v: (PRESETS + CALLBACKS + [v]).index(v)):
        ratios, medians, oneoffs, means, direct, cpu_ratios, cpus = [], [], [], [], [], [], []
        by_cb: dict[str, list[float]] = {}
        for fits in by_round.values():
            if variant not in fits or "none" not in fits:
                continue
            v, n = fits[variant], fits["none"]
            ratios.append(v["steady_s"] / n["steady_s"] - 1)
            medians.append(v["median_s"] / n["median_s"] - 1)
            # what the variant spends before the window beyond its steady rate, vs none
            extra = lambda f: f["setup_s"] + f["warmup_s"] - warmup * f["steady_s"]  # noqa: E731
            oneoffs.append(extra(v) - extra(n))
            means.append(v["steady_s"])
            direct.append(v["direct"])
            if v["cpu_s"] and n["cpu_s"]:
                cpu_ratios.append(v["cpu_s"] / n["cpu_s"] - 1)
                cpus.append(v["cpu_s"])
            for cb, share in v["direct_by_cb"].items():
                by_cb.setdefault(cb, []).append(share)
        if not ratios:
            continue
        none_mean = statistics.median(f["none"]["steady_s"] for f in by_round.values() if "none" in f)
        steady = statistics.median(ratios)
        oneoff = statistics.median(oneoffs)
        tokens = next(f[variant]["tokens_per_step"] for f in by_round.values() if variant in f)
        rows[variant] = {
            "window": next(f[variant]["window"] for f in by_round.values() if variant in f),
            "step_ms": 1000 * statistics.median(means),
            "steady": steady,
            "steady_min": min(ratios), "steady_max": max(ratios),
            "typical_step": statistics.median(medians),
            "oneoff_s": oneoff,
            "default_run": steady + oneoff / (DEFAULT_RUN_STEPS * none_mean),
            "direct": statistics.median(direct),
            "direct_by_cb": {cb: statistics.median(x) for cb, x in by_cb.items()},
            "default_run_direct": statistics.median(direct) + oneoff / (DEFAULT_RUN_STEPS * none_mean),
            "tokens_per_s": tokens / statistics.median(means),
            "rounds": len(ratios),
            # CPU A/B: user+sys of every rank per window step, summed over ranks, vs none of the same round
            "cpu_step_ms": 1000 * statistics.median(cpus) if cpus else None,
            "cpu_steady": statistics.median(cpu_ratios) if cpu_ratios else None,
            "cpu_steady_min": min(cpu_ratios) if cpu_ratios else None,
            "cpu_steady_max": max(cpu_ratios) if cpu_ratios else None,
            "leaked": sorted({k for f in by_round.values() if variant in f for k in f[variant]["leaked"]}),
        }
    return rows


def window_cpu_s(fit: dict[str, Any], warmup: int, window: int) -> float | None:
    """Mean CPU seconds per step over the window, summed over every rank (None: an older cell.json)."""
    per_rank = fit.get("cpu_step_s") or []
    if not per_rank or any(len(r) < warmup + window for r in per_rank):
        return None
    return sum(sum(r[warmup:warmup + window]) for r in per_rank) / window


def direct_share(fit: dict[str, Any], warmup: int) -> dict[str, Any]:
    """Time inside the debug callbacks' hooks over the window, as a share of the rest of the step."""
    window = fit.get("window", 0)
    steps = sum(fit["step_s"][warmup:warmup + window])
    by_cb = {cb: sum(per_step[warmup:warmup + window]) for cb, per_step in (fit.get("hook_s") or {}).items()}
    rest = steps - sum(by_cb.values())
    return {"direct": sum(by_cb.values()) / rest if rest > 0 else 0.0,
            "direct_by_cb": {cb: t / rest for cb, t in by_cb.items()} if rest > 0 else {}}


def run_cell(cell: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    cell_dir = out / cell.replace(":", "_x")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--cell", cell, "--variants", args.variants,
           "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--window", str(args.window),
           "--prime", str(args.prime), "--out", str(cell_dir), *[f"--override={o}" for o in args.override]]
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.setdefault("PYTHONUNBUFFERED", "1")
    cell_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with open(cell_dir / "worker.log", "w") as log_file:
        proc = subprocess.Popen(cmd, cwd=harness.REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=args.cell_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise SystemExit(f"error: cell {cell} took over {args.cell_timeout} s (--cell-timeout); "
                             f"partial results in {cell_dir / 'cell.json'}, log {cell_dir / 'worker.log'}")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    if rc != 0:
        raise SystemExit(f"error: cell {cell} failed (exit {rc}); see {cell_dir / 'worker.log'}")
    data = json.loads((cell_dir / "cell.json").read_text())
    data["wall_s"] = round(time.time() - started, 1)
    harness.write_json(cell_dir / "cell.json", data)
    return data


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", default=",".join(DEFAULT_CELLS), help="stage:ranks list, e.g. zero2:1,zero3:2")
    p.add_argument("--variants", default=",".join(PRESETS + CALLBACKS),
                   help="none (always included), light, full and/or callback names")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=10, help="steps before the window (one-off work happens here)")
    p.add_argument("--window", type=int, default=10,
                   help="steps timed; rounded up per variant to a multiple of its callback cadences")
    p.add_argument("--prime", type=int, default=10, help="steps of an untimed debug=none fit first")
    p.add_argument("--out", default=str(harness.REPO / "logs" / "bench" / "overhead"))
    p.add_argument("--override", action="append", default=[],
                   help="a Hydra override for every fit (repeatable), e.g. --override model.net.hidden_size=64")
    p.add_argument("--cell-timeout", type=float, default=1800)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cell", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    for flag, value, ok, valid in (
        ("--rounds", args.rounds, args.rounds >= 1, "an int >= 1"),
        ("--warmup", args.warmup, args.warmup >= 0, "an int >= 0"),
        ("--window", args.window, args.window >= 1, "an int >= 1"),
    ):
        if not ok:
            p.exit(2, f"error: {flag}={value} is invalid; valid: {valid}\n")
    for cell in args.cells.split(","):
        stage, _, ranks = cell.partition(":")
        if stage not in ("zero1", "zero2", "zero3", "zero2_offload", "zero3_offload") or not ranks.isdigit() \
                or int(ranks) < 1:
            p.exit(2, f"error: --cells entry {cell!r} is invalid; valid: <zero1|zero2|zero3|zero2_offload|"
                      f"zero3_offload>:<ranks>, e.g. zero2:2\n")
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in PRESETS + CALLBACKS]
    if unknown:
        p.exit(2, f"error: --variants {','.join(unknown)} unknown; valid: {','.join(PRESETS + CALLBACKS)}\n")
    args.variants = ",".join(["none"] + [v for v in variants if v != "none"])
    return args


def check_configs(args: argparse.Namespace, out: Path) -> None:
    """Compose and validate every fit's config up front: a bad --override is one line, not a dead cell."""
    from dsdebug.errors import ConfigError
    from dsdebug.config.validate import validate_config

    for cell in args.cells.split(","):
        for variant in args.variants.split(","):
            overrides = [*harness.QUIET, *cell_overrides(cell), *variant_overrides(variant), *args.override]
            try:
                validate_config(harness.compose(overrides, out / "check"))
            except ConfigError as e:
                raise SystemExit(f"error: {' '.join(str(e).split())}")
            except Exception as e:  # noqa: BLE001 - Hydra's override/compose errors
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise SystemExit(f"error: config for {cell} {variant} does not compose: {first}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        from overhead_worker import worker

        worker(args)
        return 0
    out = Path(args.out)
    check_configs(args, out)
    results: dict[str, Any] = {"machine": harness.machine_info(), "cells": {}}
    for cell in args.cells.split(","):
        print(f"overhead: cell {cell} ...", flush=True)
        data = run_cell(cell, args, out)
        results["cells"][cell] = {"rounds": args.rounds, "warmup": args.warmup, "window": args.window,
                                  "wall_s": data["wall_s"], "summary": summarize(data)}
        harness.write_json(out / "overhead.json", results)
    from overhead_report import plot, table

    md = table(results)
    (out / "overhead.md").write_text(md)
    plot(results, out / "overhead.png")
    print(md)
    print(f"overhead: results in {out}/overhead.json, table overhead.md, plot overhead.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
