"""`data.global_batch_size`: the batch per optimizer step over all ranks, when you set it.

    python train.py trainer=ddp_sim data.global_batch_size=32   # -> data.batch_size=16 per rank

global = data.batch_size (per rank) x trainer.accumulate_grad_batches x world size, so the
per-rank micro batch is derived as global / (world size x accumulation), which must be an
integer. `null` (the default) keeps data.batch_size as given. A ds_config.json that fixes
train_batch_size, train_micro_batch_size_per_gpu or gradient_accumulation_steps would
fight it, so the two together are an error.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from dsdebug.errors import ConfigError

__all__ = ["apply_global_batch_size", "check_global_batch_size", "world_size"]

log = logging.getLogger(__name__)

_DS_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def world_size(cfg: Any) -> int:
    """Processes in the run: devices x nodes ("auto": every visible GPU, or 1 CPU process)."""
    devices = cfg.trainer.devices
    if devices in ("auto", -1):
        if str(cfg.trainer.accelerator) in ("gpu", "cuda"):
            import torch

            devices = torch.cuda.device_count()
        else:
            devices = 1
    return int(devices) * int(cfg.trainer.get("num_nodes", 1) or 1)


def check_global_batch_size(cfg: Any) -> int | None:
    """The per-rank batch that data.global_batch_size gives (None when it is not set)."""
    total = cfg.data.get("global_batch_size")
    if total is None:
        return None
    if not isinstance(total, int) or isinstance(total, bool) or total < 1:
        raise ConfigError(f"data.global_batch_size must be a positive int or null, got {total!r}")
    world, accum = world_size(cfg), int(cfg.trainer.accumulate_grad_batches)
    per_micro = world * accum
    if total % per_micro:
        below, above = total // per_micro * per_micro, (total // per_micro + 1) * per_micro
        near = f"{below} or {above}" if below else f"{above}"
        raise ConfigError(
            f"data.global_batch_size={total} is not divisible by world size {world} x "
            f"trainer.accumulate_grad_batches={accum} = {per_micro}; valid: a multiple of {per_micro} "
            f"(e.g. {near})"
        )
    _check_no_ds_json_batch(cfg, total)
    return total // per_micro


def apply_global_batch_size(cfg: Any) -> None:
    """Set data.batch_size from data.global_batch_size (call with the config writable)."""
    micro = check_global_batch_size(cfg)
    if micro is not None and micro != cfg.data.batch_size:
        log.info("data.batch_size=%d per rank (from data.global_batch_size=%d)", micro, cfg.data.global_batch_size)
        cfg.data.batch_size = micro


def _check_no_ds_json_batch(cfg: Any, total: int) -> None:
    source = cfg.strategy.get("config") if "strategy" in cfg else None
    if not isinstance(source, str):
        return
    path = Path(source).expanduser()
    try:
        ds = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # load_ds_config reports a missing or broken file
    if not isinstance(ds, dict):
        return
    fixed = [f"{k}={ds[k]}" for k in _DS_BATCH_KEYS if k in ds and ds[k] != "auto"]
    if fixed:
        raise ConfigError(
            f"data.global_batch_size={total} and strategy.config={source} ({', '.join(fixed)}) both set the "
            "batch size; valid: one of them (data.global_batch_size=null, or \"auto\" for those keys in the JSON)"
        )
