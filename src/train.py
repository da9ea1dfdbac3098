"""The training command: ``dsdebug-train [group=option ...] [key=value ...]`` (installed), or
``python train.py ...`` from a checkout, or ``python -m dsdebug.train ...`` — one Hydra CLI.

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

__all__ = ["ENV_ENTRY", "config_dir", "main"]

ENV_ENTRY = "DSDEBUG_ENTRY"  # the script a sweep job re-runs (submitit pickles the task function)


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

    from dsdebug.trainer.cli import precheck_overrides, run
    from dsdebug.distributed.launch_env import detect
    from dsdebug.distributed.run_dir import main_argv

    os.environ.setdefault("PROJECT_ROOT", os.getcwd())
    os.environ.setdefault(ENV_ENTRY, str(Path(entry or sys.argv[0]).resolve()))
    conf = config_dir()

    @hydra.main(version_base="1.3", config_path=str(conf), config_name="train")
    def task(cfg):
        # a submitit job runs this function, pickled, under its own argv
        return run(cfg, script=os.environ.get(ENV_ENTRY), train_fn=_doctor_if_asked(cfg))

    sys.argv[1:] = main_argv()  # torchrun / srun / deepspeed: one run dir for every rank of the job
    # our own child ranks were started from a checked config; an external launcher's were not
    # (every rank checks; only rank 0 prints the error line)
    if os.environ.get("LOCAL_RANK", "0") == "0" or detect() is not None:
        precheck_overrides(sys.argv[1:], conf, "train")
    task()


def _doctor_if_asked(cfg):
    """``doctor=true``: the preflight doctor (src/doctor/) runs instead of training."""
    value = cfg.get("doctor", False)
    if value is False or value is None:
        return None
    if value is not True:
        from dsdebug.errors import fail

        fail(f"doctor={value!r} is invalid; valid: true, false")
    from dsdebug.doctor.entry import doctor

    return doctor


if __name__ == "__main__":
    main()
