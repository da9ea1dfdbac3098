"""The MoE router figure: token share per expert per MoE layer over the run, all ranks.

Read from the ``moe_router/router_summary`` finding (``callbacks/moe_router.py`` writes the run's
all-reduced ``[layers x experts]`` share into its details), with the per-window load entropy
(``moe_router/load_entropy/L<i>``) beside it when the history has it.
"""

from __future__ import annotations

from dsdebug.report.figure import figure, finite, natural, png
from dsdebug.report.load import RunData

__all__ = ["router_share"]


def _summary(run: RunData) -> dict | None:
    hits = [f for f in run.findings if f.get("check") == "moe_router" and f.get("code") == "router_summary"
            and isinstance((f.get("details") or {}).get("share"), dict)]
    return hits[-1]["details"] if hits else None


def router_share(run: RunData) -> bytes | None:
    details = _summary(run)
    if not details or not details["share"]:
        return None
    import numpy as np

    layers = sorted(details["share"], key=natural)
    grid = np.array([details["share"][layer] for layer in layers], dtype=float)
    experts = grid.shape[1]
    entropy = [k for k in run.keys("moe_router/load_entropy/") if run.history[k]]
    fig = figure(7.5, max(2.6, 1.2 + 0.35 * len(layers)))
    ax = fig.add_subplot(1, 2 if entropy else 1, 1)
    image = ax.imshow(grid * experts, aspect="auto", interpolation="nearest", cmap="magma", vmin=0)
    ax.set_yticks(range(len(layers)))
    ax.set_yticklabels(layers, fontsize=7)
    ax.set_xticks(range(experts))
    ax.set_xticklabels([f"E{e}" for e in range(experts)], fontsize=6 if experts > 16 else 7, rotation=90)
    if grid.size <= 256:  # small enough to print the shares
        for (i, e), v in np.ndenumerate(grid):
            ax.text(e, i, "dead" if v == 0 else f"{v:.2f}", ha="center", va="center", fontsize=5,
                    color="white" if v * experts < 1.5 else "black")
    steps = details.get("steps") or ["?", "?"]
    ax.set_title(f"token share x E, steps {steps[0]}-{steps[1]} (1 = uniform)", fontsize=8)
    fig.colorbar(image, ax=ax, label="share x E")
    if entropy:
        ax2 = fig.add_subplot(1, 2, 2)
        for key in sorted(entropy, key=natural):
            ax2.plot(*finite(*run.series(key)), marker="o", ms=2, lw=1, label=key.rsplit("/", 1)[-1])
        ax2.set_ylim(0, 1.05)
        ax2.set_xlabel("step")
        ax2.set_title("load entropy per window (1 uniform, 0 collapsed)", fontsize=8)
        ax2.legend(fontsize=6)
    return png(fig)
