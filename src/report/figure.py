"""The figure helpers every report figure shares: a matplotlib ``Figure`` on the Agg canvas (no pyplot, no global
state), its PNG bytes, the finite points of a series and the natural order of metric keys."""

from __future__ import annotations

import io
import math
import re

__all__ = ["figure", "finite", "natural", "png"]


def figure(width: float = 7.5, height: float = 3.4):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=90)
    FigureCanvasAgg(fig)
    return fig


def png(fig) -> bytes:
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def finite(steps: list[int], values: list[float]) -> tuple[list[int], list[float]]:
    pairs = [(s, v) for s, v in zip(steps, values) if math.isfinite(v)]
    return [s for s, _ in pairs], [v for _, v in pairs]


def natural(key: str) -> list:
    """'moe/load/L10/E2' sorts after 'moe/load/L9/E10': numbers compare as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)]
