"""Build callbacks and loggers from their config groups (lightning-hydra-template style)."""

from __future__ import annotations

import logging

import hydra
from lightning.pytorch import Callback
from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig

log = logging.getLogger(__name__)


def _instantiate_group(group: DictConfig | None, kind: str) -> list:
    objects = []
    if not group:
        return objects
    if not isinstance(group, DictConfig):
        raise TypeError(f"{kind} config must be a mapping of name -> config")
    for name, conf in group.items():
        if isinstance(conf, DictConfig) and "_target_" in conf:
            log.debug("instantiating %s %s <%s>", kind, name, conf._target_)
            objects.append(hydra.utils.instantiate(conf))
    return objects


def instantiate_callbacks(cfg: DictConfig | None) -> list[Callback]:
    """Every entry of ``callbacks`` with a ``_target_``; ``~callbacks.<name>`` removes one."""
    return _instantiate_group(cfg, "callback")


def instantiate_loggers(cfg: DictConfig | None) -> list[Logger]:
    return _instantiate_group(cfg, "logger")
