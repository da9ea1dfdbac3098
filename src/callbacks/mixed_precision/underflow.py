"""fp16 gradient underflow, for mixed_precision: the share of non-zero fp16 gradient elements below fp16's
smallest normal (losing bits; their smaller neighbours flushed to 0)."""

from __future__ import annotations

import torch

__all__ = ["FP16_TINY", "subnormal_fraction"]

FP16_TINY = torch.finfo(torch.float16).tiny  # 6.1e-5, smallest normal fp16


def subnormal_fraction(grads: list[torch.Tensor]) -> tuple[float, int]:
    """Share of non-zero fp16 gradient elements below fp16's smallest normal, and how many were counted."""
    sub = nonzero = 0
    for g in grads:
        if g is None or g.dtype != torch.float16 or g.numel() == 0:
            continue
        a = g.detach().abs()
        nz = a > 0
        nonzero += int(nz.sum())
        sub += int((nz & (a < FP16_TINY)).sum())
    return (sub / nonzero if nonzero else 0.0), nonzero
