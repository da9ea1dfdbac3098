"""Processes started by an external launcher: torchrun (and ``accelerate launch``, which runs
torchrun), ``srun`` under SLURM, DeepSpeed's ``deepspeed`` launcher, or any launcher that sets
torch's env (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT: mpirun wrappers, Kubernetes).

The launcher owns the world: how many processes, on how many nodes. Lightning reads it through
its cluster environments (``TorchElasticEnvironment``, ``SLURMEnvironment``,
``LightningEnvironment``) but demands that ``trainer.devices x trainer.num_nodes`` agree and
otherwise raises deep in the Trainer. Here, with the other config checks (before anything is
built), the config adopts the launcher's processes per node and node count; only a value the
user set explicitly on the command line (``trainer.devices=``/``trainer.num_nodes=``) and that
contradicts the launcher is an error, one line saying which values are valid. Every rank runs
it; only rank 0 prints (src/trainer/cli.py).

``src/distributed/run_dir.py`` does the part that must happen before Hydra (one run dir per job).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping

from dsdebug.errors import ConfigError

__all__ = ["LauncherWorld", "launcher_world", "detect"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LauncherWorld:
    launcher: str  # torchrun | srun | deepspeed | env
    world: int
    per_node: int | None  # None: the launcher does not say (plain env)
    rank: int
    seen: str  # the variables, for messages

    @property
    def nodes(self) -> int | None:
        return None if not self.per_node else max(1, self.world // self.per_node)


def _slurm_batch(env: Mapping[str, str]) -> bool:
    # Lightning's SLURMEnvironment.detect(): an interactive allocation (salloc bash) is not a launch
    return "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive")


def detect(env: Mapping[str, str] | None = None) -> LauncherWorld | None:
    """The external launcher that started this process, or None (a plain ``python train.py``, or
    a child rank started by our own launcher, which passes the run dir itself)."""
    env = os.environ if env is None else env
    if env.get("DSDEBUG_LAUNCHER_PID"):  # our own child rank (src/distributed/launcher.py)
        return None
    if env.get("TORCHELASTIC_RUN_ID") is not None:
        world = int(env.get("WORLD_SIZE", "1"))
        per_node = int(env.get("LOCAL_WORLD_SIZE", world))
        return LauncherWorld("torchrun", world, per_node, int(env.get("RANK", "0")),
                             f"WORLD_SIZE={world}, LOCAL_WORLD_SIZE={per_node}")
    if _slurm_batch(env):
        world = int(env["SLURM_NTASKS"])
        nodes = int(env.get("SLURM_NNODES", "1"))
        per_node = int(env.get("SLURM_NTASKS_PER_NODE", str(world // max(nodes, 1))).split("(")[0])
        return LauncherWorld("srun", world, per_node, int(env.get("SLURM_PROCID", "0")),
                             f"SLURM_NTASKS={world}, SLURM_NNODES={nodes}")
    if "CROSS_RANK" in env and "LOCAL_SIZE" in env and "LOCAL_RANK" in env:  # deepspeed/launcher/launch.py
        world = int(env.get("WORLD_SIZE", "1"))
        per_node = int(env["LOCAL_SIZE"])
        return LauncherWorld("deepspeed", world, per_node, int(env.get("RANK", "0")),
                             f"WORLD_SIZE={world}, LOCAL_SIZE={per_node}")
    if "LOCAL_RANK" in env and "WORLD_SIZE" in env and "RANK" in env:
        world = int(env["WORLD_SIZE"])
        per_node = int(env["LOCAL_WORLD_SIZE"]) if env.get("LOCAL_WORLD_SIZE") else None
        return LauncherWorld("env", world, per_node, int(env["RANK"]), f"WORLD_SIZE={world}")
    return None


def _explicit_trainer_keys() -> set[str]:
    """trainer.devices / trainer.num_nodes given on the command line (not by a preset)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        task = list(HydraConfig.get().overrides.task)
    except ValueError:  # not under Hydra (a test composing the config itself)
        return set()
    keys = {o.split("=", 1)[0].lstrip("+~") for o in task if "=" in o}
    return {k.split(".", 1)[1] for k in keys if k in ("trainer.devices", "trainer.num_nodes")}


def launcher_world(cfg: Any) -> dict[str, int]:
    """The ``trainer`` values (devices, num_nodes) that the launcher's world fixes and the config does not
    already have -- ``prepare`` adopts them (config/prepare.py); this function writes nothing. An explicit
    contradiction is a ConfigError."""
    world = detect()
    if world is None:
        return {}
    t = cfg.trainer
    devices, nodes = t.devices, int(t.get("num_nodes", 1) or 1)
    explicit = _explicit_trainer_keys()
    if world.per_node is None:  # the launcher only says the world size: the config must multiply to it
        if isinstance(devices, int) and devices * nodes != world.world:
            raise ConfigError(f"trainer.devices={devices} x trainer.num_nodes={nodes} does not match the processes "
                              f"{world.launcher} started ({world.seen}); set them so that their product is "
                              f"{world.world}")
        return {}
    want = {"devices": world.per_node, "num_nodes": world.nodes}
    have = {"devices": devices, "num_nodes": nodes}
    wrong = [k for k in want if have[k] != want[k]]
    if any(k in explicit and have[k] not in ("auto", -1) for k in wrong):  # "auto": whatever the launcher says
        raise ConfigError(
            f"trainer.devices={t.devices} x trainer.num_nodes={nodes} does not match the processes {world.launcher} "
            f"started ({world.seen}); valid: trainer.devices={want['devices']} trainer.num_nodes={want['num_nodes']} "
            "(or leave both out: the launcher's world is used)"
        )
    for key in wrong:
        if world.rank == 0:
            log.info("trainer.%s=%s -> %s: the world %s started (%s)", key, have[key], want[key],
                     world.launcher, world.seen)
    return {key: want[key] for key in wrong}
