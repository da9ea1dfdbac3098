"""``instantiate_callbacks`` / ``instantiate_loggers`` as in lightning-hydra-template: every entry of the
group with a ``_target_`` is built; the dsdebug checks are entries like any other callback."""

import hydra
from lightning import Callback
from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig


def instantiate_callbacks(callbacks_cfg: DictConfig | None) -> list[Callback]:
    return [hydra.utils.instantiate(cb) for cb in (callbacks_cfg or {}).values()
            if isinstance(cb, DictConfig) and "_target_" in cb]


def instantiate_loggers(logger_cfg: DictConfig | None) -> list[Logger]:
    return [hydra.utils.instantiate(lg) for lg in (logger_cfg or {}).values()
            if isinstance(lg, DictConfig) and "_target_" in lg]
