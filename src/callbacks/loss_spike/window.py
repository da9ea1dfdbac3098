"""LossSpike's detector, pure math: a rolling median/MAD window of healthy (step, loss, grad_norm)
records and the robust z-score / relative-jump verdict. Re-exported from loss_spike.py."""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any


class SpikeWindow:
    """The detector: rolling median/MAD of healthy (step, loss, grad_norm) records. No collectives."""

    def __init__(self, window: int, warmup_steps: int, z_threshold: float, min_rel_jump: float,
                 grad_ratio: float | None) -> None:
        self.window, self.warmup_steps = window, warmup_steps
        self.z_threshold, self.min_rel_jump, self.grad_ratio = z_threshold, min_rel_jump, grad_ratio
        self.history: deque[tuple[int, float, float | None]] = deque(maxlen=20_000)  # for rollbacks

    def push(self, step: int, loss: float, gnorm: float | None) -> None:
        self.history.append((step, loss, gnorm))

    def rollback_to(self, step: int) -> None:
        """Forget what was seen from ``step`` on: the window as it was when that checkpoint was taken."""
        while self.history and self.history[-1][0] >= step:
            self.history.pop()

    def judge(self, loss: float, gnorm: float | None) -> dict[str, Any]:
        if not math.isfinite(loss):
            return {"spike": True, "score": math.inf, "why": "non-finite loss", "median": None}
        recent = list(self.history)[-self.window:]
        if len(self.history) < self.warmup_steps or not recent:
            return {"spike": False, "score": 0.0, "why": "warm-up", "median": None}
        med = statistics.median(r[1] for r in recent)
        mad = statistics.median(abs(r[1] - med) for r in recent)
        scale = max(1.4826 * mad, 1e-3 * abs(med), 1e-12)
        z = (loss - med) / scale
        jump = loss / med - 1 if med > 0 else (math.inf if loss > med else 0.0)
        score = max(0.0, min(z / self.z_threshold, jump / self.min_rel_jump))
        ratio, gmed = None, None
        norms = [r[2] for r in recent if r[2] is not None and math.isfinite(r[2])]
        if self.grad_ratio is not None and gnorm is not None and norms:
            gmed = statistics.median(norms)
            ratio = gnorm / gmed if gmed > 0 else math.inf
            score = max(score, min(ratio / self.grad_ratio, 2 * z / self.z_threshold, 2 * jump / self.min_rel_jump))
        why = (f"loss {loss:.4g} vs window median {med:.4g} (x{loss / med:.2f}, robust z {z:.1f}, MAD {mad:.3g})"
               if med > 0 else f"loss {loss:.4g} vs window median {med:.4g}")
        if ratio is not None:
            why += f"; grad norm {gnorm:.4g} = {ratio:.2f}x its median {gmed:.4g}"
        return {"spike": score >= 1.0, "score": score, "why": why, "median": med, "mad": mad, "z": z,
                "jump": jump, "grad_norm": gnorm, "grad_ratio": ratio}
