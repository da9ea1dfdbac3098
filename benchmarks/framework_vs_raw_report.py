"""The pure half of ``framework_vs_raw.py`` (split from it): reading history.jsonl, the summary math,
and results.md (wall-time table as in earlier runs, the loss check, and wall + CPU time per side;
CPU = user+sys of every rank over the same steps as the wall time)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from supervise import BenchError

TARGET = 0.03
LOG_EVERY = 10  # trainer.log_every_n_steps default: framework stamps exist every 10 steps


def parse_history(path: Path) -> tuple[dict[int, float], dict[int, float]]:
    """history.jsonl -> (stamps, losses), both keyed by optimizer steps completed (1-based).

    The row carrying ``train/loss`` with history step ``s`` is written after optimizer step
    ``s + 1``; the first such row of a step counts (the LR monitor's row of the same step is
    written at the batch's start, one step earlier, and is skipped)."""
    stamps: dict[int, float] = {}
    losses: dict[int, float] = {}
    for line in Path(path).read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line of a killed run
        if not isinstance(row, dict) or "train/loss" not in row or row.get("step") is None:
            continue
        done = int(row["step"]) + 1
        if done not in stamps:
            stamps[done] = float(row["time"])
            losses[done] = float(row["train/loss"])
    return stamps, losses


def mean_step_ms(stamps: dict[int, float], warmup: int, steps: int) -> float:
    """Mean step time over steps (warmup, warmup + steps], in ms."""
    end = warmup + steps
    missing = [s for s in (warmup, end) if s not in stamps]
    if missing:
        raise BenchError(f"no time stamp after step(s) {missing}; stamps cover {sorted(stamps)[:3]}..")
    return (stamps[end] - stamps[warmup]) / steps * 1000.0


def block_ms(stamps: dict[int, float], warmup: int, steps: int, block: int = LOG_EVERY) -> list[float]:
    """Mean step time of each consecutive ``block``-step block in (warmup, warmup + steps], in ms.
    The fastest block is a noise check: on a shared machine it is the least disturbed stretch."""
    return [(stamps[s + block] - stamps[s]) / block * 1000.0 for s in range(warmup, warmup + steps, block)
            if s in stamps and s + block in stamps]


def round_order(r: int, sides: tuple[str, ...] | list[str] = ("raw", "framework")) -> list[str]:
    """Round r runs the sides in list order rotated by r (two sides: they alternate)."""
    k = r % len(sides)
    return [*sides[k:], *sides[:k]]


def side_summary(rounds: list[dict[str, Any]], side: str) -> dict[str, Any]:
    """Wall and CPU ratios of one framework side to the raw loop of the same round, medians over rounds.
    CPU is the sum of every rank's user+sys over the same step window as wall time."""
    wall = [r["sides"][side]["ms"] / r["sides"]["raw"]["ms"] - 1.0 for r in rounds]
    cpu = [r["sides"][side]["cpu_ms"] / r["sides"]["raw"]["cpu_ms"] - 1.0 for r in rounds]
    med = statistics.median
    return {"wall_ms": med(r["sides"][side]["ms"] for r in rounds), "wall_overheads": wall,
            "wall_overhead": med(wall), "cpu_ms": med(r["sides"][side]["cpu_ms"] for r in rounds),
            "cpu_overheads": cpu, "cpu_overhead": med(cpu),
            "minflt_per_step": med(r["sides"][side].get("minflt_per_step", 0) for r in rounds),
            "sys_ms": med(r["sides"][side].get("sys_ms", 0.0) for r in rounds)}


def summarize(rounds: list[dict[str, float]], target: float = TARGET) -> dict[str, Any]:
    """Per-round overhead = framework / raw - 1; the median over rounds is the result."""
    overheads = [r["framework_ms"] / r["raw_ms"] - 1.0 for r in rounds]
    median = statistics.median(overheads)
    best = [min(r["framework_blocks_ms"]) / min(r["raw_blocks_ms"]) - 1.0 for r in rounds
            if r.get("framework_blocks_ms") and r.get("raw_blocks_ms")]
    return {"overheads": overheads, "overhead": median, "target_met": median <= target,
            "overhead_fastest_blocks": statistics.median(best) if best else None,
            "raw_ms": statistics.median(r["raw_ms"] for r in rounds),
            "framework_ms": statistics.median(r["framework_ms"] for r in rounds)}


def results_md(report: dict[str, Any]) -> str:
    m, w, n = report["machine"], report["warmup"], report["steps"]
    pct = lambda x: "-" if x is None else f"{x:+.1%}"  # noqa: E731
    lines = [f"# Framework vs hand-written DeepSpeed loop ({m['date']})", "",
             f"{m['cpu']}, {m['cores']} cores, git {m['git']}; mean step time over steps ({w}, {w + n}], "
             f"ZeRO-2, fp32; wall time {report['wall_s']:.0f} s.", "",
             "| ranks | raw ms/step | framework ms/step | overhead (median) | per round: raw / framework ms, overhead "
             f"| fastest 10-step blocks (noise check) | target <= {report['target']:.0%} met? |",
             "|---|---|---|---|---|---|---|"]
    for res in report["results"]:
        per_round = "; ".join(f"r{r['round']} ({r['order'][0]} first): {r['raw_ms']:.1f} / {r['framework_ms']:.1f}, "
                              f"{o:+.1%}" for r, o in zip(res["rounds"], res["overheads"]))
        lines.append(f"| {res['ranks']} | {res['raw_ms']:.1f} | {res['framework_ms']:.1f} | {pct(res['overhead'])} "
                     f"| {per_round} | {pct(res.get('overhead_fastest_blocks'))} "
                     f"| {'yes' if res['target_met'] else 'no'} |")
    lines += ["", f"Loss (rank 0's CE) at steps {w} / {w + n}, round 0, and the largest difference over all rounds:",
              "", "| ranks | raw | framework | max abs difference |", "|---|---|---|---|"]
    for res in report["results"]:
        loss = res["rounds"][0]["loss"]
        fmt = lambda d: " / ".join(f"{v:.6f}" if v is not None else "-" for v in d.values())  # noqa: E731
        diffs = [abs(r["loss"]["raw"][s] - r["loss"]["framework"][s]) for r in res["rounds"] for s in r["loss"]["raw"]
                 if r["loss"]["raw"][s] is not None and r["loss"]["framework"].get(s) is not None]
        lines.append(f"| {res['ranks']} | {fmt(loss['raw'])} | {fmt(loss['framework'])} "
                     f"| {max(diffs):.2g} |" if diffs else f"| {res['ranks']} | {fmt(loss['raw'])} | "
                     f"{fmt(loss['framework'])} | - |")
    lines += ["", "Wall and CPU time per step (CPU: user+sys of every rank over the same window, summed; median of "
              "the rounds; overhead = side / raw loop of the same round - 1; sys ms and minor page faults per step, "
              f"every rank summed; the raw loop's host allocator: {report.get('raw_malloc', 'default')}):", "",
              "| ranks | side | wall ms/step | CPU ms/step | sys ms/step | page faults/step | wall overhead "
              "| CPU overhead | per round wall / CPU |",
              "|---|---|---|---|---|---|---|---|---|"]
    for res in report["results"]:
        if not res.get("variants"):
            continue
        raw = side_summary(res["rounds"], "raw")
        lines.append(f"| {res['ranks']} | raw | {res['raw_ms']:.1f} | {raw['cpu_ms']:.1f} | {raw['sys_ms']:.1f} "
                     f"| {raw['minflt_per_step']:.0f} | | | |")
        for v, vs in res["variants"].items():
            per = ", ".join(f"{w:+.1%} / {c:+.1%}" for w, c in zip(vs["wall_overheads"], vs["cpu_overheads"]))
            lines.append(f"| {res['ranks']} | {v} | {vs['wall_ms']:.1f} | {vs['cpu_ms']:.1f} | {vs['sys_ms']:.1f} "
                         f"| {vs['minflt_per_step']:.0f} | {pct(vs['wall_overhead'])} "
                         f"| {pct(vs['cpu_overhead'])} | {per} |")
    return "\n".join(lines) + "\n"
