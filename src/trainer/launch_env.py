"""The launcher's world (torchrun, srun) against the config's ``trainer.devices x trainer.num_nodes``.

Under ``torchrun`` or ``srun`` the launcher has already started every process; Lightning only
checks that the config agrees and otherwise raises a ValueError with a traceback deep in the
Trainer. This check runs with the other config checks (before anything is built) and says in
one line which keys to set. It reads the same environments Lightning detects
(``TorchElasticEnvironment``, ``SLURMEnvironment``) and imports them only when their variables
are present. Every rank runs it; only rank 0 prints (src/trainer/cli.py).
"""

from __future__ import annotations

import os
from typing import Any

from src.errors import ConfigError


def check_launcher_matches(cfg: Any) -> None:
    if os.environ.get("TORCHELASTIC_RUN_ID") is not None:
        from lightning.fabric.plugins.environments import TorchElasticEnvironment

        if TorchElasticEnvironment.detect():
            world = int(os.environ.get("WORLD_SIZE", "1"))
            per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            _compare(cfg, "torchrun", world, per_node, f"WORLD_SIZE={world}, LOCAL_WORLD_SIZE={per_node}")
    elif "SLURM_NTASKS" in os.environ:
        from lightning.fabric.plugins.environments import SLURMEnvironment

        if SLURMEnvironment.detect():
            world = int(os.environ["SLURM_NTASKS"])
            nodes = int(os.environ.get("SLURM_NNODES", "1"))
            per_node = int(os.environ.get("SLURM_NTASKS_PER_NODE", world // max(nodes, 1)).split("(")[0])
            _compare(cfg, "srun", world, per_node, f"SLURM_NTASKS={world}, SLURM_NNODES={nodes}")


def _compare(cfg: Any, launcher: str, world: int, per_node: int, seen: str) -> None:
    devices, nodes = cfg.trainer.devices, int(cfg.trainer.get("num_nodes", 1) or 1)
    if devices in ("auto", -1):
        devices = per_node  # Lightning takes the launcher's processes per node
    if isinstance(devices, int) and devices * nodes == world and devices == per_node:
        return
    want_nodes = max(1, world // max(per_node, 1))
    raise ConfigError(
        f"trainer.devices={cfg.trainer.devices} x trainer.num_nodes={nodes} does not match the processes {launcher} "
        f"started ({seen}); valid: trainer.devices={per_node} trainer.num_nodes={want_nodes}"
    )
