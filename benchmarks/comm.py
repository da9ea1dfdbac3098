"""Communication options compared: bytes and time per step in collectives, and step time.

    python benchmarks/comm.py                    # every option, 2 CPU ranks (make bench-comm)
    python benchmarks/comm.py --loss-check       # + 300 steps of ddp vs ddp_powersgd: final loss
    python benchmarks/comm.py --variants ddp,ddp_fp16_comm --steps 8

Method: a *cell* is one 2-rank process group (harness.py) that fits its variants in turn, each
built as ``train.py strategy=<...> +callbacks=comm_debug`` builds it (comm_debug with its debug
env, flight recorder and watchdog off: only its timers and byte counters). Per variant:
``comm/bytes_per_step/<collective>`` (rank 0's payload per collective type) and ``comm/ms``
(time with a collective in flight) are the medians over the steps after ``--warmup``; step
time is the median step (harness StepTimer). Options the CPU cannot run (bf16 hook, ZeRO++)
are listed with their one-line error. Results: logs/bench/comm/results.json, comm.md, comm.png.

``--loss-check``: the default 300-step run with ``strategy=ddp`` and ``strategy=ddp_powersgd``
(same seed, data, model); PowerSGD passes when its final loss (mean train/loss of the last 20
steps) is within ``--tolerance`` (5 %) of plain DDP's.
"""

from __future__ import annotations

import argparse
import csv
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

COMM_DEBUG = ["debug=none", "+callbacks=comm_debug", "callbacks.comm_debug.hang_timeout_s=0", "callbacks.comm_debug.nccl_debug=null",
              "callbacks.comm_debug.distributed_debug=null", "callbacks.comm_debug.trace_buffer_size=0",
              "logger=csv", "trainer.log_every_n_steps=1", "trainer=ddp_sim"]
VARIANTS: dict[str, list[str]] = {
    "ddp": ["strategy=ddp"],
    "ddp_fp16_comm": ["strategy=ddp_fp16_comm"],
    "ddp_bf16_comm": ["strategy=ddp_bf16_comm"],
    # the bytes/time cell is 12 steps: PowerSGD from step 2 so its window sees compression (the
    # config's default starts at 30, after warm-up; the loss check runs the config as it is)
    "ddp_powersgd": ["strategy=ddp_powersgd", "strategy.powersgd_start_iter=2"],
    "zero2": ["strategy=zero2"],
    "zero2_overlap_off": ["strategy=zero2", "strategy.overlap_comm=false"],
    "zero2_bucket_5e5": ["strategy=zero2", "strategy.reduce_bucket_size=500000", "strategy.allgather_bucket_size=500000"],
    "zero2_bucket_5e8": ["strategy=zero2", "strategy.reduce_bucket_size=500000000",
                         "strategy.allgather_bucket_size=500000000"],
    "zero2_fp16_comm": ["strategy=zero2", "strategy.communication_data_type=fp16"],
    "zero3": ["strategy=zero3"],
    "zero3_hpz2": ["strategy=zero3", "strategy.zero_hpz_partition_size=2"],
    "zero3_qgz": ["strategy=zero3", "strategy.zero_quantized_gradients=true"],
}
LOSS_CHECK = {"ddp": ["strategy=ddp"], "ddp_powersgd": ["strategy=ddp_powersgd"]}  # the configs as they ship


def cell_of(variant: str) -> str:
    return "ddp" if variant.startswith("ddp") else "zero"


def read_csv(run_dir: Path) -> list[dict[str, str]]:
    files = sorted(run_dir.rglob("metrics.csv"))
    if not files:
        return []
    with open(files[-1]) as f:
        return list(csv.DictReader(f))


def per_step(rows: list[dict[str, str]], key: str) -> dict[int, float]:
    return {int(r["step"]): float(r[key]) for r in rows if r.get(key) not in (None, "")}


# ---- worker: one cell, every rank ---------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    out, results = Path(args.out), {}
    for variant in args.variants.split(","):
        run_dir = out / "runs" / variant
        configs = LOSS_CHECK if args.loss_check else VARIANTS  # a worker's --loss-check: the loss cell
        fit = harness.fit([*COMM_DEBUG, *configs[variant], *args.override, f"trainer.max_steps={args.steps}"],
                          run_dir)
        if fit["rank"] != 0:
            continue
        rows = read_csv(run_dir)
        keys = sorted({k for r in rows for k in r if k.startswith("comm/bytes_per_step/")})
        after = lambda series: [v for s, v in series.items() if s >= args.warmup] or list(series.values())  # noqa: E731
        results[variant] = {
            "step_ms": 1000 * statistics.median(fit["step_s"][args.warmup:] or fit["step_s"]),
            "comm_ms": statistics.median(after(per_step(rows, "comm/ms")) or [float("nan")]),
            "bytes_per_step": {k.rsplit("/", 1)[1]: statistics.median(after(per_step(rows, k))) for k in keys},
            "final_loss": _final_loss(rows, 20),
        }
        harness.write_json(out / "cell.json", results)


def _final_loss(rows: list[dict[str, str]], last: int) -> float | None:
    losses = per_step(rows, "train/loss")
    tail = [losses[s] for s in sorted(losses)[-last:]]
    return statistics.fmean(tail) if tail else None


# ---- driver ---------------------------------------------------------------------------------
def run_cell(name: str, variants: list[str], steps: int, args: argparse.Namespace, out: Path,
             loss: bool = False) -> dict[str, Any]:
    cell_dir = out / name
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", *(["--loss-check"] if loss else []),
           "--variants", ",".join(variants),
           "--steps", str(steps), "--warmup", str(args.warmup), "--out", str(cell_dir),
           *[f"--override={o}" for o in args.override]]
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    cell_dir.mkdir(parents=True, exist_ok=True)
    with open(cell_dir / "worker.log", "w") as log_file:
        proc = subprocess.Popen(cmd, cwd=harness.REPO, env={**env, "PYTHONUNBUFFERED": "1"}, stdout=log_file,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.cell_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = "timeout"
    if rc != 0:
        print(f"comm: cell {name} failed ({rc}); see {cell_dir / 'worker.log'}", file=sys.stderr)
    import json

    path = cell_dir / "cell.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def config_error(variant: str, out: Path) -> str | None:
    """The one-line error a variant gives on this machine (instantiating its strategy), or None."""
    from hydra.utils import instantiate

    from dsdebug.errors import ConfigError

    try:
        instantiate(harness.compose([*COMM_DEBUG, *VARIANTS[variant]], out / "check").strategy)
    except Exception as e:  # noqa: BLE001 - Hydra wraps the ConfigError
        while e is not None and not isinstance(e, ConfigError):
            e = e.__cause__ or e.__context__
        if e is None:
            raise
        return f"error: {e}"
    return None


def table(results: dict[str, Any]) -> str:
    base = results["variants"].get("ddp", {}).get("bytes_per_step", {}).get("all_reduce")
    lines = ["| option | all_reduce MB/step | other collectives MB/step | vs ddp bytes | comm ms/step | step ms |",
             "|---|---|---|---|---|---|"]
    for variant in VARIANTS:
        if variant in results["errors"]:
            lines.append(f"| {variant} | - | - | - | - | {results['errors'][variant]} |")
            continue
        row = results["variants"].get(variant)
        if not row:
            continue
        b = row["bytes_per_step"]
        ar = b.get("all_reduce", 0.0)
        other = ", ".join(f"{k} {v / 1e6:.2f}" if v >= 1e4 else f"{k} {v:.0f} B"
                          for k, v in b.items() if k != "all_reduce" and v)
        total = sum(b.values())
        ratio = f"{total / base:.2f}x" if base else "-"
        lines.append(f"| {variant} | {ar / 1e6:.2f} | {other or '0'} | {ratio} | {row['comm_ms']:.1f} | "
                     f"{row['step_ms']:.0f} |")
    if "loss_check" in results:
        lc = results["loss_check"]
        lines.append("")
        lines.append(f"Loss check ({lc['steps']} steps, mean train/loss of the last 20): ddp {lc['ddp']:.4f}, "
                     f"ddp_powersgd {lc['ddp_powersgd']:.4f}: {100 * lc['rel_diff']:+.2f} % "
                     f"(tolerance {100 * lc['tolerance']:.0f} %: {'pass' if lc['ok'] else 'FAIL'})")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [v for v in VARIANTS if v in results["variants"]]
    rows = [results["variants"][v] for v in names]
    collectives = sorted({k for r in rows for k, v in r["bytes_per_step"].items() if v >= 1e4})  # visible ones
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    bottom = [0.0] * len(names)
    for c in collectives:
        ys = [r["bytes_per_step"].get(c, 0.0) / 1e6 for r in rows]
        ax1.bar(names, ys, bottom=bottom, label=c)
        bottom = [b + y for b, y in zip(bottom, ys)]
    ax1.set_ylabel("MB per step (rank 0)")
    ax1.legend(fontsize=8)
    ax1.set_title("bytes handed to collectives per step, by collective", fontsize=10)
    ax2.bar(names, [r["step_ms"] for r in rows], label="step")
    ax2.bar(names, [r["comm_ms"] for r in rows], label="in collectives")
    ax2.set_ylabel("ms per step")
    ax2.legend(fontsize=8)
    ax2.tick_params(axis="x", rotation=30)
    fig.suptitle("Communication options, 2 CPU ranks (gloo)", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per variant")
    p.add_argument("--warmup", type=int, default=4, help="steps left out of the medians (PowerSGD starts at 2)")
    p.add_argument("--loss-check", action="store_true", help="also 300 steps of ddp vs ddp_powersgd")
    p.add_argument("--loss-steps", type=int, default=300)
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("--out", default=str(harness.REPO / "logs" / "bench" / "comm"))
    p.add_argument("--override", action="append", default=[], help="extra overrides for every fit")
    p.add_argument("--cell-timeout", type=float, default=1200)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        p.exit(2, f"error: --variants: unknown {', '.join(unknown)}; valid: {', '.join(VARIANTS)}\n")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    out = Path(args.out)
    started = time.time()
    results: dict[str, Any] = {"machine": harness.machine_info(), "steps": args.steps, "warmup": args.warmup,
                               "variants": {}, "errors": {}}
    runnable: dict[str, list[str]] = {}
    for variant in args.variants.split(","):
        error = config_error(variant, out)
        if error:
            results["errors"][variant] = error
        else:
            runnable.setdefault(cell_of(variant), []).append(variant)
    for cell, variants in runnable.items():
        print(f"comm: cell {cell}: {', '.join(variants)} ...", flush=True)
        results["variants"].update(run_cell(cell, variants, args.steps, args, out))
    if args.loss_check:
        print(f"comm: loss check, {args.loss_steps} steps of ddp and ddp_powersgd ...", flush=True)
        losses = run_cell("loss_check", list(LOSS_CHECK), args.loss_steps, args, out, loss=True)
        ddp, psgd = losses["ddp"]["final_loss"], losses["ddp_powersgd"]["final_loss"]
        rel = (psgd - ddp) / ddp
        results["loss_check"] = {"steps": args.loss_steps, "ddp": ddp, "ddp_powersgd": psgd, "rel_diff": rel,
                                 "tolerance": args.tolerance, "ok": abs(rel) <= args.tolerance}
    results["wall_s"] = time.time() - started
    harness.write_json(out / "results.json", results)
    md = table(results)
    (out / "comm.md").write_text(md)
    plot(results, out / "comm.png")
    print(md)
    print(f"comm: results in {out}/results.json, table comm.md, plot comm.png ({results['wall_s']:.0f} s)")
    return 0 if results.get("loss_check", {}).get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
