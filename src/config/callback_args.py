"""A check's arguments, checked from the config before torch is imported.

Each check declares its argument rules on its class (``arg_rules``, the rules of ``config/args.py``) and
applies them in ``__init__``; instantiating a check imports its module, and with it torch and Lightning
(~10 s), so ``callbacks.grad_monitor.every_n_steps=-1`` would only fail then. The declarations are also
written as data, ``config/check_args.json`` (``python -m dsdebug.callbacks.arg_table``; a test fails
when it and the classes disagree). Here that table is read -- no check is imported, no source is
read -- and its rules applied to the composed values: the same rules, the same one-line error, in
well under a second. Unknown keys (``+callbacks.grad_monitor.bogus=1``) are refused with the valid
ones, for a check whose ``__init__`` takes no ``**kwargs``. A rule that depends on another argument's
value is not declared: ``__init__`` applies it when the check is built. A class that is not a check of
this package (Lightning's callbacks, the user's) is left to its own ``__init__``.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from dsdebug.config.args import Rule
from dsdebug.errors import ConfigError

__all__ = ["TABLE_FILE", "check_callback_args", "declared"]

TABLE_FILE = Path(__file__).with_name("check_args.json")
_MISSING = object()


@lru_cache(maxsize=1)
def _table() -> dict[str, Any]:
    return json.loads(TABLE_FILE.read_text())


def declared(target: str) -> tuple[str, list[str] | None, dict[str, Rule]] | None:
    """(config name, ``__init__`` parameters or None for ``**kwargs``, rules) of the check a ``_target_`` names
    (``dsdebug.callbacks.GradMonitor`` or ``dsdebug.callbacks.grad_monitor.GradMonitor``); None: not a check."""
    module, _, class_name = target.rpartition(".")
    entry = _table().get(class_name)
    if entry is None or module not in ("dsdebug.callbacks", entry["module"], entry["module"].rsplit(".check", 1)[0]):
        return None
    return entry["name"], entry["params"], {k: Rule.from_data(r) for k, r in entry["rules"].items()}


def check_callback_args(cfg: DictConfig) -> None:
    """Every ``callbacks.<name>`` whose ``_target_`` is a check: unknown keys and the values its declared rules
    refuse are a ConfigError, the same line ``__init__`` would raise."""
    group = cfg.get("callbacks")
    if not isinstance(group, DictConfig):
        return
    for key, conf in group.items():
        if not isinstance(conf, DictConfig) or not isinstance(conf.get("_target_"), str):
            continue
        found = declared(conf._target_)
        if found is None:
            continue
        name, params, rules = found
        given = {k: _value(conf, k) for k in conf if not str(k).startswith("_")}
        if params is not None:
            unknown = [k for k in given if k not in params]
            if unknown:
                raise ConfigError(f"callbacks.{key}.{unknown[0]} is not an option of {conf._target_}; "
                                  f"valid: {', '.join(params)}")
        for arg, rule in rules.items():
            value = given.get(arg, _MISSING)
            if value is not _MISSING and not rule.test(value):
                raise ConfigError(f"callbacks.{name or key}.{arg}={value!r} is invalid; valid: {rule.valid}")


def _value(conf: DictConfig, key: str) -> Any:
    try:
        value = conf[key]
    except Exception:  # noqa: BLE001 - an interpolation only Hydra resolves: left to __init__
        return _MISSING
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value
