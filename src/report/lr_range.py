"""The usual peak learning rate of an optimizer family for a model of a given size, from public training
recipes: what the advisor compares a run's ``optim.lr`` with before it names the LR as a cause.

| family | optimizer classes | top of the usual peak LR | range | source |
|---|---|---|---|---|
| ``adam`` | Adam, AdamW, FusedAdam, DeepSpeedCPUAdam, 8-bit/paged AdamW, NAdam, RAdam, Adamax | by total parameters: 1e-3 up to 19M, 6e-4 at 125M, 3e-4 at 350M, 2.5e-4 at 760M, 2e-4 at 1.3B, 1.6e-4 at 2.7B, 1.2e-4 at 6.7B, 1e-4 at 13B, 6e-5 at 175B (log-log between them) | top/10 .. top | GPT-3 (Brown et al. 2020, Table 2.1), Pythia (EleutherAI/pythia README: the same schedule, 1e-3 at 19M); seed 001 (Adam 1e-3), seed 002 (a DeepSeek sweep of 1e-4, 5e-5, 1e-5) |
| ``lion`` | Lion | the Adam top / 3 | top/10 .. top | Chen et al. 2023 (Lion needs a 3-10x smaller LR than AdamW) |
| ``sgd`` | SGD (momentum) | 0.1 per 256 samples, linear in the batch above 256 | top/100 .. top | Goyal et al. 2017 (ResNet-50: 0.1 x batch/256) |

Any other optimizer (Adafactor's relative steps, LAMB, Muon, ...) has no entry: ``usual_lr`` returns None
and no LR advice is given. A model of unknown size is judged against the smallest models' range (the
most generous one). Ground floor: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["UsualLR", "family_of", "lr_text", "suggestion", "usual_lr"]

# (total parameters, peak LR): GPT-3 Table 2.1; Pythia's 19M point below it
_ADAM_BY_SIZE = ((19e6, 1e-3), (125e6, 6e-4), (350e6, 3e-4), (760e6, 2.5e-4), (1.3e9, 2e-4), (2.7e9, 1.6e-4),
                 (6.7e9, 1.2e-4), (13e9, 1e-4), (175e9, 6e-5))
_SOURCES = {"adam": "GPT-3 Table 2.1 / Pythia", "lion": "Lion paper: AdamW's / 3", "sgd": "Goyal et al. 2017: 0.1 per 256 samples"}


@dataclass(frozen=True)
class UsualLR:
    family: str  # adam | lion | sgd
    low: float
    top: float
    basis: str  # what the top was read for: "at 8.7M parameters", "at a global batch of 8 samples", ...
    source: str

    def ratio(self, lr: float) -> float:
        return lr / self.top

    def text(self) -> str:
        return f"{lr_text(self.low)}..{lr_text(self.top)} for {self.family_name} {self.basis} ({self.source})"

    @property
    def family_name(self) -> str:
        return {"adam": "Adam/AdamW", "lion": "Lion", "sgd": "SGD"}[self.family]


def family_of(target: str | None) -> str | None:
    """``torch.optim.AdamW`` -> "adam"; None for an optimizer without a known range."""
    if not target:
        return None
    name = str(target).rsplit(".", 1)[-1].lower()
    if "lion" in name:
        return "lion"
    if "adam" in name and "adafactor" not in name:
        return "adam"
    if name == "sgd" or name.endswith("sgd"):
        return "sgd"
    return None


def _adam_top(params: float | None) -> float:
    if not params or params <= _ADAM_BY_SIZE[0][0]:
        return _ADAM_BY_SIZE[0][1]
    for (n0, lr0), (n1, lr1) in zip(_ADAM_BY_SIZE, _ADAM_BY_SIZE[1:]):
        if params <= n1:
            t = (math.log(params) - math.log(n0)) / (math.log(n1) - math.log(n0))
            return math.exp(math.log(lr0) + t * (math.log(lr1) - math.log(lr0)))
    return _ADAM_BY_SIZE[-1][1]


def _size_text(params: float | None) -> str:
    if not params:
        return "on a model of unknown size, the smallest models' range"
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if params >= div:
            return f"at {params / div:.3g}{unit} parameters"
    return f"at {int(params)} parameters"


def usual_lr(target: str | None, params: float | None = None, batch_samples: int | None = None) -> UsualLR | None:
    """The usual peak-LR range for the optimizer ``target`` (a class path or name) and a model of ``params``
    parameters (None: unknown); SGD's depends on the global batch in samples instead."""
    family = family_of(target)
    if family is None:
        return None
    if family == "sgd":
        batch = int(batch_samples) if batch_samples else None
        top = 0.1 * max(1.0, (batch or 0) / 256)
        basis = f"at a global batch of {batch} samples" if batch else "at an unknown batch size (read as <= 256 samples)"
        return UsualLR(family, top / 100, top, basis, _SOURCES[family])
    top = _adam_top(params) / (3.0 if family == "lion" else 1.0)
    return UsualLR(family, top / 10, top, _size_text(params), _SOURCES[family])


def lr_text(lr: float) -> str:
    """1e-3, 6e-4, 2.5e-4, 3, 0.1: short, the way LRs are written in configs."""
    if lr == 0 or not math.isfinite(lr):
        return str(lr)
    if 1e-2 <= abs(lr) < 1e3:
        return f"{lr:.3g}"
    mant, exp = f"{lr:.1e}".split("e")
    return f"{mant.rstrip('0').rstrip('.')}e{int(exp)}"


def suggestion(usual: UsualLR, scale: float = 1.0) -> float:
    """A value to try: the top of the usual range (x ``scale``: in the units of the key a user sets, when the
    LR is scaled after it), rounded down to one significant digit (1e-3, 6e-4, 2e-4)."""
    value = usual.top * scale
    exp = math.floor(math.log10(value))
    return float(f"{math.floor(round(value / 10 ** exp, 6))}e{exp}")
