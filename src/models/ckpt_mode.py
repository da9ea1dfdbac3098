"""The values ``model.gradient_checkpointing`` takes, parsed without torch: the config check refuses a
bad one before anything heavy is imported, and ``grad_ckpt`` reads the same parse when it wraps the net."""

from __future__ import annotations

from typing import Any

from dsdebug.errors import ConfigError

__all__ = ["MODES", "KEY", "checkpointing_mode"]

MODES = ("reentrant", "non_reentrant")
KEY = "model.gradient_checkpointing"


def checkpointing_mode(value: Any) -> str | None:
    """``model.gradient_checkpointing`` -> None (off), "reentrant" or "non_reentrant"; else ConfigError."""
    if value is None or value is False or (isinstance(value, str) and value.lower() in ("false", "off", "none")):
        return None
    if value is True or (isinstance(value, str) and value.lower() in ("true", "on")):
        return "non_reentrant"
    if isinstance(value, str) and value.lower() in MODES:
        return value.lower()
    raise ConfigError(f"{KEY}={value!r} is invalid; valid: false, true (= non_reentrant), reentrant, non_reentrant")
