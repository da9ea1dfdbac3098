"""Tables, residual explanations and the plot of ``zero_memory.py`` (split from it)."""

from __future__ import annotations

from pathlib import Path

from dsdebug.models.model_states import DTYPES, STRATEGIES  # noqa: E402

CATEGORIES = ("params", "grads", "master", "adam", "buffers", "unreached")

# ---------------------------------------------------------------------------------------------

def _mib(x: float) -> str:
    return f"{x / 2**20:.1f}"


# Why a DeepSpeed structure makes the measurement differ from the paper (matched on the path).
WHY = {
    "averaged_gradients": "the stage-1/2 gradient partition is sized to the whole params that intersect "
                          "the rank's partition: a param straddling the boundary is held whole on both ranks",
    "[].grad": "fp32 gradients of the master partition (the paper counts the gradient once, "
                      "in the params' dtype)",
    "single_partition_of_fp32_groups": "fp32 master partition, kept even when the params are fp32 "
                                       "(the fp32 formula has no master copy)",
    "fp32_partitioned_groups_flat": "fp32 master partition, kept even when the params are fp32 "
                                    "(the fp32 formula has no master copy)",
    "grad_partitions_flat_buffer": "gradient partition in the params' dtype",
    "param_buffer_of_bit16_for_cpu_offload": "staging copy of the param partition (host -> device after the CPU step)",
    "temp_grad_buffer": "grad staging buffer the size of the largest param",
    "ipg_buckets": "reduce bucket (reduce_bucket_size elements)",
}


def residual(r: dict) -> dict:
    """measured - formula per paper term, bytes (other = buffers + unreached, which the paper omits)."""
    c, f = r["measured"]["categories"], r["formula"]
    return {"params": c["params"] - f["params"], "grads": c["grads"] - f["grads"],
            "optimizer": c["master"] + c["adam"] - f["optimizer"], "other": c["buffers"] + c["unreached"]}


def _explain(r: dict) -> str | None:
    f_total = r["formula"]["total"]
    parts = []
    for term, excess in residual(r).items():
        if abs(excess) < 0.005 * f_total:
            continue
        cats = {"params": ("params",), "grads": ("grads",), "optimizer": ("master", "adam"),
                "other": ("buffers", "unreached")}[term]
        why = []
        for label, nbytes in r["measured"]["structures"].items():
            cat, path = label.split(": ", 1)
            reason = next((text for key, text in WHY.items() if key in path), None)
            if cat in cats and reason and nbytes >= 0.005 * f_total:
                why.append(f"`{path}` {_mib(nbytes)} MiB: {reason}")
        if term == "grads" and excess < 0 and STRATEGIES[r["strategy"]]["stage"] == 1:
            why.insert(0, "DeepSpeed's ZeRO-1 has already reduced the gradients into a partition (see notes)")
        if term == "other" and r["measured"]["categories"]["unreached"] >= 0.005 * f_total:
            why.append(f"unreached {_mib(r['measured']['categories']['unreached'])} MiB")
        parts.append(f"{term} {excess / 2**20:+.1f} MiB" + (f" ({'; '.join(why)})" if why else ""))
    if not parts:
        return None
    return f"- {r['size']} N={r['ranks']} {r['strategy']} ({r['measured']['total'] / f_total:.3f}x): " + "; ".join(parts)


NOTES = """Notes (what the table shows, and why it differs from the paper):
- Measured = bytes of live tensor storages per rank (gc walk + a walk of the DeepSpeed engine, deduplicated by
  storage, minus a baseline taken before the model was built), after the backward of step {last} and before its
  optimizer step. Category = the role of the structure holding the storage. "unreached" = live storages the
  engine walk cannot reach (temporaries, leftovers of an earlier strategy in the same process).
- `autograd end` = the same snapshot taken when autograd finishes, just before DeepSpeed reduces the gradients
  (`engine.allreduce_gradients`); `peak/formula` uses the larger of the two snapshots.
- ZeRO-1 in DeepSpeed {ds}: the full bf16 gradients exist only until the end of `engine.backward`, which
  reduces them into a gradient partition and frees them. Before the step ZeRO-1 therefore holds what the
  paper's ZeRO-2 holds (same bytes as zero2); at the end of autograd it holds the paper's ZeRO-1 (see
  `grads@autograd end`). With gradient accumulation the full gradients live across micro-batches.
- At the end of autograd ZeRO-2/3 still hold the gradient of the last param not yet reduced (here the
  largest one, the embedding, which is reduced on its own because it exceeds the bucket) and ZeRO-3 still
  holds that param gathered. ZeRO-3's other gathered params during forward/backward (its working set) and
  activations are transient and not model states; they are not measured.
- ddp = DeepSpeed stage 0 with bf16 (FP16_UnfusedOptimizer: bf16 params and grads, fp32 master copy, Adam):
  exactly 16 bytes/param. torch DDP with autocast would hold fp32 params/grads instead (4+4+8, same total).
- ZeRO-3 runs with `stage3_param_persistence_threshold: 0` so every param is partitioned; DeepSpeed's default
  (1e5 elements) keeps small params whole on every rank, which for these models is most params.
- Bucket sizes are `hidden_size**2` elements (the framework's "auto" rule). ZeRO-3's reduce bucket is allocated
  at full size up front: DeepSpeed's default 5e8 elements would add 1 GB (bf16) per rank to `buffers`.
- Offload (the box has no accelerator, so everything is RAM): "offloaded" = bytes in the structures DeepSpeed
  places on the offload device (fp32 master and grads, Adam moments, bf16 staging copies, and with
  `offload_param` the bf16 param partition); the formula column splits the paper's total the ZeRO-Offload way
  (optimizer states and gradient partition on the host, and the params with param offload). DeepSpeed keeps
  the host gradients in fp32 (4 bytes/param instead of 2) plus bf16 staging copies, hence ~1.25x.
"""


def markdown(records: list[dict], meta: dict) -> str:
    lines = [
        f"# ZeRO model-state memory per rank ({meta['dtype']}, measured vs Rajbhandari et al. 2020)",
        "",
        f"{meta['date']}, {meta['machine']}; torch {meta['torch']}, deepspeed {meta['deepspeed']}; "
        f"{meta['steps']} optimizer steps, measured in the step after; wall time {meta['wall_s']:.0f} s.",
        f"MiB per rank (the rank with the most). formula: the paper's, K={DTYPES[meta['dtype']][2]}; "
        "master+adam is its K*Psi term. ddp = DeepSpeed ZeRO stage 0.",
        "",
        "| size | Psi | N | strategy | params | grads | master+adam | other | before step | autograd end "
        "| formula | before/formula | peak/formula | grads@autograd end | accelerator / offloaded (formula) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        c, f, end = r["measured"]["categories"], r["formula"], r["end_of_backward"]
        peak = max(r["measured"]["total"], end["total"])
        m = r["measured"]
        offl = (f"{_mib(m['accelerator'])} / {_mib(m['offloaded'])} ({_mib(f['accelerator'])} / {_mib(f['offloaded'])})"
                if STRATEGIES[r["strategy"]].get("offload_optimizer") else "-")
        lines.append(
            f"| {r['size']} | {r['psi'] / 1e6:.1f}M | {r['ranks']} | {r['strategy']} | {_mib(c['params'])} "
            f"| {_mib(c['grads'])} | {_mib(c['master'] + c['adam'])} | {_mib(c['buffers'] + c['unreached'])} "
            f"| {_mib(r['measured']['total'])} | {_mib(end['total'])} | {_mib(f['total'])} "
            f"| {r['measured']['total'] / f['total']:.3f} | {peak / f['total']:.3f} "
            f"| {_mib(end['categories']['grads'])} | {offl} |")
    explained = [line for line in map(_explain, records) if line]
    if explained:
        lines += ["", "Residuals (before step, measured - formula, > 0.5% of the formula):", "", *explained]
    lines += ["", NOTES.format(last=meta["steps"] + 1, ds=meta["deepspeed"])]
    if meta["dtype"] == "fp32":
        lines.append("- fp32: the formula is 4+4+8 bytes/param (no master copy). ZeRO-1/2/3 still keep a separate "
                     "fp32 master partition (+4 bytes/param/N); stage 0 updates the params in place.")
    return "\n".join(lines) + "\n"


def plot(records: list[dict], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    sizes = list(dict.fromkeys(r["size"] for r in records))
    fig = Figure(figsize=(6.5 * len(sizes), 4.2), dpi=100)
    FigureCanvasAgg(fig)
    colors = dict(zip(CATEGORIES, ("#4c72b0", "#dd8452", "#55a868", "#8c8c8c", "#c44e52", "#e0e0e0")))
    for i, size in enumerate(sizes):
        ax = fig.add_subplot(1, len(sizes), i + 1)
        rows = [r for r in records if r["size"] == size]
        strategies = list(dict.fromkeys(r["strategy"] for r in rows))
        ranks = list(dict.fromkeys(r["ranks"] for r in rows))
        width = 0.8 / len(strategies)
        for g, n in enumerate(ranks):
            for s, strategy in enumerate(strategies):
                r = next((r for r in rows if r["ranks"] == n and r["strategy"] == strategy), None)
                if r is None:
                    continue
                x, bottom = g + (s - (len(strategies) - 1) / 2) * width, 0.0
                for cat in CATEGORIES:
                    v = max(r["measured"]["categories"][cat], 0) / 2**20
                    ax.bar(x, v, width * 0.9, bottom=bottom, color=colors[cat],
                           label=cat if (g, s) == (0, 0) else None)
                    bottom += v
                ax.plot([x - width * 0.45, x + width * 0.45], [r["formula"]["total"] / 2**20] * 2, color="black", lw=2,
                        label="paper formula" if (g, s) == (0, 0) else None)
                ax.plot(x, r["end_of_backward"]["total"] / 2**20, "o", color="black", ms=3,
                        label="total at autograd end" if (g, s) == (0, 0) else None)
                top = max(bottom, r["formula"]["total"] / 2**20, r["end_of_backward"]["total"] / 2**20)
                ax.text(x, top * 1.02, strategy, rotation=90, ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(ranks)), [f"N={n} rank(s)" for n in ranks])
        ax.set_ylabel("model-state MiB per rank")
        ax.set_title(f"{size} ({rows[0]['psi'] / 1e6:.1f}M params)")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.25)
        if i == 0:
            fig.legend(fontsize=8, loc="lower center", ncol=len(CATEGORIES) + 2, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path)
