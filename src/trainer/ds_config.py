"""A user's ds_config.json, passed through verbatim, with HF-style "auto" values resolved.

Two moments:
1. Before the Trainer exists (`apply_ds_json_to_cfg`): numbers the JSON fixes (micro batch,
   gradient accumulation, clipping, fp16/bf16) become the run's Hydra config values, so
   the DataLoader, the Trainer and DeepSpeed agree. The JSON wins; each change is logged.
2. At strategy setup (`resolve_auto_values`): the remaining "auto" values are filled from
   the trainer and model the way HF Trainer does (bucket sizes from hidden_size).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from src.errors import ConfigError

log = logging.getLogger(__name__)

# Keys that Lightning fills itself when absent: an "auto" there just means "absent".
_LIGHTNING_FILLED = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping")
# zero_optimization "auto" values, as HF Trainer resolves them from the model's hidden size.
_ZERO_AUTO = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}


def load_ds_config(path: str | Path) -> dict:
    """Read and sanity-check a ds_config.json; one-line ConfigError on any problem."""
    p = Path(path).expanduser()
    if not p.is_absolute():
        p = _original_cwd() / p
    if not p.is_file():
        raise ConfigError(f"strategy.config={path}: file not found ({p}); pass a path to a DeepSpeed JSON config")
    try:
        config = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"strategy.config={p}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"strategy.config={p}: top level must be a JSON object, got {type(config).__name__}")
    _validate_zero_section(config, p)
    return config


def _validate_zero_section(config: dict, source: Path | str) -> None:
    zero = config.get("zero_optimization")
    if zero is None:
        return
    if not isinstance(zero, dict):
        raise ConfigError(f"{source}: 'zero_optimization' must be an object, got {zero!r}")
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"{source}: zero_optimization.stage={stage!r} is invalid; valid: 0, 1, 2, 3")
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError

    concrete = {k: v for k, v in zero.items() if v != "auto"}
    try:
        DeepSpeedZeroConfig(**concrete)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(x) for x in err.get("loc", ()))
        raise ConfigError(f"{source}: zero_optimization.{key}: {err.get('msg')}") from None


def _original_cwd() -> Path:
    try:
        from hydra.utils import get_original_cwd

        return Path(get_original_cwd())
    except (ImportError, ValueError):
        return Path.cwd()


def apply_ds_json_to_cfg(cfg: Any, fp16_supported: bool) -> None:
    """Make the Hydra config follow the numbers a ds_config.json fixes (the JSON wins)."""
    source = cfg.strategy.get("config")
    if not isinstance(source, str):
        return
    ds = load_ds_config(source)
    world = _world_size(cfg)
    changes = []

    def set_value(key: str, value: Any, origin: str) -> None:
        node, leaf = key.rsplit(".", 1)
        target = cfg
        for part in node.split("."):
            target = target[part]
        if target.get(leaf) != value:
            changes.append(f"{key}={value} (from {origin})")
            target[leaf] = value

    micro = ds.get("train_micro_batch_size_per_gpu", "auto")
    if micro != "auto":
        set_value("data.batch_size", int(micro), "train_micro_batch_size_per_gpu")
    accum = ds.get("gradient_accumulation_steps", "auto")
    if accum != "auto":
        set_value("trainer.accumulate_grad_batches", int(accum), "gradient_accumulation_steps")
    clip = ds.get("gradient_clipping", "auto")
    if clip != "auto":
        set_value("trainer.gradient_clip_val", float(clip), "gradient_clipping")
    total = ds.get("train_batch_size", "auto")
    if total != "auto":
        expected = cfg.data.batch_size * cfg.trainer.accumulate_grad_batches * world
        if int(total) != expected:
            raise ConfigError(
                f"{source}: train_batch_size={total} != micro batch {cfg.data.batch_size} x accumulation "
                f"{cfg.trainer.accumulate_grad_batches} x world size {world} = {expected}; set it to {expected} or \"auto\""
            )
    fp16 = _enabled(ds.get("fp16"))
    bf16 = _enabled(ds.get("bf16"))
    if fp16 is True and bf16 is True:
        raise ConfigError(f"{source}: fp16.enabled and bf16.enabled are both true; enable at most one")
    if fp16 is True:
        if fp16_supported:
            set_value("trainer.precision", "16-mixed", "fp16.enabled")
        else:
            log.warning(
                "%s enables fp16, which this device does not support (DeepSpeed CPU accelerator without "
                "AVX512-FP16); training in bf16 instead. On a GPU the file runs as written.", source
            )
            set_value("trainer.precision", "bf16-mixed", "fp16.enabled, downgraded: no fp16 on this CPU")
    elif bf16 is True:
        set_value("trainer.precision", "bf16-mixed", "bf16.enabled")
    for change in changes:
        log.info("ds_config: %s", change)


def _enabled(section: Any) -> bool | str | None:
    if not isinstance(section, dict):
        return None
    return section.get("enabled", True)  # DeepSpeed treats a present section as enabled


def _world_size(cfg: Any) -> int:
    devices = cfg.trainer.get("devices", 1)
    devices = devices if isinstance(devices, int) and devices > 0 else 1
    return devices * int(cfg.trainer.get("num_nodes", 1) or 1)


def resolve_auto_values(config: dict | None, module: Any, source: str | None = None) -> None:
    """Resolve "auto" in-place from the trainer/model; error on any "auto" we cannot resolve."""
    if not config:
        return
    where = source or "deepspeed config"
    trainer = getattr(module, "trainer", None) if module is not None else None
    for key in _LIGHTNING_FILLED + ("train_batch_size",):
        if config.get(key) == "auto":
            del config[key]  # Lightning/DeepSpeed derive it from the trainer
    # A numeric value that Lightning also sets must agree with the trainer (apply_ds_json_to_cfg
    # made it so); Lightning refuses the key, so drop it once checked.
    accum = config.get("gradient_accumulation_steps")
    if accum is not None and trainer is not None:
        if int(accum) != trainer.accumulate_grad_batches:
            raise ConfigError(
                f"{where}: gradient_accumulation_steps={accum} but trainer.accumulate_grad_batches="
                f"{trainer.accumulate_grad_batches}; make them equal or use \"auto\""
            )
        del config["gradient_accumulation_steps"]
    precision = str(getattr(trainer, "precision", "32-true")) if trainer is not None else "32-true"
    for key, wanted in (("fp16", precision.startswith("16")), ("bf16", precision.startswith("bf16"))):
        section = config.get(key)
        if isinstance(section, dict) and section.get("enabled") == "auto":
            section["enabled"] = wanted
        if isinstance(section, dict) and not wanted and section.get("enabled", True) is True:
            # e.g. fp16 in the JSON downgraded to bf16 on a CPU without fp16 support
            section["enabled"] = False
    hidden = _hidden_size(module)
    zero = config.get("zero_optimization") or {}
    for key, fn in _ZERO_AUTO.items():
        if zero.get(key) == "auto":
            if hidden is None:
                del zero[key]  # DeepSpeed's default
            else:
                zero[key] = fn(hidden)
    leftover = _find_auto(config)
    if leftover:
        raise ConfigError(
            f"{where}: cannot resolve \"auto\" for {', '.join(leftover)}; resolvable: "
            f"{', '.join(_LIGHTNING_FILLED + ('train_batch_size', 'fp16.enabled', 'bf16.enabled'))}, "
            f"zero_optimization.{{{', '.join(_ZERO_AUTO)}}}; give a number instead"
        )


def _hidden_size(module: Any) -> int | None:
    net = getattr(module, "net", None)
    cfg = getattr(net, "config", None)
    return getattr(cfg, "hidden_size", None)


def _find_auto(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        out = []
        for k, v in node.items():
            out += _find_auto(v, f"{prefix}{k}.")
        return out
    return [prefix.rstrip(".")] if node == "auto" else []
