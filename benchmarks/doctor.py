"""How long the preflight doctor takes: ``train.py <overrides> doctor=true`` on the default model
(DeepSeek-V3 tiny, ZeRO-2) at 2 CPU ranks, as a user runs it.

    python benchmarks/doctor.py                          # 2 rounds, the default run at 2 ranks
    python benchmarks/doctor.py --rounds 3 --overrides trainer=ddp_sim strategy=zero3

Per round: the wall time of the whole command, the doctor's own time (``metrics.json``
``doctor_time_s``: from the doctor's start, after process start-up, imports and config
composition, to the verdict: building data/model/strategy, DeepSpeed's set-up, every probe), the
CPU seconds rank 0's process spent in it (``doctor_cpu_s``: on a machine shared with other work,
the closest to what the doctor costs on 2 free cores, one per rank), the CPU seconds of the whole
command (both ranks, start-up included) and each probe's seconds. The budget is 90 s for the doctor beyond process start. The host's
load average is recorded before and after each round: the doctor's time scales with it on a shared
machine. Results: logs/bench/doctor/results.json and doctor.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT = ["trainer=ddp_sim"]


def one_round(overrides: list[str], log_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    load_before = os.getloadavg()[0]
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), *overrides, "doctor=true", f"paths.log_dir={log_dir}"],
                          cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - children.ru_utime) + (after.ru_stime - children.ru_stime)  # both ranks, start-up included
    runs = sorted((log_dir / "train" / "runs").glob("*"))
    metrics = json.loads((runs[-1] / "metrics.json").read_text()) if runs else {}
    return {"exit": proc.returncode, "wall_s": round(wall, 2), "doctor_s": metrics.get("doctor_time_s"),
            "start_s": round(wall - (metrics.get("doctor_time_s") or 0.0), 2),
            "cpu_s_all_ranks": round(cpu, 1), "doctor_cpu_s_rank0": metrics.get("doctor_cpu_s"),
            "probes": {r["probe"]: (r["status"], r["seconds"]) for r in metrics.get("doctor", [])},
            "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
            "stderr_tail": proc.stderr[-1500:] if proc.returncode else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--overrides", nargs="*", default=DEFAULT)
    parser.add_argument("--out", type=Path, default=REPO / "logs" / "bench" / "doctor")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rounds = []
    for i in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            r = one_round(args.overrides, Path(tmp))
        rounds.append(r)
        print(f"round {i + 1}: exit {r['exit']}, wall {r['wall_s']} s, doctor {r['doctor_s']} s, "
              f"load {r['load_before']} -> {r['load_after']}", flush=True)
    doctor_s = [r["doctor_s"] for r in rounds if r["doctor_s"] is not None]
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "host_cpus": os.cpu_count(), "overrides": args.overrides,
              "rounds": rounds, "doctor_s_median": statistics.median(doctor_s) if doctor_s else None,
              "budget_s": 90}
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    probes = sorted({p for r in rounds for p in r["probes"]})
    lines = [f"# doctor time ({result['date']}, {os.cpu_count()} CPUs, `{' '.join(args.overrides)} doctor=true`)", "",
             "| round | exit | wall s | doctor s | doctor CPU s (rank 0) | CPU s (all ranks) | start-up s | load before/after | " + " | ".join(probes) + " |",
             "|" + "---|" * (8 + len(probes))]
    for i, r in enumerate(rounds):
        cells = [str(r["probes"].get(p, ("", ""))[1]) for p in probes]
        lines.append(f"| {i + 1} | {r['exit']} | {r['wall_s']} | {r['doctor_s']} | {r['doctor_cpu_s_rank0']} | "
                     f"{r['cpu_s_all_ranks']} | {r['start_s']} | "
                     f"{r['load_before']}/{r['load_after']} | " + " | ".join(cells) + " |")
    (args.out / "doctor.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
