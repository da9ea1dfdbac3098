"""Tables and the plot of ``overhead.py`` (split from it; the numbers come from ``overhead.summarize``).

Targets (``TARGETS``): judged on the default-run figures (wall time: A/B and direct) as before, and
on the CPU A/B steady overhead (user+sys of every rank over the same window), the figure
that a shared, noisy machine moves least.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from overhead_cells import CALLBACKS, PRESETS, TARGETS


def pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def _pct(x: float | None) -> str:
    return "-" if x is None else pct(x)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def table(results: dict[str, Any]) -> str:
    lines = []
    for cell, data in results["cells"].items():
        rows = data["summary"]
        lines += [f"### {cell.replace(':', ', ')} rank(s) ({data['rounds']} rounds, windows after {data['warmup']} "
                  f"warm-up steps, {data['wall_s']:.0f} s)", "",
                  "| variant | window | step (ms) | A/B steady (median) | A/B min..max | CPU ms/step (all ranks) | "
                  "CPU A/B steady (median) | CPU A/B min..max | direct (hooks) | one-off (s) | "
                  "default run, A/B | default run, direct | target |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for variant, row in rows.items():
            target = TARGETS.get(variant)
            verdict = ""
            if target is not None:
                verdict = f"<= {100 * target:.0f}%: " + ", ".join(
                    f"{what} {'met' if row[key] <= target else '**over**'}"
                    for what, key in (("A/B", "default_run"), ("direct", "default_run_direct")))
                if row.get("cpu_steady") is not None:
                    verdict += f", CPU A/B steady {'met' if row['cpu_steady'] <= target else '**over**'}"
            leak = " (leaked: " + ", ".join(row["leaked"]) + ")" if row["leaked"] else ""
            lines.append(f"| {variant}{leak} | {row['window']} | {row['step_ms']:.0f} | {pct(row['steady'])} | "
                         f"{pct(row['steady_min'])}..{pct(row['steady_max'])} | {_ms(row.get('cpu_step_ms'))} | "
                         f"{_pct(row.get('cpu_steady'))} | {_pct(row.get('cpu_steady_min'))}..{_pct(row.get('cpu_steady_max'))} | "
                         f"{pct(row['direct'])} | "
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
