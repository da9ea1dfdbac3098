"""`ProbeResult`: what one probe of the preflight doctor found (status, culprit, what to do)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["ProbeResult", "STATUSES", "timed"]

STATUSES = ("pass", "warn", "fail", "skip")
_SEVERITY = {"fail": "error", "warn": "warning", "pass": "info", "skip": "info"}


@dataclass
class ProbeResult:
    """``culprit`` names what broke the property (a module, parameter, position, rank or config
    key); ``advice`` says what to do. ``fail`` makes the doctor exit non-zero; ``warn`` does not."""

    probe: str
    status: str
    message: str = ""
    culprit: str = ""
    advice: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")

    @property
    def failed(self) -> bool:
        return self.status == "fail"

    @property
    def severity(self) -> str:
        """The finding's severity: fail -> error, warn -> warning, pass/skip -> info."""
        return _SEVERITY[self.status]

    def line(self) -> str:
        """``FAIL causality [attn]: <message>``: the finding's message."""
        culprit = f" [{self.culprit}]" if self.culprit else ""
        return f"{self.status.upper()} {self.probe}{culprit}: {self.message}"


def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> ProbeResult:
    """Run a probe and record its wall time in ``seconds`` (a probe returning (result, extra):
    the result)."""
    started = time.perf_counter()
    result = fn(*args, **kwargs)
    probe = result[0] if isinstance(result, tuple) else result
    probe.seconds = round(time.perf_counter() - started, 3)
    return probe
