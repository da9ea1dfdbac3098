"""Optimizer pieces: decay/no-decay parameter groups, warmup + cosine schedule, LR scaling.

The usual recipe: linear LR scaling with the global batch size, linear warmup over the first 10% of
steps, gradient clipping at max_norm=1.0 (clipping itself is the Trainer's/DeepSpeed's).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterable

from dsdebug.errors import ConfigError

__all__ = ["param_groups", "resolve_fused", "scaled_lr", "warmup_clamped", "warmup_cosine", "warmup_length"]

if TYPE_CHECKING:  # the LR arithmetic below runs in config validation, before torch is imported
    import torch
    from torch.optim.lr_scheduler import LambdaLR

log = logging.getLogger(__name__)


def param_groups(named_params: Iterable[tuple[str, torch.nn.Parameter]]) -> list[dict]:
    """Biases, norms and embeddings get no weight decay; the rest the optimizer's default."""
    decay, no_decay = [], []
    for name, p in named_params:
        if not p.requires_grad:
            continue
        if p.ndim < 2 or "norm" in name.lower() or "embed" in name.lower():
            no_decay.append(p)
        else:
            decay.append(p)
    # no empty group: DeepSpeed's ZeRO reads the first parameter of the first group (a model that trains only
    # its norms/embeddings, BitFit-style, has no decayed parameter)
    groups = [{"params": decay}] if decay else []
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def warmup_cosine(optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float = 0.1,
                  warmup_steps: int | None = None, min_lr_ratio: float = 0.1) -> LambdaLR:
    """Linear warmup from peak/(warmup+1) to the peak LR, then cosine decay to ``min_lr_ratio * peak``: transformers'
    ``get_cosine_with_min_lr_schedule_with_warmup``, sized from the run's optimizer steps and our
    config keys (``optim.scheduler.warmup_ratio|warmup_steps|min_lr_ratio``)."""
    from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

    if not 0.0 <= warmup_ratio < 1.0:
        raise ConfigError(f"optim.scheduler.warmup_ratio must be in [0, 1), got {warmup_ratio}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.scheduler.min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    total_steps = max(1, int(total_steps))
    # transformers' schedule gives LR 0 to the first update (step 0 of its count); ours counts the
    # update being made from 1, so the first step already learns: the same curve one step on
    # (warmup + 1, total + 1, starting at 1): (s+1)/(warmup+1) in warmup, then cosine over total - warmup
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])
    return get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=warmup_length(total_steps, warmup_ratio, warmup_steps) + 1,
        num_training_steps=total_steps + 1, min_lr_rate=float(min_lr_ratio), last_epoch=0)


def warmup_length(total_steps: int, warmup_ratio: float, warmup_steps: int | None = None) -> int:
    """Warmup length of ``warmup_cosine`` (also what a ds_config's "auto" warmup_num_steps gets)."""
    total_steps = max(1, int(total_steps))
    warmup = int(warmup_steps) if warmup_steps is not None else int(round(warmup_ratio * total_steps))
    return min(warmup, total_steps - 1) if total_steps > 1 else 0


def warmup_clamped(total_steps: int, warmup_steps: int | None) -> str | None:
    """What ``warmup_length`` changed of a ``warmup_steps`` the user set, as one line naming the key, the
    value asked and the value used; None when it is used as given (a ratio is a share of the run, never
    clamped)."""
    if warmup_steps is None:
        return None
    used = warmup_length(total_steps, 0.0, warmup_steps)
    if used == int(warmup_steps):
        return None
    return (f"optim.scheduler.warmup_steps={int(warmup_steps)} is used as {used}: the run has "
            f"{max(1, int(total_steps))} optimizer steps, and the warmup must end before the last one (the LR "
            f"peaks at step {used})")


def resolve_fused(value: object, precision: str, strategy_target: str | None) -> object:
    """``optim.optimizer.fused: auto`` -> True: torch's fused Adam/AdamW/SGD kernel (one kernel per update
    instead of a dozen foreach passes; same update up to float rounding, tests/models/test_fast_paths.py), on
    CPU and CUDA. False under torch AMP fp16 (``trainer.precision=16-mixed`` without DeepSpeed): there a fused
    optimizer unscales the gradients inside ``step()``, so Lightning refuses to clip them and the checks would
    see them loss-scaled (DeepSpeed's fp16 unscales before calling the optimizer: True). Any other value is
    the user's and returned as given."""
    if not (isinstance(value, str) and value.lower() == "auto"):
        return value
    fused = not (str(precision) == "16-mixed" and "DeepSpeed" not in str(strategy_target or ""))
    log.info("optim.optimizer.fused=auto: %s%s", str(fused).lower(), "" if fused else
             " (torch AMP fp16: Lightning unscales the gradients before clipping; a fused optimizer would do it "
             "inside step())")
    return fused


def scaled_lr(lr: float, global_batch_size: int, base_batch_size: int | None) -> float:
    """Linear scaling rule (Goyal et al.): lr * global_batch / base_batch; off when base is None."""
    if base_batch_size is None:
        return lr
    if base_batch_size <= 0:
        raise ConfigError(f"optim.scale_lr_base_batch_size must be a positive int or null, got {base_batch_size}")
    new_lr = lr * global_batch_size / base_batch_size
    log.info("linear LR scaling: lr %.3g x global batch %d / base batch %d = %.3g",
             lr, global_batch_size, base_batch_size, new_lr)
    return new_lr
