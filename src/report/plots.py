"""The report's figures: each reads a ``RunData`` and returns PNG bytes, or None when the run did
not record what the figure needs (the report then says what records it, or why this run did not).

Figures are built on ``matplotlib.figure.Figure`` with the Agg canvas directly: no pyplot, no
global backend switch, no display needed, safe to call inside a training process.

| figure | history keys | recorded by |
|---|---|---|
| ``loss`` | ``train/loss``, ``val/loss``, ``lr-*`` (twin axis) | always |
| ``grad_norms`` | ``grad/norm/<layer>`` (heatmap layer x step) | ``debug=grads`` |
| ``rank_step_time`` | ``ranks/step_time_{min,mean,max}`` (band) | ``debug=logs`` |
| ``rank_memory`` | ``ranks/mem_mb_{min,mean,max}`` (band) | ``debug=logs`` |
| ``moe_load`` | ``moe/load_imbalance``; heatmap of ``moe/load/L<layer>/E<expert>`` keys if present | MoE models (``model.moe_metrics``) |
| ``moe_router`` | heatmap layer x expert of the run's token share (``moe_router/router_summary`` finding) + ``moe_router/load_entropy/L<i>`` (``plots_moe.py``) | ``+callbacks=moe_router`` |
| ``comm_compute`` | stacked: ``ranks/{comm,compute}_time_mean``, else ``comm/share``, else ``time/<phase>_ms``, else ``deepspeed/<phase>_ms`` |
|   | (first found) | ``debug=logs`` / ``comm`` / ``profile`` / a ds_config's ``wall_clock_breakdown`` |
"""

from __future__ import annotations

import math
from collections.abc import Callable

from dsdebug.report.figure import figure, finite, natural, png
from dsdebug.report.load import RunData
from dsdebug.report.plots_moe import router_share

__all__ = ["FIGURES", "bars", "comm_compute", "grad_norms", "how_to_enable", "loss", "loss_key", "loss_overlay",
           "moe_load", "moe_missing", "rank_memory", "rank_step_time"]

_PHASES = ("data", "forward", "backward", "optimizer")
_GRAD_SKIP = {"grad/norm/global"}


def loss_key(run: RunData, split: str) -> str:
    """``<split>/loss``, else a plain project's own name for it (``train_loss``, ``train/loss_step``, ...)."""
    key = f"{split}/loss"
    if key in run.history:
        return key
    names = sorted(k for k in run.history if k.startswith(split) and "loss" in k)
    return min(names, key=len) if names else key


def loss(run: RunData) -> bytes | None:
    train_key, val_key = loss_key(run, "train"), loss_key(run, "val")
    train, val = finite(*run.series(train_key)), finite(*run.series(val_key))
    if not train[0] and not val[0]:
        return None
    fig = figure()
    ax = fig.add_subplot(111)
    if train[0]:  # a short run logs a few points: markers, or a single point draws nothing
        ax.plot(*train, label=train_key, color="tab:blue", lw=1.2, marker="o" if len(train[0]) < 12 else None, ms=3)
    if val[0]:
        ax.plot(*val, label=val_key, color="tab:orange", marker="o", ms=3, lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    lines, labels = ax.get_legend_handles_labels()
    lr_keys = [k for k in run.keys("lr") if run.history[k]]
    if lr_keys:
        ax2 = ax.twinx()
        for key in lr_keys[:3]:
            ax2.plot(*run.series(key), ls="--", lw=0.9, label=key)
        ax2.set_ylabel("learning rate")
        more_lines, more_labels = ax2.get_legend_handles_labels()
        lines, labels = lines + more_lines, labels + more_labels
    ax.legend(lines, labels, fontsize=7, loc="upper right")
    ax.set_title("loss and learning rate")
    return png(fig)


def _heatmap(run: RunData, keys: list[str], title: str, label: str, log_scale: bool) -> bytes | None:
    steps = sorted({s for k in keys for s, _ in run.history[k]})
    if not steps:
        return None
    col = {s: i for i, s in enumerate(steps)}
    import numpy as np

    grid = np.full((len(keys), len(steps)), np.nan)
    for row, key in enumerate(keys):
        for s, v in run.history[key]:
            if math.isfinite(v):
                grid[row, col[s]] = math.log10(v) if log_scale and v > 0 else (v if not log_scale else np.nan)
    fig = figure(7.5, max(2.4, 0.9 + 0.22 * len(keys)))
    ax = fig.add_subplot(111)
    image = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", interpolation="nearest", cmap="viridis")
    ax.set_yticks(range(len(keys)))
    ax.set_yticklabels([k.split("/", 2)[-1] for k in keys], fontsize=6)
    ticks = list(range(0, len(steps), max(1, len(steps) // 8)))
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(steps[i]) for i in ticks], fontsize=7)
    ax.set_xlabel("step")
    fig.colorbar(image, ax=ax, label=label)
    ax.set_title(title)
    return png(fig)


def grad_norms(run: RunData) -> bytes | None:
    keys = [k for k in run.keys("grad/norm/") if k not in _GRAD_SKIP and run.history[k]]
    if not keys:
        return None
    return _heatmap(run, keys, "gradient norm per layer", "log10 L2 norm", log_scale=True)


def _band(run: RunData, stat: str, title: str, unit: str) -> bytes | None:
    series = {part: finite(*run.series(f"ranks/{stat}_{part}")) for part in ("min", "mean", "max")}
    if not series["mean"][0]:
        return None
    fig = figure()
    ax = fig.add_subplot(111)
    lo, hi = series["min"], series["max"]
    steps, mid = series["mean"]
    if len(steps) < 3 and lo[0] == steps and hi[0] == steps:  # too few points for a band: error bars
        ax.errorbar(steps, mid, yerr=[[m - v for m, v in zip(mid, lo[1])], [v - m for m, v in zip(mid, hi[1])]],
                    fmt="o", color="tab:blue", capsize=5, label="mean, min..max over ranks")
    else:
        if lo[0] and hi[0] and lo[0] == hi[0]:
            ax.fill_between(lo[0], lo[1], hi[1], alpha=0.3, color="tab:blue", label="min..max over ranks")
        ax.plot(steps, mid, color="tab:blue", marker="o" if len(steps) < 12 else None, ms=3, label="mean over ranks")
    slow = finite(*run.series(f"ranks/{stat}_max_rank"))
    if slow[1]:
        ax.set_title(f"{title} (max held most often by rank {max(set(slow[1]), key=slow[1].count):.0f})")
    else:
        ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(unit)
    ax.legend(fontsize=7)
    return png(fig)


def rank_step_time(run: RunData) -> bytes | None:
    return _band(run, "step_time", "step time per rank", "s")


def rank_memory(run: RunData) -> bytes | None:
    return _band(run, "mem_mb", "memory per rank", "MB")


def moe_load(run: RunData) -> bytes | None:
    per_expert = sorted((k for k in run.keys("moe/") if k != "moe/load_imbalance" and "load" in k and run.history[k]),
                        key=natural)
    if len(per_expert) > 1:
        return _heatmap(run, per_expert, "MoE expert load", "share of tokens", log_scale=False)
    steps, values = finite(*run.series("moe/load_imbalance"))
    if not steps:
        return None
    fig = figure()
    ax = fig.add_subplot(111)
    ax.plot(steps, values, color="tab:purple", label="moe/load_imbalance")
    ax.axhline(1.0, color="grey", ls=":", lw=0.8, label="balanced")
    ax.set_xlabel("step")
    ax.set_ylabel("busiest expert share x E")
    ax.set_title("MoE expert load imbalance")
    ax.legend(fontsize=7)
    return png(fig)


def _stack(steps: list[int], layers: dict[str, list[float]], title: str, unit: str) -> bytes:
    fig = figure()
    ax = fig.add_subplot(111)
    if len(steps) <= 12:  # a few logged steps: stacked bars (a stackplot of one step is invisible)
        bottom = [0.0] * len(steps)
        for label, values in layers.items():
            ax.bar(steps, values, bottom=bottom, label=label, alpha=0.8)
            bottom = [b + v for b, v in zip(bottom, values)]
    else:
        ax.stackplot(steps, *layers.values(), labels=list(layers), alpha=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel(unit)
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper right")
    return png(fig)


def _aligned(run: RunData, keys: list[str]) -> tuple[list[int], list[list[float]]]:
    """Steps where every key has a finite value, and the values per key."""
    maps = [{s: v for s, v in zip(*finite(*run.series(k)))} for k in keys]
    steps = sorted(set.intersection(*(set(m) for m in maps))) if maps else []
    return steps, [[m[s] for s in steps] for m in maps]


def comm_compute(run: RunData) -> bytes | None:
    steps, (comm, compute) = _aligned(run, ["ranks/comm_time_mean", "ranks/compute_time_mean"])
    if steps:
        return _stack(steps, {"collectives": comm, "compute": compute}, "comm vs compute (mean over ranks)", "s")
    steps, values = _aligned(run, ["comm/share"])
    if steps:
        share = [min(max(v, 0.0), 1.0) for v in values[0]]
        return _stack(steps, {"collectives": share, "rest of the step": [1 - v for v in share]},
                      "comm share of the step (rank 0)", "share")
    phases = [p for p in _PHASES if run.history.get(f"time/{p}_ms")]
    steps, values = _aligned(run, [f"time/{p}_ms" for p in phases])
    if phases and steps:
        return _stack(steps, dict(zip(phases, values)), "step time by phase (profiler)", "ms")
    # a ds_config with wall_clock_breakdown: DeepSpeed's own timers (src/callbacks/ds_wall_clock.py)
    names = {"fwd": "forward", "bwd_inner": "backward (local)", "bwd_allreduce": "gradient reduction",
             "step": "optimizer step"}
    steps, values = _aligned(run, [f"deepspeed/{p}_ms" for p in names])
    if steps:
        return _stack(steps, dict(zip(names.values(), values)), "step time by phase (DeepSpeed timers, rank 0)", "ms")
    return None


def moe_missing(run: RunData) -> str:
    """Why a run has no MoE figure, from what metrics.json says about its model (``moe``)."""
    moe = run.metrics.get("moe")
    if _no_routers(run):
        return "the model has no MoE router (MoERouter's no_routers finding)"
    if run.plain and not isinstance(moe, dict):
        return ("moe/* is logged by dsdebug's own LM module; for a plain project's MoE model add MoERouter() to the "
                "Trainer's callbacks (its figure is below)")
    if not isinstance(moe, dict):
        return ("moe/* is logged when the model has MoE routers (model.moe_metrics=true, the default); "
                "this run logged none and left no metrics.json saying whether its model has routers")
    layers = moe.get("layers") or []
    if not layers and moe.get("aux_source") is None:
        return "the model is dense: no MoE routers found (modules with top_k, num_experts and an [experts, hidden] weight)"
    if not layers:
        return ("the model computes its own aux loss (train/aux_loss), but no router module was recognised "
                "(top_k, num_experts, [experts, hidden] weight), so there is no per-expert load")
    if not moe.get("metrics"):
        return f"the model has {len(layers)} MoE layer(s) but its metrics were off (model.moe_metrics=false)"
    return (f"the model has {len(layers)} MoE layer(s) and logged them, but no training step reached "
            "the loggers (the run ended before its first logged step)")


def _no_routers(run: RunData) -> bool:
    return any(f.get("check") == "moe_router" and f.get("code") == "no_routers" for f in run.findings)


def _router_missing(run: RunData) -> str:
    if _no_routers(run):
        return "the model has no MoE router (MoERouter's no_routers finding)"
    return (("add MoERouter() to the Trainer's callbacks" if run.plain else "enable +callbacks=moe_router")
            + " (MoE models; the share is written when training ends)")


def how_to_enable(run: RunData, preset: str, check: str, cls: str, what: str = "metrics") -> str:
    """How to get what a missing figure needs, in the run's own vocabulary: ``debug=<preset>`` under
    dsdebug-train, the callback class in a plain Lightning project; when the check ran (its findings
    are there) but its metrics are not, why."""
    if not run.plain:
        return f"enable debug={preset} ({check})"
    if any(f.get("check") == check for f in run.findings):
        if run.metrics.get("loggers") == []:
            return (f"{cls} ran (its findings are above) but the Trainer had no logger (logger=False), so its "
                    f"{what} went nowhere; give the Trainer a logger (TensorBoardLogger, CSVLogger, ...)")
        if not run.history:
            return (f"{cls} ran (its findings are above) but no history.jsonl was found beside the findings "
                    "(dsdebug records it when the Trainer has a logger)")
        return f"{cls} ran (its findings are above) but logged no {what}: the run was shorter than its every_n_steps?"
    return f"add {cls}() to the Trainer's callbacks (from dsdebug.callbacks import {cls})"


def _enable(preset: str, check: str, cls: str, what: str = "metrics") -> Callable[[RunData], str]:
    return lambda run: how_to_enable(run, preset, check, cls, what)


def _comm_missing(run: RunData) -> str:
    if run.plain:
        return " or ".join(how_to_enable(run, p, c, k, "comm times") for p, c, k in (
            ("logs", "log_sync", "LogSync"), ("comm", "comm_debug", "CommDebug")))
    return ("enable debug=logs (log_sync), debug=comm (comm_debug) or debug=profile (profiler), or "
            "\"wall_clock_breakdown\": true in a ds_config.json")


# name -> (title, figure, how to record it when missing: text, or a function of the run saying why)
FIGURES: dict[str, tuple[str, Callable[[RunData], bytes | None], str | Callable[[RunData], str]]] = {
    "loss": ("Loss and learning rate", loss,
             "no train/loss in history.jsonl (the run stopped before its first logged step, or predates it)"),
    "grad_norms": ("Gradient norm per layer", grad_norms, _enable("grads", "grad_monitor", "GradMonitor",
                                                                  "per-layer norms")),
    "rank_step_time": ("Step time per rank", rank_step_time, _enable("logs", "log_sync", "LogSync", "step times")),
    "rank_memory": ("Memory per rank", rank_memory, _enable("logs", "log_sync", "LogSync", "memory")),
    "moe_load": ("MoE expert load", moe_load, moe_missing),
    "moe_router": ("MoE router: token share per expert", router_share,
                   _router_missing),
    "comm_compute": ("Communication vs compute", comm_compute, _comm_missing),
}


def loss_overlay(runs: dict[str, RunData]) -> bytes | None:
    """train/loss (solid) and val/loss (dashed) of several runs on one axis (compare)."""
    fig = figure()
    ax = fig.add_subplot(111)
    drawn = False
    for i, (name, run) in enumerate(runs.items()):
        color = f"C{i}"
        for key, style in (("train/loss", "-"), ("val/loss", "--")):
            steps, values = finite(*run.series(key))
            if steps:
                ax.plot(steps, values, ls=style, color=color, lw=1.1, label=f"{name} {key}")
                drawn = True
    if not drawn:
        return None
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("loss curves")
    ax.legend(fontsize=7)
    return png(fig)


def bars(labels: list[str], values: list[float], title: str, ylabel: str) -> bytes | None:
    pairs = [(lab, v) for lab, v in zip(labels, values) if isinstance(v, (int, float)) and math.isfinite(v)]
    if not pairs:
        return None
    fig = figure(7.5, 3.2)
    ax = fig.add_subplot(111)
    ax.bar(range(len(pairs)), [v for _, v in pairs], color="tab:blue")
    ax.set_xticks(range(len(pairs)))
    ax.set_xticklabels([lab for lab, _ in pairs], fontsize=7, rotation=20, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    return png(fig)
