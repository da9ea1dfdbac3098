"""Build callbacks and loggers from their config groups (lightning-hydra-template style)."""

from __future__ import annotations

import inspect
import logging
import re

import hydra
from lightning.pytorch import Callback
from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig

from dsdebug.errors import ConfigError

log = logging.getLogger(__name__)

_UNEXPECTED_KWARG = re.compile(r"unexpected keyword argument '(\w+)'")


def _instantiate_group(group: DictConfig | None, kind: str) -> list:
    objects = []
    if not group:
        return objects
    if not isinstance(group, DictConfig):
        raise TypeError(f"{kind} config must be a mapping of name -> config")
    for name, conf in group.items():
        if isinstance(conf, DictConfig) and "_target_" in conf:
            log.debug("instantiating %s %s <%s>", kind, name, conf._target_)
            try:
                objects.append(hydra.utils.instantiate(conf))
            except Exception as e:  # noqa: BLE001
                _raise_if_unknown_option(e, f"{'logger' if kind == 'logger' else 'callbacks'}.{name}", conf._target_)
                raise
    return objects


def _raise_if_unknown_option(error: BaseException, key: str, target: str) -> None:
    """`+logger.csv.bogus=1` -> one line naming logger.csv.bogus and the valid options."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, TypeError):
            match = _UNEXPECTED_KWARG.search(str(error))
            if match:
                try:
                    params = inspect.signature(hydra.utils.get_object(target)).parameters.values()
                    valid = ", ".join(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
                except (TypeError, ValueError, ImportError):
                    valid = "see its signature"
                raise ConfigError(f"{key}.{match.group(1)} is not an option of {target}; valid: {valid}") from None
        error = error.__cause__ or error.__context__


def instantiate_callbacks(cfg: DictConfig | None) -> list[Callback]:
    """Every entry of ``callbacks`` with a ``_target_``; ``~callbacks.<name>`` removes one."""
    return _instantiate_group(cfg, "callback")


def instantiate_loggers(cfg: DictConfig | None) -> list[Logger]:
    return _instantiate_group(cfg, "logger")
