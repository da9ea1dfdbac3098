"""Checks on the composed config that must fail before anything is built or launched.

Each failure is a one-line `ConfigError` naming the key and the valid values.
"""

from __future__ import annotations

import os
from numbers import Number
from pathlib import Path

from omegaconf import DictConfig

from src.errors import ConfigError

PRECISIONS = ("32-true", "32", "bf16-mixed", "16-mixed", "bf16-true", "64-true")


def fp16_supported(accelerator: str) -> bool:
    """Whether fp16 compute works here: always on CUDA; on CPU only with AVX512-FP16/AMX."""
    if accelerator in ("gpu", "cuda"):
        return True
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:  # older torch without the probe
        return False


def _positive_number(value, key: str, integer: bool = False) -> None:
    ok = isinstance(value, Number) and not isinstance(value, bool) and value > 0
    if ok and integer:
        ok = float(value).is_integer()
    if not ok:
        kind = "positive integer" if integer else "positive number"
        raise ConfigError(f"{key} must be a {kind}, got {value!r}")


def validate_config(cfg: DictConfig) -> None:
    _positive_number(cfg.optim.lr, "optim.lr")
    if cfg.optim.get("grad_clip") is not None and cfg.optim.grad_clip < 0:
        raise ConfigError(f"optim.grad_clip must be >= 0 or null, got {cfg.optim.grad_clip!r}")
    t = cfg.trainer
    _positive_number(t.max_steps, "trainer.max_steps", integer=True)
    _positive_number(t.accumulate_grad_batches, "trainer.accumulate_grad_batches", integer=True)
    if not isinstance(cfg.seed, int) or isinstance(cfg.seed, bool):
        raise ConfigError(f"seed must be an integer, got {cfg.seed!r}")
    precision = str(t.precision)
    if precision not in PRECISIONS:
        raise ConfigError(f"trainer.precision={precision!r} is invalid; valid: {', '.join(PRECISIONS)}")
    _validate_devices(t)
    accelerator = str(t.accelerator)
    if precision.startswith("16") and not fp16_supported(accelerator):
        raise ConfigError(
            "trainer.precision=16-mixed: this CPU has no fp16 support (needs AVX512-FP16/AMX); "
            "valid here: 32-true, bf16-mixed (or run with trainer=gpu)"
        )
    resume = cfg.get("resume")
    if resume not in (None, "latest", "latest_valid"):
        raise ConfigError(f"resume={resume!r} is invalid; valid: null, latest, latest_valid (or use ckpt_path=<path>)")
    if cfg.get("ckpt_path") and resume:
        raise ConfigError(f"give either ckpt_path=<path> or resume={resume}, not both")
    if cfg.get("ckpt_path"):
        path = Path(str(cfg.ckpt_path)).expanduser()
        if not path.exists():
            raise ConfigError(f"ckpt_path={cfg.ckpt_path}: no such file or directory")


def _validate_devices(t: DictConfig) -> None:
    accelerator = str(t.accelerator)
    valid_acc = ("cpu", "gpu", "cuda", "auto")
    if accelerator not in valid_acc:
        raise ConfigError(f"trainer.accelerator={accelerator!r} is invalid; valid: {', '.join(valid_acc)}")
    devices = t.devices
    if accelerator in ("gpu", "cuda"):
        import torch

        available = torch.cuda.device_count()
        if available == 0:
            raise ConfigError(
                f"trainer.accelerator={accelerator} but no CUDA GPU is visible; use trainer=cpu or trainer=ddp_sim"
            )
        if devices in ("auto", -1):
            return
        if not isinstance(devices, int) or devices < 1 or devices > available:
            raise ConfigError(f"trainer.devices={devices!r} but {available} GPU(s) are available; valid: 1..{available}, auto")
    else:
        if devices == "auto":
            return
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1 or devices > cores:
            raise ConfigError(
                f"trainer.devices={devices!r} CPU processes but this machine has {cores} core(s); valid: 1..{cores}"
            )
