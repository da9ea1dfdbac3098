"""Filling a ds_config.json's "auto" values at strategy setup, the way HF Trainer does.

HF's ``HfTrainerDeepSpeedConfig`` fills "auto" from ``TrainingArguments`` and the model. Here
the same keys come from the run (trainer, the module's optimizer settings = ``optim.*``, the
model's hidden size, the schedule's warmup and total steps):

| key | filled with |
|---|---|
| train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps, gradient_clipping | removed: Lightning sets them from the trainer (already settled, ds_config.py) |
| fp16.enabled / bf16.enabled | whether trainer.precision is 16-mixed / bf16-mixed |
| optimizer.params.lr, betas, eps, weight_decay | optim.optimizer (lr after optim.scale_lr_base_batch_size scaling) |
| scheduler.params.warmup_min_lr / warmup_max_lr | 0 / the optimizer's lr |
| scheduler.params.warmup_num_steps / total_num_steps | optim.scheduler's warmup (ratio x total) / the run's optimizer steps |
| scheduler.params.warmup_min_ratio / cos_min_ratio | 0 / optim.scheduler.min_lr_ratio (WarmupCosineLR) |
| zero_optimization.reduce_bucket_size | hidden_size^2 |
| zero_optimization.stage3_prefetch_bucket_size / stage3_param_persistence_threshold | 0.9 hidden_size^2 / 10 hidden_size |

Without an ``optimizer`` section the module builds the optimizer from ``optim.*``; then an absent
``zero_allow_untested_optimizer`` is set true, as Lightning does for its own ZeRO configs.

Any "auto" left is a one-line error naming it. Runs on every rank (no collective).
"""

from __future__ import annotations

import math
from typing import Any

from dsdebug.errors import ConfigError

__all__ = ["resolve_auto_values"]

# Keys that Lightning fills itself when absent: an "auto" there just means "absent".
_LIGHTNING_FILLED = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping")
_ZERO_AUTO = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}
_OPTIMIZER_AUTO = ("lr", "betas", "eps", "weight_decay")


def resolve_auto_values(config: dict | None, module: Any, source: str | None = None) -> list[str]:
    """Resolve "auto" in place; return what was filled ("key=value"); error on any "auto" left."""
    if not config:
        return []
    where = source or "deepspeed config"
    trainer = getattr(module, "trainer", None) if module is not None else None
    filled: list[str] = []
    for key in _LIGHTNING_FILLED + ("train_batch_size",):
        if config.get(key) == "auto":
            del config[key]  # Lightning/DeepSpeed derive it from the trainer
    # A number Lightning also sets must agree with the trainer (apply_ds_json_to_cfg made it so);
    # Lightning refuses the key, so drop it once checked.
    accum = config.get("gradient_accumulation_steps")
    if accum is not None and trainer is not None:
        if int(accum) != trainer.accumulate_grad_batches:
            raise ConfigError(
                f"{where}: gradient_accumulation_steps={accum} but trainer.accumulate_grad_batches="
                f"{trainer.accumulate_grad_batches}; make them equal or use \"auto\""
            )
        del config["gradient_accumulation_steps"]
    _precision(config, trainer, filled)
    if "optimizer" not in config and "zero_allow_untested_optimizer" not in config:
        # the module builds the optimizer from optim.* (any torch optimizer, as with the
        # strategy=zero* configs, where Lightning sets the same flag)
        config["zero_allow_untested_optimizer"] = True
    settings = _optimizer_settings(module)
    _fill(config.get("optimizer"), "optimizer.params", {k: settings.get(k) for k in _OPTIMIZER_AUTO}, filled)
    if isinstance(config.get("scheduler"), dict):
        _fill(config["scheduler"], "scheduler.params", _schedule_values(module, trainer, settings), filled)
    hidden = _hidden_size(module)
    zero = config.get("zero_optimization") or {}
    for key, fn in _ZERO_AUTO.items():
        if zero.get(key) == "auto":
            if hidden is None:
                del zero[key]  # DeepSpeed's default
                filled.append(f"zero_optimization.{key}=DeepSpeed's default (the model has no hidden_size)")
            else:
                zero[key] = fn(hidden)
                filled.append(f"zero_optimization.{key}={zero[key]}")
    leftover = _find_auto(config)
    if leftover:
        raise ConfigError(
            f"{where}: cannot resolve \"auto\" for {', '.join(leftover)}; resolvable: the batch keys, "
            f"gradient_clipping, fp16/bf16.enabled, optimizer.params.{{{', '.join(_OPTIMIZER_AUTO)}}} (from optim.*), "
            "scheduler.params.{warmup_min_lr, warmup_max_lr, warmup_num_steps, total_num_steps, warmup_min_ratio, "
            f"cos_min_ratio}}, zero_optimization.{{{', '.join(_ZERO_AUTO)}}}; give a number instead"
        )
    return filled


def _precision(config: dict, trainer: Any, filled: list[str]) -> None:
    precision = str(getattr(trainer, "precision", "32-true")) if trainer is not None else "32-true"
    for key, wanted in (("fp16", precision.startswith("16")), ("bf16", precision.startswith("bf16"))):
        section = config.get(key)
        if isinstance(section, dict) and section.get("enabled") == "auto":
            section["enabled"] = wanted
            filled.append(f"{key}.enabled={str(wanted).lower()}")
        if isinstance(section, dict) and not wanted and section.get("enabled") is True:
            section["enabled"] = False  # e.g. fp16 in the JSON downgraded to bf16 on a CPU without fp16


def _fill(section: Any, prefix: str, values: dict[str, Any], filled: list[str]) -> None:
    params = section.get("params") if isinstance(section, dict) else None
    if not isinstance(params, dict):
        return
    for key, value in values.items():
        if params.get(key) == "auto" and value is not None:
            params[key] = value
            filled.append(f"{prefix}.{key}={value}")


def _optimizer_settings(module: Any) -> dict[str, Any]:
    """lr, betas, eps, weight_decay of the module's optimizer factory (Hydra's partial of optim.optimizer)."""
    factory = getattr(module, "optimizer_factory", None)
    keywords = dict(getattr(factory, "keywords", None) or {})
    if "betas" in keywords:
        keywords["betas"] = [float(b) for b in keywords["betas"]]
    return {k: keywords[k] for k in _OPTIMIZER_AUTO if k in keywords}


def _schedule_values(module: Any, trainer: Any, settings: dict[str, Any]) -> dict[str, Any]:
    total = None
    if trainer is not None:
        steps = trainer.estimated_stepping_batches
        total = int(steps) if math.isfinite(steps) else int(trainer.max_steps)
    schedule = dict(getattr(getattr(module, "scheduler_factory", None), "keywords", None) or {})
    warmup = None
    if total is not None:
        from dsdebug.models.optim import warmup_length

        warmup = max(1, warmup_length(total, schedule.get("warmup_ratio", 0.0), schedule.get("warmup_steps")))
    return {"warmup_min_lr": 0, "warmup_max_lr": settings.get("lr"), "warmup_num_steps": warmup,
            "total_num_steps": total, "warmup_min_ratio": 0.0, "cos_min_ratio": schedule.get("min_lr_ratio")}


def _hidden_size(module: Any) -> int | None:
    net = getattr(module, "net", None)
    cfg = getattr(net, "config", None)
    for candidate in (cfg, getattr(cfg, "text_config", None)):
        size = getattr(candidate, "hidden_size", None)
        if isinstance(size, int):
            return size
        sizes = getattr(candidate, "hidden_sizes", None)
        if sizes:
            return max(sizes)
    return None


def _find_auto(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        out = []
        for k, v in node.items():
            out += _find_auto(v, f"{prefix}{k}.")
        return out
    return [prefix.rstrip(".")] if node == "auto" else []
