"""Small collectives every rank must call together (a collective on some ranks only is a hang)."""

from __future__ import annotations

from typing import Any

import torch


def any_rank(trainer: Any, flag: bool) -> bool:
    """True if ``flag`` is True on any rank. COLLECTIVE: every rank must call it."""
    if trainer is None or trainer.world_size <= 1:
        return bool(flag)
    t = torch.tensor([1.0 if flag else 0.0], device=trainer.strategy.root_device)
    return bool(trainer.strategy.reduce(t, reduce_op="max").item() > 0)
