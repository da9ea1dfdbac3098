"""A user's ds_config.json: read, translated where DeepSpeed renamed keys, settled with the run.

Three moments:
1. ``check_ds_json`` (validate_config, before torch is imported): the file parses, and no key
   that cannot apply here is set (ds_keys.refusals): a bad file fails in about a second.
2. ``apply_ds_json_to_cfg`` (before the Trainer exists): numbers the JSON fixes (batch sizes by
   DeepSpeed's own rule, accumulation, clipping, fp16/bf16) become the run's Hydra config values,
   so the DataLoader, the Trainer and DeepSpeed agree. The JSON wins; each change is logged, then
   one line lists the keys translated or not used under Lightning, and warnings name unknown keys
   and a JSON optimizer/scheduler that replaces the project's.
3. At strategy setup (ds_auto.resolve_auto_values): the remaining "auto" values are filled from
   the trainer, the module's optimizer settings and the model, the way HF Trainer does.

What each key does: src/config/ds_keys.py and docs/ds_config.md.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable

from dsdebug.errors import ConfigError
from dsdebug.config import ds_keys

__all__ = ["apply_ds_json_to_cfg", "check_ds_json", "load_ds_config", "read_ds_config", "settle_batch"]

log = logging.getLogger(__name__)

# deprecated ZeRO keys DeepSpeed still maps, rewritten here so the framework sees the new form
# (the optimizer swap for offload reads offload_optimizer)
_ZERO_RENAMED = {
    "cpu_offload": ("offload_optimizer", "offload_optimizer.device=cpu"),
    "cpu_offload_param": ("offload_param", "offload_param.device=cpu"),
}


def read_ds_config(path: str | Path, notes: list[str] | None = None) -> dict:
    """Parse a ds_config.json and translate deprecated keys (pure Python; one-line errors)."""
    p = Path(path).expanduser()
    if not p.is_absolute():
        p = _original_cwd() / p
    if not p.is_file():
        raise ConfigError(f"strategy.config={path}: file not found ({p}); pass a path to a DeepSpeed JSON config")
    try:
        config = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        where = f" at line {e.lineno} column {e.colno}: {e.msg}" if isinstance(e, json.JSONDecodeError) else ""
        raise ConfigError(f"strategy.config={p}: invalid JSON{where}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"strategy.config={p}: top level must be a JSON object, got {type(config).__name__}")
    _translate_deprecated(config, notes if notes is not None else [])
    return config


def load_ds_config(path: str | Path, notes: list[str] | None = None) -> dict:
    """read_ds_config + the ZeRO section validated with DeepSpeed's own pydantic model."""
    config = read_ds_config(path, notes)
    _validate_zero_section(config, path)
    return config


def _translate_deprecated(config: dict, notes: list[str]) -> None:
    zero = config.get("zero_optimization")
    if isinstance(zero, bool):  # the oldest format: "zero_optimization": true = stage 1
        config["zero_optimization"] = zero = {"stage": 1 if zero else 0}
        if "allgather_size" in config:
            zero["allgather_bucket_size"] = config.pop("allgather_size")
        notes.append(f"zero_optimization={str(bool(zero['stage'])).lower()} -> {{\"stage\": {zero['stage']}}} "
                     "(deprecated boolean form)")
    if isinstance(zero, dict):
        pin = zero.pop("cpu_offload_use_pin_memory", None)
        for old, (new, said) in _ZERO_RENAMED.items():
            if old not in zero:
                continue
            value = zero.pop(old)
            if value and new not in zero:
                zero[new] = {"device": "cpu", **({"pin_memory": bool(pin)} if pin is not None else {})}
            notes.append(f"zero_optimization.{old}={json.dumps(value)} -> {said if value else 'nothing'} (deprecated)")
    if "bfloat16" in config:
        section = config.pop("bfloat16")
        if "bf16" not in config:
            config["bf16"] = section
        notes.append("bfloat16 -> bf16 (old name)")


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
        hint = ""
        if err.get("type") == "extra_forbidden":
            import difflib

            fields = [f.alias or n for n, f in DeepSpeedZeroConfig.model_fields.items()]
            close = difflib.get_close_matches(key.split(".")[-1], fields, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"{source}: zero_optimization.{key}: {err.get('msg')}{hint}") from None


def _original_cwd() -> Path:
    try:
        from hydra.utils import get_original_cwd

        return Path(get_original_cwd())
    except (ImportError, ValueError):
        return Path.cwd()


def check_ds_json(cfg: Any) -> None:
    """Before anything heavy: the file reads and no refused key is set (validate_config)."""
    source = cfg.strategy.get("config") if "strategy" in cfg else None
    if isinstance(source, str):
        ds = read_ds_config(source)
        ds_keys.refusals(ds, source, on_cpu=str(cfg.trainer.accelerator) == "cpu")
        settle_batch(ds, cfg.data.batch_size, cfg.trainer.accumulate_grad_batches, _world_size(cfg), source)


def apply_ds_json_to_cfg(cfg: Any, fp16_supported: bool | Callable[[], bool]) -> None:
    """Make the Hydra config follow the numbers a ds_config.json fixes (the JSON wins)."""
    source = cfg.strategy.get("config")
    if not isinstance(source, str):
        return
    notes: list[str] = []
    ds = load_ds_config(source, notes)
    changes = []

    def set_value(key: str, value: Any, origin: str) -> None:
        node, leaf = key.rsplit(".", 1)
        target = cfg
        for part in node.split("."):
            target = target[part]
        if target.get(leaf) != value:
            changes.append(f"{key}={value} (from {origin})")
            target[leaf] = value

    micro, accum, origin = settle_batch(ds, cfg.data.batch_size, cfg.trainer.accumulate_grad_batches,
                                        _world_size(cfg), source)
    set_value("data.batch_size", micro, origin["micro"])
    set_value("trainer.accumulate_grad_batches", accum, origin["accum"])
    clip = ds.get("gradient_clipping", "auto")
    if clip != "auto":
        set_value("trainer.gradient_clip_val", float(clip), "gradient_clipping")
    fp16, bf16 = _enabled(ds.get("fp16")), _enabled(ds.get("bf16"))
    if fp16 is True and bf16 is True:
        raise ConfigError(f"{source}: fp16.enabled and bf16.enabled are both true; enable at most one")
    if fp16 is True:
        if fp16_supported() if callable(fp16_supported) else fp16_supported:  # a probe: asked only here
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
    _say_what_is_not_used(ds, source, notes, cfg)


def settle_batch(ds: dict, batch_size: int, accum: int, world: int, source: str) -> tuple[int, int, dict]:
    """(micro batch per rank, accumulation, where each came from), by DeepSpeed's own rule
    (DeepSpeedConfig._set_batch_related_parameters); "auto" or absent = the run's value, except
    that a train_batch_size given without gradient_accumulation_steps means 1, as DeepSpeed has it."""
    def fixed(key: str) -> int | None:
        value = ds.get(key, "auto")
        if value == "auto":
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1 or value != int(value):
            raise ConfigError(f"{source}: {key}={value!r} must be a positive integer or \"auto\"")
        return int(value)

    total, micro, gas = fixed("train_batch_size"), fixed("train_micro_batch_size_per_gpu"), \
        fixed("gradient_accumulation_steps")
    origin = {"micro": "train_micro_batch_size_per_gpu", "accum": "gradient_accumulation_steps"}
    if total is None:
        return micro or batch_size, gas or accum, origin
    rule = f"train_batch_size={total} by DeepSpeed's rule"
    given_micro, given_gas = micro, gas
    if micro is None and gas is None:
        gas, origin["accum"] = 1, rule
    if micro is None:
        micro, origin["micro"] = total // (world * gas), rule
    elif gas is None:
        gas, origin["accum"] = total // (world * micro), rule
    if micro < 1 or gas < 1 or micro * gas * world != total:
        if given_micro is not None and given_gas is not None:
            valid = f"train_batch_size={micro * gas * world}"
        else:
            unit = world * (given_micro or given_gas or 1)
            what = " x ".join(["world size"] + (["train_micro_batch_size_per_gpu"] if given_micro else []) +
                              (["gradient_accumulation_steps"] if given_gas else []))
            valid = f"a train_batch_size that is a multiple of {unit} ({what})"
        raise ConfigError(
            f"{source}: train_batch_size={total} != train_micro_batch_size_per_gpu {micro} x "
            f"gradient_accumulation_steps {gas} x world size {world} = {micro * gas * world}; valid: {valid}, "
            "or \"auto\"")
    return micro, gas, origin


def _say_what_is_not_used(ds: dict, source: str, notes: list[str], cfg: Any) -> None:
    """One info line for translated and unused keys; warnings for unknown keys and replacements."""
    ignored = ds_keys.ignored_keys(ds)
    if notes or ignored:
        parts = ([f"translated {'; '.join(notes)}"] if notes else []) + \
                ([f"not used under Lightning: {'; '.join(ignored)}"] if ignored else [])
        log.info("ds_config %s: %s", Path(source).name, " | ".join(parts))
    unknown = ds_keys.unknown_keys(ds)
    if unknown:
        log.warning("ds_config %s: DeepSpeed does not know %s and ignores it (a typo?)", Path(source).name,
                    ", ".join(unknown))
    optimizer, scheduler = ds.get("optimizer"), ds.get("scheduler")
    ours = cfg.get("optim", {}) if hasattr(cfg, "get") else {}
    if isinstance(optimizer, dict):
        target = (ours.get("optimizer") or {}).get("_target_", "the project's optimizer")
        log.warning("ds_config %s: \"optimizer\" (%s) replaces optim.optimizer (%s): DeepSpeed builds it from the "
                    "JSON; optim.* only fills its \"auto\" params", Path(source).name, optimizer.get("type"), target)
        if scheduler is None and ours.get("scheduler"):
            log.info("ds_config %s: no \"scheduler\" in the JSON: the project's schedule (optim.scheduler) drives "
                     "the JSON optimizer", Path(source).name)
    if isinstance(scheduler, dict):
        log.warning("ds_config %s: \"scheduler\" (%s) replaces optim.scheduler (the project's warmup + cosine)",
                    Path(source).name, scheduler.get("type"))


def _enabled(section: Any) -> bool | str | None:
    if not isinstance(section, dict):
        return None
    return section.get("enabled", False)  # DeepSpeed 0.19: a section without "enabled" is off


def _world_size(cfg: Any) -> int:
    devices = cfg.trainer.get("devices", 1)
    devices = devices if isinstance(devices, int) and devices > 0 else 1
    return devices * int(cfg.trainer.get("num_nodes", 1) or 1)
