"""Venvs that hold only some of the test venv's distributions: a core install of dsdebug (what
pyproject.toml's ``dependencies`` pull in, nothing from the extras) without downloading anything.

``partial_venv(dst, requirements)`` makes ``python -m venv --without-pip`` and symlinks into its
site-packages the files of exactly the distributions ``requirements`` need (their dependency closure,
markers evaluated, extras not followed), read from this venv's installed metadata. A module of any
other distribution is then absent in the new venv, for imports and for ``importlib.metadata`` alike
(Lightning/torchmetrics decide what to import from the metadata). Building one takes ~1 s.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

from tests.helpers.runs import REPO


def project_metadata() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def core_requirements() -> list[str]:
    return list(project_metadata()["dependencies"])


def extra_requirements(extra: str) -> list[str]:
    reqs = []
    for req in project_metadata()["optional-dependencies"][extra]:
        match = re.fullmatch(r"dsdebug\[(.+)\]", req)
        reqs += [r for e in match.group(1).split(",") for r in extra_requirements(e)] if match else [req]
    return reqs


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(requirements: list[str]) -> dict[str, md.Distribution]:
    """The installed distributions ``requirements`` need, transitively (an extra only where a
    requirement names it, as ``fsspec[http]``)."""
    # this venv's site-packages only: once something imported setuptools, sys.path also holds its vendored
    # copies (setuptools/_vendor/packaging-*.dist-info), which would shadow the real ones here
    site = str(Path(next(iter(md.distributions(name="torch"))).locate_file("")))
    installed = {_norm(d.metadata["Name"]): d for d in md.distributions(path=[site])}
    found: dict[str, md.Distribution] = {}
    done: set[tuple[str, str]] = set()
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        req, parent_extra = todo.pop()
        name = _norm(req.name)
        if req.marker is not None and not req.marker.evaluate({"extra": parent_extra}):
            continue
        if name not in installed:
            raise LookupError(f"{req.name} is not installed in the test venv")
        found[name] = installed[name]
        for extra in ("", *sorted(req.extras)):
            if (name, extra) not in done:
                done.add((name, extra))
                todo += [(Requirement(r), extra) for r in installed[name].requires or []]
    return found


def _top_entries(dist: md.Distribution) -> set[str]:
    """The site-packages entries (packages, modules, .libs, dist-info) a distribution installed."""
    return {Path(f).parts[0] for f in dist.files or () if not str(f).startswith("..")}


def partial_venv(dst: Path, requirements: list[str], with_checkout: bool = True) -> Path:
    """A venv at ``dst`` holding only the closure of ``requirements`` (and this checkout as the
    ``dsdebug`` package: a symlink to ``src/``, like the editable install); returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dst)], check=True, timeout=120)
    py = dst / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    ours = Path(next(iter(md.distributions(name="torch"))).locate_file(""))
    for dist in closure(requirements).values():
        for entry in _top_entries(dist):
            if (ours / entry).exists() and not (site / entry).exists():
                (site / entry).symlink_to(ours / entry)
    if with_checkout:
        (site / "dsdebug").symlink_to(REPO / "src")
    return py
