"""The training command: ``dsdebug-train [group=option ...] [key=value ...]`` (installed), or
``python train.py ...`` from a checkout (which only finds this package), or ``python -m dsdebug.train ...``
— one Hydra CLI, and this is its one entry: ``main`` (the hash seed, startup signals, the composition
precheck, ``@hydra.main``) and ``run``, the task function (sweep dispatch, prepare, train or the doctor,
exit codes).

compose (Hydra, conf/train.yaml) -> precheck -> prepare -> build -> fit -> export -> report.
Examples: ``dsdebug-train strategy=zero3 trainer=ddp_sim``,
``dsdebug-train -m optim.lr=1e-3,3e-3 strategy=zero2,zero3 trainer=ddp_sim trainer.max_steps=5``.

The config tree is the checkout's ``conf/``, shipped in the package as ``dsdebug.conf`` (package
data), so the command works from any directory. Logs and data caches go under
``$PROJECT_ROOT`` (default: the current directory; a checkout's ``train.py`` sets its own root).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["ENV_ENTRY", "config_dir", "main", "run"]

ENV_ENTRY = "DSDEBUG_ENTRY"  # the script a sweep job re-runs (submitit pickles the task function)
_OWN_FULL_ERROR = "DSDEBUG_HYDRA_FULL_ERROR"  # HYDRA_FULL_ERROR was set by us, not by the user


def config_dir() -> Path:
    """The config tree: a checkout's ``conf/`` next to ``src/``, else the installed ``dsdebug.conf``."""
    checkout = Path(__file__).resolve().parents[1] / "conf"
    if (checkout / "train.yaml").is_file():
        return checkout
    spec = importlib.util.find_spec("dsdebug.conf")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("error: dsdebug's config tree (dsdebug.conf) is not installed; valid: pip install dsdebug "
                         "(or run train.py from a checkout)")
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def main(entry: str | None = None) -> None:
    from dsdebug.distributed.hash_seed import fix_hash_seed

    fix_hash_seed(sys.argv[1:])  # every rank hashes str alike: re-executes once when PYTHONHASHSEED is unset
    from dsdebug.distributed.startup_signals import record_from_now

    record_from_now()  # a preemption signal while the run starts is recorded, not fatal
    try:
        import hydra
    except ModuleNotFoundError as e:  # a core install: the checks and the report, not the training command
        from dsdebug.errors import fail, missing_extra

        fail(str(missing_extra(e, "dsdebug-train / train.py") or e))

    from dsdebug.trainer.cli import composition_error, precheck_overrides
    from dsdebug.distributed.launch_env import detect
    from dsdebug.distributed.run_dir import main_argv

    os.environ.setdefault("PROJECT_ROOT", os.getcwd())
    os.environ.setdefault(ENV_ENTRY, str(Path(entry or sys.argv[0]).resolve()))
    conf = config_dir()
    started = []

    @hydra.main(version_base="1.3", config_path=str(conf), config_name="train")
    def task(cfg):
        # a submitit job runs this function, pickled, under its own argv
        started.append(True)
        return run(cfg, script=os.environ.get(ENV_ENTRY))

    sys.argv[1:] = main_argv()  # torchrun / srun / deepspeed: one run dir for every rank of the job
    if any(a in ("-m", "--multirun") for a in sys.argv[1:]) and (os.environ.get("LOCAL_RANK", "0") == "0"
                                                                 or detect() is not None):
        # a sweep: every job composed now, before any runs (each job then composes its own, once)
        precheck_overrides(sys.argv[1:], conf, "train")
    # a single run is composed once, by @hydra.main; an error composing it reaches us instead of Hydra's
    # several-line report (the hash seed a YAML sets: distributed/hash_seed.py HashSeedCheck, a Hydra callback)
    ours = os.environ.get("HYDRA_FULL_ERROR") in (None, "") or os.environ.get(_OWN_FULL_ERROR) == "1"
    if ours:
        os.environ["HYDRA_FULL_ERROR"] = os.environ[_OWN_FULL_ERROR] = "1"
    try:
        task()
    except Exception as e:  # noqa: BLE001 - before the task function: the config did not compose
        if started or not ours:
            raise
        from dsdebug.errors import fail

        fail(composition_error(e, sys.argv[1:], conf, "train"))


def _doctor_asked(cfg) -> bool:
    """``doctor=true``: the preflight doctor (src/doctor/) runs instead of training."""
    value = cfg.get("doctor", False)
    if value is not True and value not in (False, None):
        from dsdebug.errors import fail

        fail(f"doctor={value!r} is invalid; valid: true, false")
    return value is True


def run(cfg: Any, script: str | None = None) -> float | None:
    """The Hydra task function: a multirun job is run in its own process tree (``script``: the
    entry point to run it with; a submitit job process has submitit's argv); else prepare, then
    ``trainer.entry.train`` -- or the preflight doctor (``doctor=true``, src/doctor/) -- with one line
    and an exit code for every way it can end (trainer/cli.py classify)."""
    import time

    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from dsdebug.distributed import startup_signals
    from dsdebug.errors import PreemptedAtStartup, fail
    from dsdebug.trainer.cli import classify, record_crash, reported_a_death

    if HydraConfig.get().mode == RunMode.MULTIRUN:
        from dsdebug.distributed.sweep import run_job_in_subprocess

        startup_signals.settle(())  # the sweep's own process: signals act as always (each job records its own)
        return run_job_in_subprocess(cfg, script)
    from dsdebug.config.prepare import prepare

    from dsdebug.distributed.console import filter_known_warnings, quiet_console

    filter_known_warnings()
    started = time.time()
    doctor = _doctor_asked(cfg)  # a bad value: one line, before anything is prepared
    try:
        plan = prepare(cfg)  # validates first, before the heavy imports: bad input fails in ~1 s
        pre = cfg.get("preemption") or {}
        startup_signals.settle(list(pre.get("signals", startup_signals.DEFAULT_SIGNALS)) if pre.get("enabled", True)
                               else ())
        startup_signals.stop_if_received("while the config was composed")
        from dsdebug.trainer.entry import train

        startup_signals.stop_if_received("while the training stack was imported")

        if doctor:
            from dsdebug.doctor.entry import doctor as train
        quiet_console()  # after importing lightning: its import may add a console handler of its own
        from dsdebug.trainer.allocator import tune_malloc

        tune_malloc(cfg.get("malloc_tuning", True))  # every rank, before the model and data exist
        metrics = train(plan)
    except PreemptedAtStartup as e:  # before the first step: status preempted, exit 0, nothing to save
        from dsdebug.checkpoint.startup_preemption import end_preempted_at_startup

        end_preempted_at_startup(cfg, e, started)
        return None
    except (KeyboardInterrupt, SystemExit) as e:  # Ctrl-C: Lightning turns it into sys.exit(1)
        record_crash("interrupted", 130, "interrupted (Ctrl-C / SIGINT)", e)
        raise
    except Exception as e:  # noqa: BLE001
        status, code, message = classify(e)
        record_crash(status, code, message or f"{type(e).__name__}: {e}", e)
        if message is None:
            raise
        if status == "rank_died":
            from dsdebug.distributed.liveness import ignore_sigterm_from_now

            ignore_sigterm_from_now()  # the launcher's SIGTERM must not turn exit 1 into "killed by SIGTERM"
        fail(message, code=code, every_rank=status == "rank_died" and reported_a_death())
    value = metrics.get(cfg.get("optimized_metric"))
    return float(value) if isinstance(value, (int, float)) else None


if __name__ == "__main__":
    main()
