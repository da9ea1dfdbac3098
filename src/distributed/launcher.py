"""Launch child ranks for a Hydra app without Lightning's Hydra pitfalls.

Lightning's `_hydra_subprocess_cmd` re-sends the parent's raw ``sys.argv`` to every child
rank. Under ``-m`` that includes the ``-m`` flag and the sweep lists, so each child starts
its own sweep, and children create their own timestamped output dirs (Lightning #11300,
lightning-hydra-template #393). Here a child gets exactly the overrides of *this job*
(``HydraConfig.overrides.task``) plus this job's output dir, so every rank composes the
same config and writes into the same run dir.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from dsdebug.distributed.liveness import ENV_PARENT, watch_children
from dsdebug.distributed.liveness import state as liveness_state

__all__ = ["HydraAwareLauncher", "HydraLauncherMixin", "hydra_child_command"]

log = logging.getLogger(__name__)


def hydra_child_command(local_rank: int) -> tuple[list[str], str | None]:
    """The command line that re-runs this Hydra job as one more rank."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_original_cwd

    hc = HydraConfig.get()
    script = Path(get_original_cwd(), sys.argv[0]).resolve()
    command = [sys.executable, str(script), *hc.overrides.task]
    command += [
        f'hydra.run.dir="{hc.runtime.output_dir}"',
        "hydra.mode=RUN",  # a preset like hparams_search=optuna sets MULTIRUN
        "hydra.output_subdir=null",  # only rank 0 writes .hydra/
        f"hydra.job.name=rank{local_rank}",  # per-rank log file: rank1.log
    ]
    return command, get_original_cwd()


class HydraAwareLauncher(_SubprocessScriptLauncher):
    """Lightning's script launcher, with child commands built from the Hydra job."""

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        """Lightning's ``launch`` without its ``_ChildProcessObserver``: that thread SIGKILLs rank 0
        within 5 s of a child's death, before rank 0 can name the dead rank (error line, finding);
        ``watch_children`` (liveness.py) watches the children instead and ends the job itself."""
        from lightning.fabric.utilities.distributed import _set_num_threads_if_needed

        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            if self.procs and not liveness_state.procs:  # not under Hydra: Lightning's own children, its observer
                from lightning.fabric.strategies.launchers.subprocess_script import _launch_process_observer

                _launch_process_observer(self.procs)
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)

    def _call_children_scripts(self) -> None:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return super()._call_children_scripts()
        self._check_can_spawn_children()
        self.procs = []
        env = self.cluster_environment
        os.environ["MASTER_ADDR"] = env.main_address
        os.environ["MASTER_PORT"] = str(env.main_port)
        os.environ["NODE_RANK"] = str(env.node_rank())
        os.environ["LOCAL_RANK"] = str(env.local_rank())
        os.environ["WORLD_SIZE"] = f"{self.num_processes * self.num_nodes}"
        for local_rank in range(1, self.num_processes):
            child_env = os.environ.copy()
            child_env["LOCAL_RANK"] = str(local_rank)
            child_env[ENV_PARENT] = str(os.getpid())  # the child exits if we die (liveness.py)
            if os.environ.get("PL_GLOBAL_SEED") is None:
                child_env.pop("PL_GLOBAL_SEED", None)
            command, cwd = hydra_child_command(local_rank)
            log.debug("launching rank %d: %s", local_rank, command)
            # DSDEBUG_RANK_SESSIONS=1: each child rank in a session of its own, as torchrun starts its
            # workers (under Linux autogroup scheduling a session is one CPU-share group; measured
            # +15 % wall in one noisy round with one shared session). Off by default: rank 0 stays in the
            # caller's session, so own sessions for the children only give them more CPU share than
            # rank 0 on a loaded machine, and log_sync then names rank 0 a straggler (seen in a healthy
            # 2-rank debug=full run). Ctrl-C stops every rank either way (reap_children / watch_parent).
            own_session = os.environ.get("DSDEBUG_RANK_SESSIONS", "0") == "1"
            self.procs.append(subprocess.Popen(command, env=child_env, cwd=cwd, start_new_session=own_session))
        watch_children(list(enumerate(self.procs, start=1)))
        return None


class HydraLauncherMixin:
    """Use `HydraAwareLauncher` wherever Lightning would use its script launcher."""

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if isinstance(self._launcher, _SubprocessScriptLauncher):
            self._launcher = HydraAwareLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
