"""gpu_check.py's first move on the GPU machine: install the carried wheels and import dsdebug from the working tree.

The wheels from ``make gpu-kit`` (``.gpu_kit/``, listed in its MANIFEST.json) go into a ``--target`` folder with
``pip install --no-index --no-deps`` (nothing can be fetched there), unless each is importable at its version
already (a machine with the full stack, or a second run on a warm machine). That folder goes first on sys.path
and on PYTHONPATH (every train.py run inherits it), so the kit's transformers 5.23 wins over the image's 5.17.
dsdebug comes from this working tree (a link named ``dsdebug`` to ``src/``), so the run tests the code as it
is. Then every carried package's requirements are checked against what is there.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]  # benchmarks/: gpu.planted for the runs' planted callback
REPO = HERE.parent


def ensure_kit(kit: Path, site: Path, link_dir: Path) -> dict[str, Any]:
    """Install the kit's wheels into ``site`` unless each is importable at its version already; make
    ``dsdebug`` importable from this working tree. Sets sys.path and PYTHONPATH for the runs."""
    import importlib.metadata as md

    out: dict[str, Any] = {"kit": str(kit), "site": None, "installed": False}
    manifest = json.loads((kit / "MANIFEST.json").read_text()) if (kit / "MANIFEST.json").is_file() else None
    paths: list[str] = []
    if manifest is not None:
        out["wheels"] = len(manifest["wheels"])
        out["kit_made"], out["kit_commit"] = manifest.get("made"), manifest.get("commit")

        def stale() -> list[str]:
            bad = []
            for w in manifest["wheels"]:
                try:
                    if md.version(w["name"]) != w["version"]:
                        bad.append(w["name"])
                except md.PackageNotFoundError:
                    bad.append(w["name"])
            return bad

        missing = stale()
        if missing:
            cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                   "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, sorted(kit.glob("*.whl")))]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            out["install_exit"] = proc.returncode
            if proc.returncode != 0:
                out["install_error"] = proc.stderr.strip().splitlines()[-3:]
            paths.append(str(site))
            sys.path.insert(0, str(site))
            importlib.invalidate_caches()
            out.update(installed=True, site=str(site), was_missing=missing)
        out["still_missing"] = stale()
    else:
        out["note"] = "no kit (MANIFEST.json absent): using what is installed"
    if importlib.util.find_spec("dsdebug") is None:
        link_dir.mkdir(parents=True, exist_ok=True)
        link = link_dir / "dsdebug"
        if not link.exists():
            link.symlink_to(REPO / "src", target_is_directory=True)
        sys.path.insert(0, str(link_dir))
        paths.append(str(link_dir))
        out["dsdebug"] = f"from the working tree ({link} -> src)"
    else:
        out["dsdebug"] = "installed"
    paths += [str(HERE), str(REPO)]  # gpu.planted, tests.planted (the runs' planted callbacks)
    sys.path[:0] = [p for p in (str(HERE), str(REPO)) if p not in sys.path]
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])
    if manifest is not None:
        left_out = manifest.get("left_out", {})
        out["left_out"] = sorted(left_out)
        out["unmet_requirements"] = unmet_requirements([w["name"] for w in manifest["wheels"]], set(left_out))
    return out


def unmet_requirements(names: list[str], left_out: set[str] = frozenset()) -> list[str]:
    """Each carried package's Requires-Dist (markers for this interpreter, extras off) checked against what
    is importable here: what pip would have installed, had it been allowed to resolve. ``left_out``: names
    the kit leaves out on purpose (MANIFEST.json, gpu.kit.NOT_NEEDED)."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    unmet = []
    for name in names:
        try:
            reqs = md.requires(name) or []
        except md.PackageNotFoundError:
            unmet.append(f"{name}: not installed")
            continue
        for text in reqs:
            req = Requirement(text)
            if (req.marker is not None and not req.marker.evaluate({"extra": ""})) or \
                    re.sub(r"[-_.]+", "-", req.name).lower() in left_out:
                continue
            try:
                have = md.version(req.name)
            except md.PackageNotFoundError:
                unmet.append(f"{name} needs {text}: absent")
                continue
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                unmet.append(f"{name} needs {text}: have {have}")
    return unmet
