"""LossSpike's detector, pure math: a rolling median/MAD window of healthy (step, loss, grad_norm)
records and the robust z-score / relative-jump verdict; before the window is warm, priors that need
no history (an untrained model's loss, ln(vocab)) and a short-history jump. Re-exported from
loss_spike.py."""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

__all__ = ["SpikeWindow"]


class SpikeWindow:
    """The detector: rolling median/MAD of healthy (step, loss, grad_norm) records. No collectives."""

    def __init__(self, window: int, warmup_steps: int, z_threshold: float, min_rel_jump: float,
                 grad_ratio: float | None, prior: float | None = None, prior_margin: float = 0.5,
                 early_min_steps: int = 3, early_jump: float = 1.0) -> None:
        self.window, self.warmup_steps = window, warmup_steps
        self.z_threshold, self.min_rel_jump, self.grad_ratio = z_threshold, min_rel_jump, grad_ratio
        # the early rules (fewer than warmup_steps healthy steps): prior = an untrained model's loss
        # (ln(vocab) for a causal LM; None: unknown, only the short-history jump judges)
        self.prior, self.prior_margin = prior, prior_margin
        self.early_min_steps, self.early_jump = early_min_steps, early_jump
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
            return self.judge_early(loss, gnorm)
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

    def judge_early(self, loss: float, gnorm: float | None) -> dict[str, Any]:
        """Before the window is warm: (a) from step 0, a loss ``prior_margin`` above an untrained model's
        (``prior`` = ln(vocab)): nothing healthy starts there (logits scaled up, a loss scale left in, an
        LR blow-up); (b) from ``early_min_steps`` healthy steps, a jump against the median of the last
        five: ``early_jump`` (x2 by default), or ``min_rel_jump`` when the loss is also back above an
        untrained model's (a model that learnt something does worse than chance on this batch), or the
        joint grad-norm rule. The early loss falls fast, so a falling loss never fires."""
        # every key the late verdict has, so a caller never meets a missing one (a spike at step 0 has no history)
        out: dict[str, Any] = {"spike": False, "score": 0.0, "why": "warm-up", "median": None, "early": True,
                               "mad": None, "z": None, "jump": None, "grad_norm": gnorm, "grad_ratio": None}
        parts, whys = [], []
        if self.prior is not None and self.prior > 0 and self.prior_margin > 0:
            limit = (1 + self.prior_margin) * self.prior
            parts.append(loss / limit)
            if loss >= limit:
                whys.append(f"loss {loss:.4g} is {loss / self.prior:.2f}x an untrained model's ln(vocab) = "
                            f"{self.prior:.4g} (limit {limit:.4g}, prior_margin={self.prior_margin:g})")
        recent = list(self.history)[-5:]
        if len(self.history) >= self.early_min_steps and recent:
            ref = statistics.median(r[1] for r in recent)
            jump = loss / ref - 1 if ref > 0 else 0.0
            above_prior = self.prior is not None and loss >= self.prior
            parts.append(jump / (self.min_rel_jump if above_prior else self.early_jump))
            out.update(median=ref, jump=jump)
            norms = [r[2] for r in recent if r[2] is not None and math.isfinite(r[2])]
            if self.grad_ratio is not None and gnorm is not None and norms and statistics.median(norms) > 0:
                ratio = gnorm / statistics.median(norms)
                parts.append(min(ratio / (2 * self.grad_ratio), 2 * jump / self.min_rel_jump))
                out.update(grad_norm=gnorm, grad_ratio=ratio)
            if max(parts) >= 1 and not whys:
                whys.append(f"loss {loss:.4g} vs the median {ref:.4g} of the last {len(recent)} steps "
                            f"(x{loss / ref:.2f}" + (f", back above an untrained model's {self.prior:.4g}"
                                                     if above_prior else "") + ")"
                            + (f"; grad norm {out['grad_ratio']:.2f}x its median" if out["grad_ratio"] is not None else ""))
        score = max(parts) if parts else 0.0
        out.update(score=score, spike=score >= 1.0, why="; ".join(whys) + " (early rule: fewer than "
                   f"{self.warmup_steps} healthy steps)" if whys else "warm-up")
        return out
