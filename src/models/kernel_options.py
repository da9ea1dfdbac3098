"""The values of the model's kernel switches, parsed without torch: the config check refuses a bad one before
anything heavy is imported (``src/config/validate.py``), and the model code reads the same parse.

| key | values | default | what it switches (file) |
|---|---|---|---|
| ``model.compile`` | ``false`` / ``true`` | ``false`` | ``torch.compile`` of each decoder block's forward (``compile_blocks.py``) |
| ``model.cross_entropy`` | ``full`` / ``chunked`` | ``full`` | the next-token loss: chunked over the tokens, no fp32 copy of the whole logits (``chunked``), or one ``F.cross_entropy`` over an fp32 copy (``full``, the reference) (``lm_loss.py``) |
"""

from __future__ import annotations

from typing import Any

from dsdebug.errors import ConfigError

__all__ = ["COMPILE_KEY", "CROSS_ENTROPY_KEY", "CROSS_ENTROPY_MODES", "compile_setting", "cross_entropy_mode"]

COMPILE_KEY = "model.compile"
CROSS_ENTROPY_KEY = "model.cross_entropy"
CROSS_ENTROPY_MODES = ("chunked", "full")


def compile_setting(value: Any) -> bool:
    """``model.compile`` -> True / False; anything else is a ConfigError naming the key."""
    if value is None or value is False or (isinstance(value, str) and value.lower() in ("false", "off", "none")):
        return False
    if value is True or (isinstance(value, str) and value.lower() in ("true", "on")):
        return True
    raise ConfigError(f"{COMPILE_KEY}={value!r} is invalid; valid: false (eager), true (torch.compile each decoder "
                      "block, as torchtitan does; the first steps pay the compilation)")


def cross_entropy_mode(value: Any) -> str:
    """``model.cross_entropy`` -> "chunked" | "full"; anything else is a ConfigError naming the key."""
    if value is None:
        return "full"
    if isinstance(value, str) and value.lower() in CROSS_ENTROPY_MODES:
        return value.lower()
    raise ConfigError(f"{CROSS_ENTROPY_KEY}={value!r} is invalid; valid: chunked (over the tokens, no fp32 copy of "
                      "the whole logits), full (one cross_entropy over an fp32 copy of the logits: the reference)")
