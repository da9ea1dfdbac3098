"""Build callbacks and loggers from their config groups (lightning-hydra-template style), and the
other sections with a one-line error for a key their target does not take."""

from __future__ import annotations

import functools
import inspect
import logging
import re
from typing import Callable

import hydra
from lightning.pytorch import Callback
from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig

from dsdebug.errors import ConfigError, missing_extra

__all__ = ["instantiate_callbacks", "instantiate_loggers", "instantiate_section"]

log = logging.getLogger(__name__)

_UNEXPECTED_KWARG = re.compile(r"unexpected keyword argument '(\w+)'")
_CALLED = re.compile(r"Error in call to target '([\w.]+)'")
_FULL_KEY = re.compile(r"full_key: (\S+)")


def _instantiate_group(group: DictConfig | None, kind: str, arguments: dict[str, dict] | None = None,
                       keep: Callable[[DictConfig], bool] | None = None) -> list:
    objects = []
    if not group:
        return objects
    if not isinstance(group, DictConfig):
        raise TypeError(f"{kind} config must be a mapping of name -> config")
    for name, conf in group.items():
        if isinstance(conf, DictConfig) and "_target_" in conf and (keep is None or keep(conf)):
            log.debug("instantiating %s %s <%s>", kind, name, conf._target_)
            objects.append(instantiate_section(conf, f"{'logger' if kind == 'logger' else 'callbacks'}.{name}",
                                               **(arguments or {}).get(str(name), {})))
    return objects


def instantiate_section(conf, key: str, **kwargs):
    """``hydra.utils.instantiate(conf, **kwargs)``; a key the target does not take (``+strategy.bogus=1``)
    is a one-line ConfigError naming ``<key>.bogus`` and the valid options, not Hydra's traceback."""
    try:
        obj = hydra.utils.instantiate(conf, **kwargs)
        if isinstance(obj, functools.partial):  # `_partial_: true` (optimizer, scheduler): called later, check now
            try:
                inspect.signature(obj.func).bind_partial(*obj.args, **obj.keywords)
            except ValueError:  # a builtin without a signature: nothing to check
                pass
        return obj
    except Exception as e:  # noqa: BLE001
        target = conf.get("_target_") if hasattr(conf, "get") else None
        missing = missing_extra(e, _choice(key) or f"{key} ({target})")
        if missing is not None:  # strategy=zero3 without deepspeed: which extra installs it
            raise missing from e
        if isinstance(target, str):
            _raise_if_unknown_option(e, key, target)
        raise


def _choice(key: str) -> str | None:
    """``strategy=zero3`` for the section ``strategy`` when Hydra composed it (else None)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        group = key.split(".")[0]
        choice = HydraConfig.get().runtime.choices.get(group)
        return f"{group}={choice}" if choice and "." not in key else (key if choice else None)
    except ValueError:  # not under Hydra
        return None


def _options(target: str) -> list[str]:
    """Keyword arguments of ``target``; a class whose __init__ passes **kwargs on adds its bases'."""
    obj = hydra.utils.get_object(target)
    names: list[str] = list(getattr(obj, "OPTIONS", ()))  # keys a class takes from its **kwargs itself
    for fn in ([c.__init__ for c in obj.__mro__ if "__init__" in vars(c)] if inspect.isclass(obj) else [obj]):
        params = inspect.signature(fn).parameters.values()
        names += [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                  and p.name != "self" and p.name not in names]
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    return names


def _raise_if_unknown_option(error: BaseException, key: str, target: str) -> None:
    """`+logger.csv.bogus=1` -> one line naming logger.csv.bogus and the valid options."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        called = _CALLED.search(str(error))  # Hydra's InstantiationException: the node that failed
        where = _FULL_KEY.search(str(error)) if called and not isinstance(error, TypeError) else None
        if where and where.group(1) != key:  # a nested node failed, not the section's own target
            nested = where.group(1)
            key = nested if nested.startswith(key + ".") else f"{key}.{nested}"  # sections built from a plain dict
            target = called.group(1)
        if isinstance(error, TypeError):
            match = _UNEXPECTED_KWARG.search(str(error))
            if match:
                try:
                    valid = ", ".join(_options(target)) or "none"
                except (TypeError, ValueError, ImportError):
                    valid = "see its signature"
                hint = ""
                if "DeepSpeed" in target:  # e.g. stage3_max_reuse_distance: Lightning exposes only some keys
                    hint = ("; any other DeepSpeed key goes in a ds_config.json: "
                            "strategy=deepspeed_json strategy.config=<file>")
                raise ConfigError(f"{key}.{match.group(1)} is not an option of {target}; valid: {valid}{hint}") from None
        error = error.__cause__ or error.__context__


def instantiate_callbacks(cfg: DictConfig | None, keep: Callable[[DictConfig], bool] | None = None) -> list[Callback]:
    """Every entry of ``callbacks`` with a ``_target_`` (and for which ``keep`` says yes); ``~callbacks.<name>``
    removes one."""
    return _instantiate_group(cfg, "callback", keep=keep)


def instantiate_loggers(cfg: DictConfig | None, arguments: dict[str, dict] | None = None) -> list[Logger]:
    """Every entry of ``logger``; ``arguments``: per logger name, values passed over its config's (the run's
    resume and sweep identity: the config itself is read-only after prepare)."""
    return _instantiate_group(cfg, "logger", arguments)
