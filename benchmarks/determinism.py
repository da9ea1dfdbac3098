"""What deterministic kernels cost a training step: the reproducibility check's modes, A/B in one process.

    python benchmarks/determinism.py [--rounds 3] [--warmup 4] [--window 20] [--threads 1] [--args "strategy=zero2"]
                                     [--modes off,warn,warn_fill,strict] [--out result.json]

Each variant is one fit of the default model and data (``debug=none`` plus the reproducibility check with
``replay_steps=0``, so the check adds no per-step hook; 1 process, ZeRO-2 unless ``--args`` says otherwise),
built as train.py builds it (``benchmarks/harness.py``), and differs only in torch's flags:

| mode | callbacks.reproducibility | torch |
|---|---|---|
| ``off`` | ``deterministic=false`` (``debug=light``) | flags untouched: not deterministic |
| ``warn`` | ``deterministic=true`` (``debug=repro`` / ``debug=full``) | ``use_deterministic_algorithms(True, warn_only=True)``, cuDNN deterministic, no memory fill |
| ``warn_fill`` | ``deterministic=true fill_uninitialized_memory=true`` (what light and repro had on CUDA before) | the same, every new ``torch.empty`` filled with NaN |
| ``strict`` | ``deterministic=true warn_only=false`` (fill: auto = on) | strict mode: raises at an op without a deterministic kernel |

Rounds run the variants in rotated order after one priming fit (the first fit of a process is slower), with
``malloc_tuning`` applied as train.py applies it; a mode's cost is its median step (wall and CPU time of the
process, over the window after ``--warmup`` steps) over ``off``'s in the same round, then the median over
rounds. ``--threads 1`` (the default; the script re-executes itself with ``OMP_NUM_THREADS`` set): on the
shared 2-core box (2026-11-28, load ~5) a step of the same fit took 0.8 to 8 s of CPU with two threads, or
with ``torch.set_num_threads(1)`` alone (OpenMP threads spinning while descheduled, most likely), and held
at 0.7-0.9 s with ``OMP_NUM_THREADS=1``. Results: docs/debugging.md "Reproducibility notes".
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import fit, machine_info, rotated, write_json  # noqa: E402

MODES = {
    "off": ["callbacks.reproducibility.deterministic=false"],
    "warn": ["callbacks.reproducibility.deterministic=true"],
    "warn_fill": ["callbacks.reproducibility.deterministic=true", "callbacks.reproducibility.fill_uninitialized_memory=true"],
    "strict": ["callbacks.reproducibility.deterministic=true", "callbacks.reproducibility.warn_only=false"],
}
BASE = ["debug=none", "+callbacks=reproducibility", "callbacks.reproducibility.replay_steps=0"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: leave as is)")
    ap.add_argument("--modes", default="off,warn,warn_fill,strict")
    ap.add_argument("--args", default="", help="extra overrides for every fit (e.g. strategy=ddp)")
    ap.add_argument("--out", default="", help="write the JSON result here")
    a = ap.parse_args(argv)
    modes = a.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad or "off" not in modes:
        ap.error(f"--modes {','.join(bad) or a.modes}: valid: {', '.join(MODES)} (off is the reference, always in)")
    if a.threads and os.environ.get("OMP_NUM_THREADS") != str(a.threads):
        # before torch starts its thread pools: with set_num_threads(1) alone a step took 5-8 s of CPU
        # instead of ~0.8 s on the shared box; run again with the variable set
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "OMP_NUM_THREADS": str(a.threads)})
    extra = shlex.split(a.args)
    steps = a.warmup + a.window
    rows: list[dict] = []
    import torch

    from dsdebug.trainer.allocator import tune_malloc

    if a.threads:
        torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory(prefix="determinism_") as tmp:
        tune_malloc(True)
        fit([*BASE, *MODES["off"], "trainer.max_steps=4", *extra], Path(tmp) / "prime")
        for rnd in range(a.rounds):
            for mode in rotated(modes, rnd):
                got = fit([*BASE, *MODES[mode], f"trainer.max_steps={steps}", *extra], Path(tmp) / f"{mode}_{rnd}")
                wall = got["step_s"][a.warmup:steps]
                cpu = got["cpu_step_s"][0][a.warmup:steps]
                rows.append({"round": rnd, "mode": mode, "wall_ms": 1e3 * statistics.median(wall),
                             "cpu_ms": 1e3 * statistics.median(cpu)})
                print(f"round {rnd} {mode:9s} step {rows[-1]['wall_ms']:.1f} ms wall, {rows[-1]['cpu_ms']:.1f} ms CPU",
                      flush=True)
    summary: dict = {}
    for mode in modes:
        ratios = {k: [] for k in ("wall", "cpu")}
        for rnd in range(a.rounds):
            this = next(r for r in rows if r["round"] == rnd and r["mode"] == mode)
            ref = next(r for r in rows if r["round"] == rnd and r["mode"] == "off")
            for k in ratios:
                ratios[k].append(this[f"{k}_ms"] / ref[f"{k}_ms"])
        mine = [r for r in rows if r["mode"] == mode]
        summary[mode] = {"wall_ms": statistics.median(r["wall_ms"] for r in mine),
                         "cpu_ms": statistics.median(r["cpu_ms"] for r in mine),
                         "wall_over_off": statistics.median(ratios["wall"]), "cpu_over_off": statistics.median(ratios["cpu"]),
                         "wall_over_off_rounds": ratios["wall"], "cpu_over_off_rounds": ratios["cpu"]}
    print("\n| mode | step ms (wall) | step ms (CPU) | wall / off | CPU / off (per round) |\n|---|---|---|---|---|")
    for mode, s in summary.items():
        per = ", ".join(f"{x:.3f}" for x in s["cpu_over_off_rounds"])
        print(f"| {mode} | {s['wall_ms']:.1f} | {s['cpu_ms']:.1f} | {s['wall_over_off']:.3f} | "
              f"{s['cpu_over_off']:.3f} ({per}) |")
    if a.out:
        write_json(Path(a.out), {"machine": machine_info(), "args": vars(a), "rows": rows, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
