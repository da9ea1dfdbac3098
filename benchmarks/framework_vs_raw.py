"""What train.py costs per step over a hand-written DeepSpeed loop.

    python benchmarks/framework_vs_raw.py                        # ranks 1 and 2, 2 rounds
    python benchmarks/framework_vs_raw.py --ranks 2 --rounds 4 --steps 100

Both sides train the same thing: the default tiny DeepSeek-V3 (conf/model/deepseek_v3_tiny.yaml,
seed 42), the KJV train blocks (8 x 128 per rank, DistributedSampler shuffled with seed 42),
AdamW with the framework's param groups + warmup-cosine schedule, clipping 1.0, ZeRO stage 2
with the zero_optimization dict Lightning's DeepSpeedStrategy(stage=2) produces, fp32.

* raw: ``raw_loop.py`` (this file with ``--raw``, launched by torchrun): ``deepspeed.initialize``
  and a for-loop, the same loss code; it stamps ``time.time()`` after every optimizer step.
* framework: ``train.py debug=none strategy=zero2 trainer=cpu|ddp_sim trainer.max_steps=W+N
  export.fp32=false export.hf=false`` as a user runs it (progress bar, TensorBoard, LR monitor,
  sanity validation before step 1). Its stamps are the ``time`` of history.jsonl's ``train/loss``
  rows: Lightning writes the row of history step ``s`` (0-based batch index) at the end of that
  batch, i.e. after optimizer step ``s + 1`` -- the raw loop's stamp point.
* CPU time: every rank's user+sys over the same steps (W, W+N], from ``cpu_clock.py``
  on both sides (a callback added on the command line for train.py); summed over ranks. Wall
  time moves with the neighbours on a shared machine, CPU time far less.
* ``--variants``: framework ablations run in the same interleaved rounds (``VARIANTS``), each
  switching one suspect of the 2-rank cost off.

Steady state: mean step time over steps (W, W+N] (W=10, N=50 by default); overhead =
framework / raw - 1. Round r runs the sides in list order rotated by r (two sides alternate); the
reported overhead is the median of the per-round values, for wall and for CPU time; the overhead of each side's fastest
10-step block is a noise check. Target: <= 3 %. Both sides get OMP_NUM_THREADS = cores // ranks
(what Lightning and torchrun pick by themselves when it is unset). The two compute the same
thing: their losses agree bit for bit (1 and 2 ranks; results.md shows the difference).
Placement: torchrun starts each worker in its own session, and with Linux autogroup scheduling a
session is a CPU-share group; train.py's child ranks now get sessions of their own too (variant
``one_session``: the old placement, both ranks in one share).
Writes results.json and results.md under --out; every run's log under --out/runs/ (the
framework runs' final checkpoints are deleted once read).
Default run (2 x 2 rounds x 2 sides, N=50): ~5.4 min on a quiet 2-core box; --steps 30: ~4.3 min (estimated).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_clock  # noqa: E402
import harness  # noqa: E402  (puts the repo on sys.path)
import raw_loop  # noqa: E402
from framework_vs_raw_report import (LOG_EVERY, TARGET, block_ms, mean_step_ms, parse_history,  # noqa: E402,F401
                                     results_md, round_order, side_summary, summarize)
from supervise import BenchError, run_supervised  # noqa: E402,F401
from raw_loop import (AUX_COEF, BATCH_SIZE, BETAS, CROSS_ENTROPY, DS_CONFIG, EPS, FUSED, GRAD_CLIP, LR,  # noqa: E402,F401
                      MIN_LR_RATIO, MODEL, SEED, SEQ_LEN, VOCAB, WARMUP_RATIO, WEIGHT_DECAY, ZERO2)

REPO = harness.REPO
# Framework variants (--variants): train.py as a user runs it, and ablations that each switch one
# suspect of the 2-rank cost off. Each is a list of extra overrides.
_NO_PL_SIGTERM = ["+callbacks.cpu_clock.ablate=[lightning_sigterm]"]
VARIANTS: dict[str, list[str]] = {
    "framework": [],
    "no_preemption": ["preemption.enabled=false"],  # our per-step any_rank all-reduce
    "no_pl_sigterm": _NO_PL_SIGTERM,  # Lightning's per-step SIGTERM broadcast
    "no_collectives": ["preemption.enabled=false", *_NO_PL_SIGTERM],  # both
    "no_progress_bar": ["trainer.enable_progress_bar=false"],
    "one_session": [],  # the old placement: rank 1 in rank 0's session (env below)
    "no_malloc_tuning": ["malloc_tuning=false"],  # glibc's defaults: memory handed back and faulted in again
}
VARIANT_ENV: dict[str, dict[str, str]] = {"one_session": {"DSDEBUG_RANK_SESSIONS": "0"}}

# The framework's defaults, written out as a hand-written loop would (tests check they still
# match conf/: data/kjv.yaml, model/deepseek_v3_tiny.yaml, optim/adamw.yaml, train.yaml seed).
# ---- running both sides (the driver) --------------------------------------------------------

def _env(ranks: int) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DS_ACCELERATOR": "cpu",
           "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks))}
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"):
        env.pop(key, None)
    here = str(Path(__file__).resolve().parent)  # cpu_clock.CpuClock, for train.py and its child ranks
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    return env


def model_flags(args: argparse.Namespace) -> list[str]:
    return ["--hidden-size", str(args.hidden_size), "--layers", str(args.layers)]


def model_overrides(args: argparse.Namespace) -> list[str]:
    return [f"model.net.hidden_size={args.hidden_size}", f"model.net.num_hidden_layers={args.layers}"]


def run_raw(args: argparse.Namespace, ranks: int, run_dir: Path, port: int) -> dict[str, Any]:
    result = run_dir / "raw.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
           "--master_port", str(port), str(Path(__file__).resolve()), "--raw",
           "--total-steps", str(args.warmup + args.steps), "--warmup", str(args.warmup),
           "--result", str(result), "--raw-malloc", args.raw_malloc, *model_flags(args)]
    wall = run_supervised(cmd, run_dir / "raw.log", args.timeout, _env(ranks))
    data = json.loads(result.read_text())
    stamps = {int(k): v for k, v in data["stamps"].items()}
    return {"ms": mean_step_ms(stamps, args.warmup, args.steps), "wall_s": wall,
            **cpu_clock.summarize_ranks(data["cpu"], args.steps),
            "blocks_ms": block_ms(stamps, args.warmup, args.steps),
            "losses": {int(k): v for k, v in data["losses"].items()}}


def framework_command(args: argparse.Namespace, ranks: int, log_dir: Path, variant: str = "framework",
                      clock_dir: Path | None = None) -> list[str]:
    trainer = ["trainer=cpu"] if ranks == 1 else ["trainer=ddp_sim", f"trainer.devices={ranks}"]
    clock = [] if clock_dir is None else [
        "+callbacks.cpu_clock._target_=cpu_clock.CpuClock", f"+callbacks.cpu_clock.out={clock_dir}",
        f"+callbacks.cpu_clock.start={args.warmup}", f"+callbacks.cpu_clock.end={args.warmup + args.steps}"]
    return [sys.executable, str(REPO / "train.py"), "debug=none", "strategy=zero2", *trainer,
            f"trainer.max_steps={args.warmup + args.steps}", "export.fp32=false", "export.hf=false",
            f"paths.log_dir={log_dir}", *model_overrides(args), *clock, *VARIANTS[variant]]


def run_framework(args: argparse.Namespace, ranks: int, run_dir: Path, variant: str = "framework") -> dict[str, Any]:
    log_dir, clock_dir = run_dir / variant, run_dir / f"{variant}_cpu"
    for d in (log_dir, clock_dir):  # an earlier benchmark's run (ours, under --out) would be read twice
        shutil.rmtree(d, ignore_errors=True)
    wall = run_supervised(framework_command(args, ranks, log_dir, variant, clock_dir), run_dir / f"{variant}.log",
                          args.timeout, {**_env(ranks), **VARIANT_ENV.get(variant, {})})
    clock = cpu_clock.read_ranks(clock_dir)
    if len(clock) != ranks:
        raise BenchError(f"expected {ranks} CPU records under {clock_dir}, found {len(clock)}")
    histories = sorted(log_dir.glob("*/runs/*/history.jsonl"))
    if len(histories) != 1:
        raise BenchError(f"expected one history.jsonl under {log_dir}, found {len(histories)}")
    stamps, losses = parse_history(histories[0])
    shutil.rmtree(histories[0].parent / "checkpoints", ignore_errors=True)  # ~130 MB each, never read
    return {"ms": mean_step_ms(stamps, args.warmup, args.steps), "wall_s": wall, "losses": losses,
            "blocks_ms": block_ms(stamps, args.warmup, args.steps), "history": str(histories[0]),
            **cpu_clock.summarize_ranks(clock, args.steps)}


def bench(args: argparse.Namespace) -> dict[str, Any]:
    started = time.time()
    out = Path(args.out)
    results, port = [], args.port
    sides = ("raw", *args.variants)
    for ranks in args.ranks:
        rounds = []
        for r in range(args.rounds):
            run_dir = out / "runs" / f"ranks{ranks}_round{r}"
            got = {}
            for side in round_order(r, sides):
                print(f"ranks {ranks} round {r}: {side} ..", flush=True)
                if side == "raw":
                    got[side] = run_raw(args, ranks, run_dir, port)
                else:
                    got[side] = run_framework(args, ranks, run_dir, side)
                port += 1
            end = args.warmup + args.steps
            keep = ("ms", "cpu_ms", "cpu_ms_per_rank", "torch_threads", "threads_cpu_s", "blocks_ms",
                    "minflt_per_step", "sys_ms")
            rounds.append({"round": r, "order": round_order(r, sides), "raw_ms": got["raw"]["ms"],
                           "framework_ms": got["framework"]["ms"],
                           "raw_blocks_ms": got["raw"]["blocks_ms"],
                           "framework_blocks_ms": got["framework"]["blocks_ms"],
                           "sides": {side: {k: got[side][k] for k in keep} for side in got},
                           "wall_s": {side: round(got[side]["wall_s"], 1) for side in got},
                           "loss": {side: {s: got[side]["losses"].get(s) for s in (args.warmup, end)}
                                    for side in ("raw", "framework")}})
            print(f"  raw {got['raw']['ms']:.1f} ms/step (CPU {got['raw']['cpu_ms']:.1f}); "
                  + "; ".join(f"{v} {got[v]['ms']:.1f} (CPU {got[v]['cpu_ms']:.1f}) "
                              f"{got[v]['ms'] / got['raw']['ms'] - 1:+.1%} / CPU {got[v]['cpu_ms'] / got['raw']['cpu_ms'] - 1:+.1%}"
                              for v in args.variants)
                  + f"; loss@{args.warmup}/{end} "
                  + "  ".join(f"{s} {got[s]['losses'].get(args.warmup, float('nan')):.4f}/"
                              f"{got[s]['losses'].get(end, float('nan')):.4f}" for s in ("raw", "framework")),
                  flush=True)
        results.append({"ranks": ranks, "rounds": rounds, **summarize(rounds),
                        "variants": {v: side_summary(rounds, v) for v in args.variants}})
    return {"machine": harness.machine_info(), "target": TARGET, "warmup": args.warmup, "steps": args.steps,
            "model": {**MODEL, "hidden_size": args.hidden_size, "num_hidden_layers": args.layers},
            "omp_num_threads": {r: max(1, (os.cpu_count() or 1) // r) for r in args.ranks},
            "raw_malloc": args.raw_malloc, "results": results, "wall_s": round(time.time() - started, 1)}


# ---- command line ---------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def _multiple_of_log_every(text: str) -> int:
    value = _positive(text)
    if value % LOG_EVERY:
        raise argparse.ArgumentTypeError(f"{text!r} must be a multiple of {LOG_EVERY} (train.py logs every "
                                         f"{LOG_EVERY} steps)")
    return value


def _ranks(text: str) -> list[int]:
    try:
        ranks = [int(x) for x in text.split(",")]
    except ValueError:
        ranks = []
    if not ranks or min(ranks) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers separated by commas, e.g. 1,2")
    return ranks


def _variants(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    bad = [x for x in names if x not in VARIANTS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{bad[0] if bad else text!r}: valid: {', '.join(VARIANTS)}")
    return ["framework", *[x for x in dict.fromkeys(names) if x != "framework"]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(prog="framework_vs_raw.py", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=_ranks, default=[1, 2], help="comma-separated rank counts (default 1,2)")
    p.add_argument("--rounds", type=_positive, default=2, help="interleaved rounds per rank count (default 2)")
    p.add_argument("--steps", type=_multiple_of_log_every, default=50, help="timed steps N (default 50)")
    p.add_argument("--warmup", type=_positive, default=10, help="untimed first steps W (default 10)")
    p.add_argument("--out", default=str(REPO / "logs" / "bench" / "framework_vs_raw"), help="output directory")
    p.add_argument("--port", type=_positive, default=29561, help="first torchrun master port (default 29561)")
    p.add_argument("--timeout", type=_positive, default=600, help="seconds per run before it is killed (default 600)")
    p.add_argument("--variants", type=_variants, default=["framework"],
                   help=f"framework sides, comma-separated (default framework; ablations: {', '.join(list(VARIANTS)[1:])})")
    p.add_argument("--hidden-size", type=_positive, default=MODEL["hidden_size"], help="model width (default 256)")
    p.add_argument("--layers", type=_positive, default=MODEL["num_hidden_layers"], help="decoder layers (default 4)")
    p.add_argument("--raw-malloc", choices=("default", "tuned"), default="default",
                   help="the raw loop's host allocator: glibc's defaults as a hand-written loop has them (default), "
                        "or train.py's malloc_tuning (like for like)")
    raw = p.add_argument_group("raw worker (run by torchrun; not for direct use)")
    raw.add_argument("--raw", action="store_true", help=argparse.SUPPRESS)
    raw.add_argument("--total-steps", type=_positive, default=60, help=argparse.SUPPRESS)
    raw.add_argument("--log-every", type=_positive, default=LOG_EVERY, help=argparse.SUPPRESS)
    raw.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.hidden_size % MODEL["num_attention_heads"]:
        heads = MODEL["num_attention_heads"]
        p.error(f"--hidden-size {args.hidden_size} must be a multiple of {heads} (attention heads)")
    if args.layers < 2:
        p.error(f"--layers {args.layers}: need >= 2 (layer 0 is dense; the MoE loss needs a MoE layer)")
    if not 1024 <= args.port <= 65535 - 2 * len(args.ranks) * args.rounds:
        p.error(f"--port {args.port} must be in 1024..{65535 - 2 * len(args.ranks) * args.rounds}")
    if not args.raw and args.warmup % LOG_EVERY:  # the raw worker may stamp any window
        p.error(f"argument --warmup: '{args.warmup}' must be a multiple of {LOG_EVERY} (train.py logs every "
                f"{LOG_EVERY} steps)")
    if args.raw and not args.result:
        p.error("--raw needs --result PATH")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.raw:
        raw_loop.raw_main(args)
        return 0
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"framework_vs_raw.py: error: --out {out}: cannot create ({e.strerror})", file=sys.stderr)
        return 2
    try:
        report = bench(args)
    except BenchError as e:
        print(f"framework_vs_raw.py: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("framework_vs_raw.py: interrupted; runs stopped", file=sys.stderr)
        return 130
    harness.write_json(out / "results.json", report)
    (out / "results.md").write_text(results_md(report))
    print(results_md(report))
    print(f"wrote {out / 'results.json'} and {out / 'results.md'} (wall {report['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
