"""How long the first ``make train`` waits before it trains: process start -> first ``train/loss`` row.

    python benchmarks/first_run.py [--rounds 2] [--args "debug=light"]

Each round runs ``train.py <args>`` (``make train``'s command) twice, in rotated order, each with an
empty ``TORCH_EXTENSIONS_DIR`` (a machine where DeepSpeed never built an op: the first run):

* ``now``: the code as it is (DeepSpeed's CPU shared-memory comm op is not built: strategy.py
  ``skip_shm_comm_op``);
* ``with_shm_build``: the same with ``skip_shm_comm_op`` turned into a no-op, as before: DeepSpeed
  JIT-builds ``deepspeed_shm_comm`` and loads it while its process group starts.

The time is wall clock from the start of the process to the first ``train/loss`` line in the run's
``history.jsonl``; the run is then stopped (SIGKILL). Last, the build + load of the op alone, timed in
a fresh process (importing deepspeed included). Results: docs/benchmarks.md (first run).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
WITH_BUILD = ("import runpy, sys; import dsdebug.trainer.strategy as s; s.skip_shm_comm_op = lambda: None; "
              "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


def first_step_s(variant: str, args: list[str], timeout: float) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        logs, ext = Path(tmp) / "logs", Path(tmp) / "torch_extensions"
        env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext), "PYTHONUNBUFFERED": "1"}
        for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"):
            env.pop(key, None)
        script = [str(REPO / "train.py"), *args, f"paths.log_dir={logs}"]
        cmd = [PY, *script] if variant == "now" else [PY, "-c", WITH_BUILD, *script]
        started = time.time()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            while time.time() - started < timeout:
                for history in logs.glob("train/runs/*/history.jsonl"):
                    if any("train/loss" in json.loads(line) for line in history.read_text().splitlines() if line):
                        return time.time() - started
                if proc.poll() is not None:
                    raise RuntimeError(f"{variant}: train.py exited {proc.returncode} before its first step")
                time.sleep(0.1)
            raise RuntimeError(f"{variant}: no first step within {timeout} s")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            built = sorted(p.name for p in ext.glob("*/*")) if ext.is_dir() else []
            print(f"  {variant}: ops built {built or 'none'}", flush=True)


def shm_op_build_s() -> float:
    """DeepSpeed's first-use build + load of the op alone (what ``skip_shm_comm_op`` saves)."""
    code = ("import os; os.environ['DS_ACCELERATOR'] = 'cpu'; from deepspeed.ops.op_builder.cpu import "
            "ShareMemCommBuilder as B; B().load()")
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "TORCH_EXTENSIONS_DIR": tmp}
        subprocess.run([PY, "-c", "import deepspeed"], env=env, check=True, capture_output=True)  # imports warm
        started = time.time()
        subprocess.run([PY, "-c", code], env=env, check=True, capture_output=True)
        return time.time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--args", default="debug=light", help="train.py arguments (make train: debug=light)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", default=str(REPO / "logs" / "bench" / "first_run.json"))
    ns = parser.parse_args()
    variants = ["now", "with_shm_build"]
    times: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(ns.rounds):
        for variant in variants[r % 2:] + variants[:r % 2]:
            s = first_step_s(variant, shlex.split(ns.args), ns.timeout)
            times[variant].append(round(s, 1))
            print(f"round {r}: {variant} first step after {s:.1f} s", flush=True)
    build = round(shm_op_build_s(), 1)
    print(f"deepspeed_shm_comm build + load alone (incl. importing deepspeed): {build} s", flush=True)
    result = {"args": ns.args, "rounds": ns.rounds, "first_step_s": times, "shm_op_build_s": build,
              "load_average": os.getloadavg(),
              "median_s": {v: statistics.median(t) for v, t in times.items()}, "cpus": os.cpu_count(),
              "date": time.strftime("%Y-%m-%d")}
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["median_s"]))


if __name__ == "__main__":
    main()
