"""Run a command here as if only the GPU image's packages plus the kit were installed.

    python benchmarks/gpu/image.py -- python benchmarks/gpu_check.py --dry-run --only env,fp16

The GPU image lacks packages this venv has (wandb, optuna, submitit, datasets, ...). A kit that misses one
the framework imports would fail only there, in a GPU session. This hides, in the command and every
process it starts (a ``sitecustomize`` on PYTHONPATH), every distribution installed here that is neither
on the image's list (``gpu.kit.IMAGE_PACKAGES``, with what those need at this venv's versions) nor carried by the kit (``gpu.kit.local_plan``):
its top-level modules are not found (``import`` and ``importlib.util.find_spec``) and its metadata is not
seen (``importlib.metadata``), as on the image. Versions are this venv's, not the image's (its torch is
2.11, its other versions mostly unknown): this checks the closure, not the versions. Each hidden module
that something tried to import is appended to ``$GPU_CHECK_HIDDEN_LOG`` when set.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu import kit  # noqa: E402

SITECUSTOMIZE = '''
import importlib.machinery, os, re, sys

_modules, _dists = set(), set()
for _line in open(os.environ["GPU_CHECK_HIDDEN"]).read().splitlines():
    _kind, _, _name = _line.partition(" ")
    (_modules if _kind == "module" else _dists).add(_name)
_log = os.environ.get("GPU_CHECK_HIDDEN_LOG")


class _ImageOnly(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if path is None and name in _modules:
            if _log:
                with open(_log, "a") as f:
                    f.write(name + "\\n")
            return None
        return importlib.machinery.PathFinder.find_spec(name, path, target)

    @classmethod
    def find_distributions(cls, *args, **kwargs):
        for d in importlib.machinery.PathFinder.find_distributions(*args, **kwargs):
            if re.sub(r"[-_.]+", "-", d.metadata["Name"] or "").lower() not in _dists:
                yield d


sys.meta_path[:] = [_ImageOnly if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
'''


def hidden(allowed: set[str]) -> tuple[set[str], set[str]]:
    """(top-level modules, canonical distribution names) installed here but not allowed."""
    dists = {kit.canon(d.metadata["Name"] or "") for d in md.distributions()} - allowed - {""}
    modules = {m for m, owners in md.packages_distributions().items()
               if all(kit.canon(o) in dists for o in owners)}
    return modules, dists


def allowed_here() -> set[str]:
    """The image's packages with what they need at this venv's versions (a newer huggingface-hub here needs
    httpx2, the image's 1.33 does not: not the kit's business), the kit's, and dsdebug (the working tree)."""
    from packaging.requirements import Requirement

    installed = {kit.canon(d.metadata["Name"] or ""): d.metadata["Name"] for d in md.distributions()}
    allowed, queue = set(), [n for n in kit.IMAGE_PACKAGES if n in installed]
    while queue:
        name = queue.pop()
        if name in allowed or name not in installed:
            continue
        allowed.add(name)
        for text in md.requires(installed[name]) or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                queue.append(kit.canon(req.name))
    return allowed | set(kit.local_plan()) | {"dsdebug"}


def run(cmd: list[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.CompletedProcess:
    """``cmd`` with the hidden packages hidden (in a fresh folder holding the sitecustomize)."""
    modules, dists = hidden(allowed_here())
    folder = Path(tempfile.mkdtemp(prefix="gpu_check_image"))
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (folder / "hidden.txt").write_text("".join(f"module {m}\n" for m in sorted(modules))
                                       + "".join(f"dist {d}\n" for d in sorted(dists)))
    base = {**os.environ, **(env or {})}
    base["GPU_CHECK_HIDDEN"] = str(folder / "hidden.txt")
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), base.get("PYTHONPATH")]))
    return subprocess.run(cmd, env=base, **kwargs)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        modules, dists = hidden(allowed_here())
        print(f"hidden: {len(dists)} distributions ({', '.join(sorted(dists))}); {len(modules)} modules")
        return 0
    return run(argv).returncode


if __name__ == "__main__":
    sys.exit(main())
