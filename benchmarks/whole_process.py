"""What a debug preset costs a whole ``python train.py`` process, measured from outside.

    python benchmarks/whole_process.py [--rounds 3] [--short 10] [--long 70] [--presets none,light]
                                       [--args "strategy=zero2"]

Each round runs ``train.py debug=<preset> trainer.max_steps=<n>`` (1 process, the default model and
data, every other setting as the user's default) for every preset and both lengths, in an order
rotated by the round. The steady cost of a step is (long run - short run) / (long - short), in wall
time and in CPU time (the child's user + system, from ``wait4``): start-up, the first step's one-off
work, validation at step 0 and the end (final checkpoint, export, report) are in both runs and cancel.
A preset's overhead is its steady step cost over ``none``'s, per round, then the median over rounds.
A preset whose wall ratio is well above its CPU ratio waits (a sleep, a lock, a flush, a poll) instead
of computing. Results: docs/benchmarks.md ("whole process").

The machine must be quiet: anything else running shows up in the wall times.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_once(preset: str, steps: int, extra: list[str], workdir: Path) -> dict[str, float]:
    run_dir = workdir / f"{preset}_{steps}_{time.time_ns()}"
    cmd = [sys.executable, str(REPO / "train.py"), f"debug={preset}", f"trainer.max_steps={steps}",
           f"hydra.run.dir={run_dir}", *extra]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{shlex.join(cmd)} failed:\n{err[-3000:]}")
    return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--short", type=int, default=10)
    ap.add_argument("--long", type=int, default=70)
    ap.add_argument("--presets", default="none,light")
    ap.add_argument("--args", default="", help="extra overrides for every run")
    ap.add_argument("--out", default="", help="write the JSON result here")
    a = ap.parse_args()
    presets = a.presets.split(",")
    cells = [(p, n) for p in presets for n in (a.short, a.long)]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            order = cells[r % len(cells):] + cells[: r % len(cells)]
            times = {}
            for preset, steps in order:
                times[(preset, steps)] = run_once(preset, steps, shlex.split(a.args), Path(tmp))
                print(f"round {r} {preset:>6} {steps:>4} steps: wall {times[(preset, steps)]['wall']:.1f} s, "
                      f"cpu {times[(preset, steps)]['cpu']:.1f} s", flush=True)
            span = a.long - a.short
            per = {p: {k: (times[(p, a.long)][k] - times[(p, a.short)][k]) / span for k in ("wall", "cpu")}
                   for p in presets}
            rows.append({"round": r, "per_step": per, "runs": {f"{p}:{n}": t for (p, n), t in times.items()}})
    summary = {}
    for p in presets:
        walls = [row["per_step"][p]["wall"] for row in rows]
        cpus = [row["per_step"][p]["cpu"] for row in rows]
        summary[p] = {"step_wall_ms": round(1e3 * statistics.median(walls), 1),
                      "step_cpu_ms": round(1e3 * statistics.median(cpus), 1),
                      "wall_ratio": round(statistics.median(row["per_step"][p]["wall"] / row["per_step"]["none"]["wall"]
                                                            for row in rows), 4),
                      "cpu_ratio": round(statistics.median(row["per_step"][p]["cpu"] / row["per_step"]["none"]["cpu"]
                                                           for row in rows), 4)}
    result = {"args": a.args, "short": a.short, "long": a.long, "rounds": rows, "summary": summary,
              "load_average": os.getloadavg(), "cpus": os.cpu_count()}
    print(json.dumps(summary, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
