"""Model-state bytes per rank under DDP and ZeRO-1/2/3 (+ offload), measured vs the ZeRO paper.

What it does: builds the framework's DeepSeek-V3 (``dsdebug.models.deepseek.build_deepseek_v3``),
wraps it with ``deepspeed.initialize`` (no Lightning: this is about DeepSpeed's partitioning),
trains ``--steps`` optimizer steps on 1 or N real CPU processes (gloo, ``DS_ACCELERATOR=cpu``),
then, after one more backward and before its optimizer step (params, grads and Adam states all
live), sums the bytes of every live tensor storage on each rank (``gc`` walk, deduplicated by
storage pointer, minus a baseline taken before the model was built) and splits them by the
DeepSpeed structure that holds them:

| category | what | e.g. |
|---|---|---|
| params | low-precision weights (module params, ZeRO-3 ``ds_tensor`` partitions) | ``bit16_groups_flat`` |
| grads | gradient storage (module ``.grad``, partition buffers, fp32 grads of the master) | ``averaged_gradients`` |
| master | fp32 master weights (the params the inner optimizer updates) | ``single_partition_of_fp32_groups`` |
| adam | optimizer moments (``exp_avg``, ``exp_avg_sq``) | ``basic_optimizer.state`` |
| buffers | other tensors DeepSpeed holds: reduce buckets, offload staging copies | ``ipg_buckets`` |
| unreached | live but not reachable from the engine (activation leftovers, temporaries) | |

It also takes the same snapshot at the end of autograd, just before DeepSpeed's gradient
reduction (``engine.allreduce_gradients``): ZeRO-1 holds full gradients only until then.

"ddp" is DeepSpeed ZeRO stage 0 (same bf16 mixed-precision optimizer path as the ZeRO stages:
bf16 weights/grads, fp32 master copy, Adam), not torch DDP. Offload: on a CPU box the
accelerator *is* RAM, so "offloaded" bytes are those held by the structures DeepSpeed puts on
the offload device (fp32 master, Adam, fp32 grads, bf16 staging copies; with param offload the
bf16 partitions too); the rest would sit on the accelerator.

Usage::

    python benchmarks/zero_memory.py                       # both sizes, 1 and 2 ranks, all strategies
    python benchmarks/zero_memory.py --sizes tiny --ranks 2 --strategies zero1,zero3 --steps 3
    python benchmarks/zero_memory.py --dtype fp32 --out logs/bench/zero_memory_fp32

Writes ``results.json``, ``results.md`` (also printed) and ``zero_memory.png`` under ``--out``
(default ``logs/bench/zero_memory``), and per-rank logs under ``--out``/logs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# The formula and the structure walk live in src (the memory check uses them on live runs).
from dsdebug.models.model_states import DTYPES, STRATEGIES, paper_bytes  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))  # imported as a module (tests) too
from zero_memory_measure import SEQ_LEN, _worker, measure  # noqa: E402,F401
from zero_memory_report import CATEGORIES, markdown, plot, residual  # noqa: E402,F401

# Model sizes: kwargs for build_deepseek_v3. "large" is ~5x the default tiny model (8.7M).
SIZES = {
    "tiny": {},
    "large": {"hidden_size": 512, "num_hidden_layers": 8, "moe_intermediate_size": 384},
}


# ---------------------------------------------------------------------------------------------
# Launching ranks (parent process)
# ---------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(size: str, model_kwargs: dict, n: int, strategies: list[str], steps: int, dtype: str,
              out: Path, timeout: float) -> list[list[dict]]:
    """Launch ``n`` ranks as subprocesses; returns per-rank result lists. Kills every rank on error."""
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    tag = f"{size}_n{n}"
    result = str(logs / f"{tag}_rank{{rank}}.json")
    job = json.dumps({"model_kwargs": model_kwargs, "steps": steps, "dtype": dtype,
                      "strategies": strategies, "result": result})
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": str(n), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    procs = []
    try:
        for rank in range(n):
            log = open(logs / f"{tag}_rank{rank}.log", "w")
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--_worker", job], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, start_new_session=True))
            log.close()
        deadline = time.time() + timeout
        while any(p.poll() is None for p in procs) or any(p.returncode for p in procs):
            failed = [f"rank {r} exited {p.returncode}" for r, p in enumerate(procs) if p.returncode]
            if failed or time.time() > deadline:  # a dead rank leaves the others hanging in a collective
                time.sleep(0.5)  # let a rank that fails because of another one report too
                failed = [f"rank {r} exited {p.poll()}" for r, p in enumerate(procs) if p.poll()]
                why = ", ".join(failed) if failed else f"timed out after {timeout:.0f} s"
                raise RuntimeError(f"{tag}: {why}; see {logs}/{tag}_rank*.log")
            time.sleep(0.2)
        return [json.loads(Path(result.format(rank=r)).read_text()) for r in range(n)]
    finally:
        for p in procs:  # only our own ranks, each in its own session
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def run_benchmark(sizes: dict[str, dict], ranks: list[int], strategies: list[str], steps: int, out: Path,
                  dtype: str = "bf16", timeout: float = 300) -> list[dict]:
    """Measure every (size, ranks, strategy); returns one record per combination (worst rank + all ranks)."""
    param_b, grad_b, k = DTYPES[dtype]
    records = []
    for size, kwargs in sizes.items():
        for n in ranks:
            t0 = time.time()
            per_rank = run_group(size, kwargs, n, strategies, steps, dtype, out, timeout)
            print(f"  {size} x {n} rank(s): {time.time() - t0:.0f} s", file=sys.stderr)
            for i, strategy in enumerate(strategies):
                ranks_ = [per_rank[r][i] for r in range(n)]
                worst = max(ranks_, key=lambda m: m["before_step"]["total"])
                psi = worst["psi"]
                records.append({
                    "size": size, "model_kwargs": kwargs, "psi": psi, "largest_param": worst["largest_param"],
                    "hidden_size": worst["hidden_size"], "ranks": n, "strategy": strategy,
                    "dtype": dtype, "measured": worst["before_step"], "end_of_backward": worst["end_of_backward"],
                    "formula": paper_bytes(strategy, psi, n, param_b, grad_b, k),
                    "per_rank_total": [m["before_step"]["total"] for m in ranks_],
                    "per_rank_end_of_backward": [m["end_of_backward"]["total"] for m in ranks_],
                    "losses": worst["losses"], "seconds": worst["seconds"]})
                records[-1]["residual"] = residual(records[-1])
    return records


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, non-zero exit
        self.exit(2, f"error: {message}\n")


def _choices(valid):
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in valid]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{','.join(bad) or repr(text)} is not valid; valid: {', '.join(valid)}")
        return list(dict.fromkeys(items))
    return parse


def _ranks(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 or v > 8 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} is not valid; give comma-separated integers 1..8, e.g. 1,2")
    return sorted(set(values))


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid; give an integer >= 1")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_worker"]:
        _worker(argv[1])
        return 0
    parser = _Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=_choices(list(SIZES)), default=list(SIZES),
                        help=f"comma-separated model sizes ({', '.join(SIZES)}; default all)")
    parser.add_argument("--ranks", type=_ranks, default=[1, 2], help="comma-separated rank counts (default 1,2)")
    parser.add_argument("--strategies", type=_choices(list(STRATEGIES)), default=list(STRATEGIES),
                        help=f"comma-separated ({', '.join(STRATEGIES)}; default all)")
    parser.add_argument("--steps", type=_positive, default=2, help="optimizer steps before measuring (default 2)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="bf16 (paper setting) or fp32")
    parser.add_argument("--timeout", type=_positive, default=300, help="seconds per launch of N ranks (default 300)")
    parser.add_argument("--out", type=Path, default=REPO / "logs" / "bench" / "zero_memory", help="output directory")
    args = parser.parse_args(argv)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        parser.error(f"--out {args.out}: cannot create directory ({e.strerror})")

    from importlib.metadata import version

    t0 = time.time()
    try:
        records = run_benchmark({s: SIZES[s] for s in args.sizes}, args.ranks, args.strategies, args.steps,
                                args.out, args.dtype, args.timeout)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    meta = {"date": datetime.now().strftime("%Y-%m-%d %H:%M"), "steps": args.steps, "dtype": args.dtype,
            "machine": f"{_cpu_name()}, {os.cpu_count()} cores",
            "torch": version("torch"), "deepspeed": version("deepspeed"), "wall_s": time.time() - t0}
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    table = markdown(records, meta)
    (args.out / "results.md").write_text(table)
    plot(records, args.out / "zero_memory.png")
    print(table)
    print(f"wrote {args.out}/results.json, results.md, zero_memory.png ({meta['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
