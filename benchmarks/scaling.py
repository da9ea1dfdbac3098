"""Throughput and MFU: tokens/s at 1 vs 2 ranks, and model FLOPs utilisation.

    python benchmarks/scaling.py                 # reads logs/bench/overhead/overhead.json
    python benchmarks/scaling.py --big-steps 0   # skip the ~100M-parameter measurement

* tokens/s at 1 and 2 ranks come from the ``debug=none`` fits of overhead.py (same model,
  data, stage; steady window, median over rounds), so this script adds no training of the
  default model.
* MFU = tokens/s x training FLOPs per token / peak FLOP/s. FLOPs per token = 6 x active
  non-embedding parameters (a MoE token runs top-k routed + shared experts, not all experts)
  + 6 x seq x heads x (qk_dim + v_dim) per layer for attention (PaLM's convention, causal mask
  not discounted). On CPU the peak is *measured*: fp32 ``torch.mm`` on all cores; on a GPU it
  is the spec sheet's dense bf16 number (``--peak-tflops``).
* ``--big-steps N`` also fits the ~100M config (conf/model/deepseek_v3_100m.yaml) for N timed
  steps at 1 rank, ZeRO-2, in this process.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

# FLOPs/token and the measured CPU peak live in src (the throughput check computes MFU with them).
from dsdebug.models.flops import active_params, flops_per_token, measure_peak_flops  # noqa: E402, F401


def build_net(overrides: list[str]) -> tuple[Any, Any]:
    import hydra
    import torch

    cfg = harness.compose(overrides, harness.REPO / "logs" / "bench" / "scaling" / "compose")
    with torch.device("meta"):
        net = hydra.utils.instantiate(cfg.model.net)
    return net, cfg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--overhead", default=str(harness.REPO / "logs" / "bench" / "overhead" / "overhead.json"),
                   help="overhead.py's results (its debug=none fits give tokens/s)")
    p.add_argument("--big-steps", type=int, default=4, help="timed steps of the ~100M config (0 = skip)")
    p.add_argument("--big-warmup", type=int, default=2)
    p.add_argument("--big-batch", type=int, default=2, help="per-rank batch of the ~100M fit")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak FLOP/s in TFLOP/s (default: measured)")
    p.add_argument("--out", default=str(harness.REPO / "logs" / "bench" / "scaling"))
    args = p.parse_args(argv)
    if args.big_steps < 0 or args.big_warmup < 0:
        p.exit(2, "error: --big-steps/--big-warmup must be ints >= 0\n")
    overhead_path = Path(args.overhead)
    if not overhead_path.is_file():
        p.exit(2, f"error: {overhead_path} not found; run benchmarks/overhead.py first (or pass --overhead FILE)\n")
    import json

    try:
        overhead = json.loads(overhead_path.read_text())
        cells = overhead["cells"]
    except (ValueError, KeyError, TypeError):
        p.exit(2, f"error: {overhead_path} is not overhead.py's overhead.json (no 'cells')\n")

    out = Path(args.out)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else measure_peak_flops()
    tiny, tiny_cfg = build_net([])
    seq = int(tiny_cfg.data.seq_len)
    results: dict[str, Any] = {"machine": harness.machine_info(), "peak_flops": peak,
                               "peak_source": "given" if args.peak_tflops else "measured fp32 torch.mm, all cores",
                               "models": {}, "rows": []}
    for name, net in (("deepseek_v3_tiny", tiny),):
        total, active = active_params(net)
        results["models"][name] = {"params_non_embedding": total, "active": active,
                                   "flops_per_token": flops_per_token(net, seq)}
    fpt = results["models"]["deepseek_v3_tiny"]["flops_per_token"]
    for cell, data in cells.items():
        row = data["summary"].get("none")
        if row is None:
            continue
        stage, ranks = cell.split(":")
        results["rows"].append({"model": "deepseek_v3_tiny", "stage": stage, "ranks": int(ranks),
                                "tokens_per_s": row["tokens_per_s"], "step_ms": row["step_ms"],
                                "mfu": row["tokens_per_s"] * fpt / peak})

    if args.big_steps:
        # batch 2 x 128 tokens: a step of 8 x 128 takes ~15 s on 2 CPU cores
        overrides = ["model=deepseek_v3_100m", "strategy=zero2", "trainer=cpu", "debug=none",
                     f"data.batch_size={args.big_batch}",
                     f"trainer.max_steps={args.big_warmup + args.big_steps}"]
        big, big_cfg = build_net(overrides)
        total, active = active_params(big)
        fpt_big = flops_per_token(big, int(big_cfg.data.seq_len))
        results["models"]["deepseek_v3_100m"] = {"params_non_embedding": total, "active": active,
                                                 "flops_per_token": fpt_big}
        del big
        fit = harness.fit(overrides, out / "runs" / "big")
        steps = fit["step_s"][args.big_warmup:]
        step = statistics.median(steps)
        tps = fit["tokens_per_step"] / step
        results["rows"].append({"model": "deepseek_v3_100m", "stage": "zero2", "ranks": 1, "tokens_per_s": tps,
                                "batch": args.big_batch,
                                "step_ms": 1000 * step, "mfu": tps * fpt_big / peak})

    by = {(r["model"], r["stage"], r["ranks"]): r for r in results["rows"]}
    lines = [f"Peak: {peak / 1e9:.1f} GFLOP/s ({results['peak_source']}).", "",
             "| model | params (non-emb.) | active/token | FLOPs/token |", "|---|---:|---:|---:|"]
    for name, m in results["models"].items():
        lines.append(f"| {name} | {m['params_non_embedding'] / 1e6:.1f}M | {m['active'] / 1e6:.1f}M | "
                     f"{m['flops_per_token'] / 1e6:.0f}M |")
    lines += ["", "| model | stage | ranks | step (ms) | tokens/s | vs 1 rank | MFU |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in results["rows"]:
        one = by.get((r["model"], r["stage"], 1))
        rel = f"{r['tokens_per_s'] / one['tokens_per_s']:.2f}x" if one and r["ranks"] != 1 else ""
        lines.append(f"| {r['model']} | {r['stage']} | {r['ranks']} | {r['step_ms']:.0f} | {r['tokens_per_s']:.0f} | "
                     f"{rel} | {100 * r['mfu']:.1f}% |")
    md = "\n".join(lines) + "\n"
    harness.write_json(out / "scaling.json", results)
    (out / "scaling.md").write_text(md)
    print(md)
    print(f"scaling: results in {out}/scaling.json, table scaling.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
