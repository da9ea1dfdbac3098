"""Hydra callback (conf/hydra/default.yaml): the hash seed a YAML sets, matched once the config is composed.

``fix_hash_seed`` (hash_seed.py) chose ``PYTHONHASHSEED`` from the command line before anything was imported;
an experiment or preset YAML may set ``callbacks.reproducibility.hash_seed`` to another. Hydra calls
``on_run_start`` with the composed config before it makes the run dir, so the process re-executes with the
composed seed there (hash_seed.py ``match_config``) and leaves no half-made run dir behind.
"""

from __future__ import annotations

from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from dsdebug.distributed.hash_seed import match_config

__all__ = ["HashSeedCheck"]


class HashSeedCheck(Callback):
    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        match_config(config)
