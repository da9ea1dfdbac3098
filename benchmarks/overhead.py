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
import logging
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

PRESETS = ["none", "light", "full"]
CALLBACKS = ["reproducibility", "comm_debug", "grad_monitor", "data_inspector", "profiler", "freeze_verify",
             "log_sync",
             # issue 14's forensics checks
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
    import math

    period = 1
    for n in cadences(cfg, longest):
        period = period * n // math.gcd(period, n)
    return -(-base // period) * period


def cell_overrides(cell: str) -> list[str]:
    stage, ranks = cell.split(":")
    return [f"strategy={stage}", "trainer=cpu" if ranks == "1" else "trainer=ddp_sim",
            *([] if ranks in ("1", "2") else [f"trainer.devices={ranks}"])]


# ---- worker: one cell, every rank ---------------------------------------------------------

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
            **direct_share(fit, warmup)}
    rows: dict[str, Any] = {}
    variants = {v for fits in by_round.values() for v in fits}
    for variant in sorted(variants, key=lambda v: (PRESETS + CALLBACKS + [v]).index(v)):
        ratios, medians, oneoffs, means, direct = [], [], [], [], []
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
            "leaked": sorted({k for f in by_round.values() if variant in f for k in f[variant]["leaked"]}),
        }
    return rows


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


def pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def table(results: dict[str, Any]) -> str:
    lines = []
    for cell, data in results["cells"].items():
        rows = data["summary"]
        lines += [f"### {cell.replace(':', ', ')} rank(s) ({data['rounds']} rounds, windows after {data['warmup']} "
                  f"warm-up steps, {data['wall_s']:.0f} s)", "",
                  "| variant | window | step (ms) | A/B steady (median) | A/B min..max | direct (hooks) | one-off (s) | "
                  "default run, A/B | default run, direct | target |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for variant, row in rows.items():
            target = TARGETS.get(variant)
            verdict = ""
            if target is not None:
                verdict = f"<= {100 * target:.0f}%: " + ", ".join(
                    f"{what} {'met' if row[key] <= target else '**over**'}"
                    for what, key in (("A/B", "default_run"), ("direct", "default_run_direct")))
            leak = " (leaked: " + ", ".join(row["leaked"]) + ")" if row["leaked"] else ""
            lines.append(f"| {variant}{leak} | {row['window']} | {row['step_ms']:.0f} | {pct(row['steady'])} | "
                         f"{pct(row['steady_min'])}..{pct(row['steady_max'])} | {pct(row['direct'])} | "
                         f"{row['oneoff_s']:+.2f} | {pct(row['default_run'])} | {pct(row['default_run_direct'])} | "
                         f"{verdict} |")
        lines.append("")
        split = {v: r["direct_by_cb"] for v, r in rows.items() if len(r["direct_by_cb"]) > 1}
        for variant, by_cb in split.items():
            lines.append(f"Direct cost inside {variant}: " + ", ".join(
                f"{cb} {pct(share)}" for cb, share in sorted(by_cb.items(), key=lambda kv: -kv[1])) + ".")
        lines.append("")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    """Default-run overhead per variant and cell: the A/B comparison and the direct (hook) cost."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = list(results["cells"])
    variants = [v for v in PRESETS[1:] + CALLBACKS if any(v in results["cells"][c]["summary"] for c in cells)]
    fig, axes = plt.subplots(2, 1, figsize=(10, 7.5), sharex=True)
    width = 0.8 / max(1, len(cells))
    for ax, key, title in ((axes[0], "default_run", "A/B: step time vs debug=none (median over rounds; bars: min..max)"),
                           (axes[1], "default_run_direct", "direct: time inside the debug callbacks' hooks + one-off")):
        for i, cell in enumerate(cells):
            rows = results["cells"][cell]["summary"]
            xs = [j + i * width for j in range(len(variants))]
            ys = [100 * rows.get(v, {}).get(key, float("nan")) for v in variants]
            if key == "default_run":  # the spread of the steady part over rounds
                lo = [100 * (rows[v]["steady"] - rows[v]["steady_min"]) if v in rows else 0 for v in variants]
                hi = [100 * (rows[v]["steady_max"] - rows[v]["steady"]) if v in rows else 0 for v in variants]
                ax.bar(xs, ys, width, label=cell, yerr=[lo, hi], capsize=2, error_kw={"lw": 0.7})
            else:
                ax.bar(xs, ys, width, label=cell)
        for name, target in TARGETS.items():
            ax.axhline(100 * target, ls="--", lw=0.8, color="gray")
            ax.text(len(variants) - 0.5, 100 * target, f" {name} target", va="bottom", ha="right", fontsize=8)
        ax.axhline(0, lw=0.6, color="black")
        ax.set_ylabel("overhead, default run (%)")
        ax.set_title(title, fontsize=10)
    axes[1].set_xticks([j + width * (len(cells) - 1) / 2 for j in range(len(variants))], variants, rotation=30,
                       ha="right")
    axes[0].legend(title="stage:ranks", fontsize=8)
    fig.suptitle("Cost of debugging over a default 300-step run", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    md = table(results)
    (out / "overhead.md").write_text(md)
    plot(results, out / "overhead.png")
    print(md)
    print(f"overhead: results in {out}/overhead.json, table overhead.md, plot overhead.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
