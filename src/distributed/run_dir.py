"""One run dir per job, whoever started the processes — settled before Hydra composes anything.

Hydra names a run dir ``logs/<task>/runs/${now:...}``: evaluated in each process, so every
process an external launcher starts (torchrun, srun, ``deepspeed``) would get its own dir, and
rank 0's findings and report would silently cover rank 0 only. Our own launcher passes its dir
to the ranks it starts (src/distributed/launcher.py); here the ranks of an external launch agree:

- under SLURM the name derives from the job: ``slurm-<SLURM_JOB_ID>`` (an array task:
  ``slurm-<SLURM_ARRAY_JOB_ID>_<SLURM_ARRAY_TASK_ID>``). Every task computes it alone, and a
  requeued job (same id) lands in the same dir, so ``resume=auto`` continues in place;
- otherwise rank 0 decides (the usual timestamp) and shares it through a TCPStore at the
  launcher's MASTER_ADDR:MASTER_PORT: torchrun's agent store (it lives for the whole torchrun job,
  so a worker group restarted by ``--max-restarts`` gets the same dir back), or one rank 0 hosts
  as the multi-tenant store that ``init_process_group`` later shares (torch's own c10d path).

The name reaches conf/hydra/default.yaml through ``DSDEBUG_RUN_ID``. Ranks other than 0 log to
``rank<r>.log`` in that dir and leave ``.hydra/`` to rank 0. An explicit ``hydra.run.dir=`` wins
(every rank must then be given the same one). DeepSpeed's launcher appends ``--local_rank=<n>``
to the command line; it is taken off here (LOCAL_RANK is in the environment too).
"""

from __future__ import annotations

import os
import sys
from datetime import datetime, timedelta
from typing import Any

from dsdebug.distributed.launch_env import LauncherWorld, detect

__all__ = ["AGREE_TIMEOUT_S", "ENV_RUN_ID", "agree", "main_argv", "slurm_run_id", "strip_local_rank"]

ENV_RUN_ID = "DSDEBUG_RUN_ID"
_KEY = "dsdebug/run_id"
AGREE_TIMEOUT_S = 600  # how long a rank waits for rank 0 to name the dir (ranks of a job start together)
_stores: list[Any] = []  # keeps rank 0's store server up until init_process_group shares it


def strip_local_rank(argv: list[str]) -> list[str]:
    """Take DeepSpeed's ``--local_rank=<n>`` (or ``--local_rank <n>``, ``--local-rank``) off Hydra's argv."""
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in ("--local_rank", "--local-rank"):
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "0")
            skip = "=" not in arg
            os.environ.setdefault("LOCAL_RANK", value)
            continue
        out.append(arg)
    return out


def slurm_run_id(env: dict[str, str] | os._Environ) -> str | None:
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"slurm-{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return f"slurm-{env['SLURM_JOB_ID']}" if env.get("SLURM_JOB_ID") else None


def _agreed_via_store(world: LauncherWorld, proposal: str) -> str:
    from torch.distributed import TCPStore

    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    timeout = timedelta(seconds=AGREE_TIMEOUT_S)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's agent hosts it
        store = TCPStore(addr, port, is_master=False, timeout=timeout)
    else:  # the same store init_process_group creates (torch.distributed.rendezvous._create_c10d_store)
        store = TCPStore(addr, port, world_size=None, is_master=world.rank == 0, timeout=timeout,
                         multi_tenant=True)
        _stores.append(store)
    if world.rank == 0:  # the first rank 0 of this launcher job names it; a restarted one gets it back
        return store.compare_set(_KEY, "", proposal).decode()
    return store.get(_KEY).decode()


def agree(argv: list[str]) -> list[str]:
    """The command line Hydra should see in this process (and DSDEBUG_RUN_ID set when needed)."""
    argv = strip_local_rank(argv)
    world = detect()
    if world is None:
        return argv
    if world.launcher == "deepspeed":  # Lightning's LightningEnvironment reads NODE_RANK
        os.environ.setdefault("NODE_RANK", os.environ.get("CROSS_RANK", "0"))
    explicit_dir = any(a.split("=", 1)[0].lstrip("+") == "hydra.run.dir" for a in argv)
    if any(a in ("-m", "--multirun") for a in argv) or any(a.startswith("-") and a != "--" for a in argv):
        return argv  # a sweep, --cfg, --help: Hydra's own business
    if not explicit_dir and ENV_RUN_ID not in os.environ:
        # a batch job's id (torchrun inside sbatch too); not an interactive allocation's (salloc bash)
        name = slurm_run_id(os.environ) if os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive") else None
        if name is None and world.world > 1:
            name = _agreed_via_store(world, datetime.now().strftime("%Y-%m-%d_%H-%M-%S-%f"))
        if name is not None:
            os.environ[ENV_RUN_ID] = name
    if world.rank != 0 and not any(a.startswith("hydra.job.name=") for a in argv):  # a sweep job names its own
        argv = [*argv, "hydra.output_subdir=null", f"hydra.job.name=rank{world.rank}"]
    return argv


def main_argv() -> list[str]:
    return agree(sys.argv[1:])
