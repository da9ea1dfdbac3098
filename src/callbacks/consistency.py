"""`ConsistencyCheck`: every rank runs the same software, hardware class, config, seed and environment.

The config example and the table of metrics and findings: the class docstring (`ConsistencyCheck`).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import platform
import socket
from importlib import metadata
from typing import Any, ClassVar

import torch

from dsdebug.config.args import Rule, optional, strings
from dsdebug.callbacks.base import DebugCallback
from dsdebug.distributed import collectives
from dsdebug.config.fingerprint import config_facts, config_hash
from dsdebug.findings.ranks import name_ranks
from dsdebug.findings.secrets import REDACTED, SECRET_KEY

__all__ = ["ConsistencyCheck", "rank_facts", "compare_facts"]

log = logging.getLogger(__name__)

ENV_PATTERNS = ("NCCL_*", "TORCH_*", "TORCHINDUCTOR_*", "PYTORCH_*", "CUDA_*", "CUDNN_*", "CUBLAS_*", "NVIDIA_TF32_*",
                "GLOO_*", "UCX_*", "FI_*", "OMP_*", "KMP_*", "MKL_*", "OPENBLAS_*", "DS_*", "DEEPSPEED_*", "PL_*",
                "PYTHONHASHSEED")
PER_RANK_ENV = ("CUDA_VISIBLE_DEVICES", "PL_GLOBAL_SEED", "*_DIR", "*_HOME", "*_PATH")
_ADVICE = {
    "version": "install the same versions on every node (one container image or venv for the job): different "
               "torch/NCCL/DeepSpeed builds can hang in collectives or disagree silently",
    "gpu": "run the job on one node type and one driver (e.g. sbatch --constraint): the slowest GPU sets the pace "
           "and numerics can differ",
    "config": "every rank must compose the same config: same overrides, same config files and code on every node "
              "(a stale checkout or a different command on one node?)",
    "seed": "start every node with the same seed (seed=...): ranks seeded differently shuffle and initialise "
            "differently",
    "env": "export the same value on every node (job script / launcher environment) or unset it everywhere",
}


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _gpu_facts(device: torch.device | None) -> dict[str, Any]:
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return {}
    facts: dict[str, Any] = {"gpu.model": torch.cuda.get_device_name(device)}
    try:  # the driver only where NVML's Python binding is installed (no subprocess)
        import pynvml

        pynvml.nvmlInit()
        facts["gpu.driver"] = str(pynvml.nvmlSystemGetDriverVersion())
    except Exception:  # noqa: BLE001 - not installed or no NVML: leave it out
        pass
    return facts


def _nccl_version() -> str | None:
    try:
        v = torch.cuda.nccl.version()  # (2, 21, 5) in torch 2.x, an int in older builds
    except Exception:  # noqa: BLE001 - a CUDA build without NCCL
        return None
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _secret(name: str, value: str) -> Any:
    """A secret-looking variable's value as a digest: still comparable, never printable."""
    if SECRET_KEY.search(name) and value:
        return [REDACTED, hashlib.sha256(value.encode()).hexdigest()]
    return value


def env_facts(environ: dict[str, str], patterns: list[str] | tuple[str, ...] = ENV_PATTERNS) -> dict[str, Any]:
    match = lambda name, pats: any(fnmatch.fnmatchcase(name, p) for p in pats)  # noqa: E731
    return {f"env.{k}": _secret(k, v) for k, v in sorted(environ.items())
            if match(k, patterns) and not match(k, PER_RANK_ENV)}


def rank_facts(cfg: Any = None, device: torch.device | None = None, environ: dict[str, str] | None = None,
               env_patterns: list[str] | tuple[str, ...] = ENV_PATTERNS) -> dict[str, Any]:
    """What this rank runs on: ``{"host": ..., "facts": {key: value}, "config": {dotted key: value}}``."""
    cuda = torch.cuda.is_available()
    facts: dict[str, Any] = {
        "version.python": platform.python_version(), "version.torch": torch.__version__,
        "version.cuda": torch.version.cuda,
        "version.cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "version.nccl": _nccl_version() if cuda else None,
        **{f"version.{d}": _version(d) for d in ("deepspeed", "transformers", "lightning", "numpy")},
        **_gpu_facts(device),
    }
    config = config_facts(cfg) if cfg is not None else {}
    seed = cfg.get("seed") if cfg is not None else None
    facts["seed"] = seed if seed is not None else (environ or os.environ).get("PL_GLOBAL_SEED")
    if config:
        facts["config"] = config_hash(config)
    facts.update(env_facts(dict(os.environ if environ is None else environ), env_patterns))
    return {"host": socket.gethostname(), "facts": facts, "config": config}


def _shown(value: Any) -> str:
    if isinstance(value, list) and value[:1] == [REDACTED]:
        return REDACTED
    return "(unset)" if value is None else repr(value)


def _category(key: str) -> str:
    return key.split(".", 1)[0] if key.split(".", 1)[0] in ("version", "gpu", "env") else key


def compare_facts(gathered: list[dict[str, Any]], ignore: list[str] | tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """One record per differing key: ``{code, key, message, advice, rank, details}`` (values redacted)."""
    hosts = {r: g.get("host", "?") for r, g in enumerate(gathered)}
    keys = sorted(set().union(*(g["facts"] for g in gathered)))
    out = []
    for key in keys:
        if any(fnmatch.fnmatchcase(key, p) for p in ignore):
            continue
        groups: dict[str, list[int]] = {}
        shown: dict[str, str] = {}
        for r, g in enumerate(gathered):
            value = g["facts"].get(key)
            ident = json.dumps(value, sort_keys=True, default=str)
            groups.setdefault(ident, []).append(r)
            shown[ident] = _shown(value)
        if len(groups) < 2:
            continue
        # the reference is the largest group (rank 0's on a tie); the others are the outliers, listed first
        ordered = sorted(groups.items(), key=lambda kv: (len(kv[1]), -kv[1][0]))
        name = key.split(".", 1)[1] if key.startswith("env.") else key
        parts = [f"{name_ranks(ranks, hosts)} {'has' if len(ranks) == 1 else 'have'} {shown[ident]}"
                 for ident, ranks in ordered]
        extra = ""
        if key == "config":
            differing = _config_keys(gathered)
            extra = f"; differing keys: {', '.join(differing[:8])}" + (" ..." if len(differing) > 8 else "")
        outliers = ordered[0][1]
        category = _category(key)
        out.append({
            "code": f"{category}_mismatch", "key": key,
            "message": f"{name} differs across ranks: {'; '.join(parts)}{extra}",
            "advice": _ADVICE[category],
            "rank": outliers[0] if len(ordered) == 2 and len(outliers) == 1 else None,
            "details": {"key": key, "values": {r: shown[i] for i, rs in groups.items() for r in rs}, "hosts": hosts},
        })
    return out


def _config_keys(gathered: list[dict[str, Any]]) -> list[str]:
    configs = [g.get("config") or {} for g in gathered]
    keys = sorted(set().union(*configs))
    return [k for k in keys if len({json.dumps(c.get(k), sort_keys=True, default=str) for c in configs}) > 1]


class ConsistencyCheck(DebugCallback):
    """`ConsistencyCheck`: every rank runs the same software, hardware class, config, seed and environment.

    Catches the "works on one node, hangs or drifts on many" class of failures (mismatched
    environments across nodes): a node with another torch/NCCL/DeepSpeed build (collectives hang or disagree on wire
    formats), another GPU model or driver, a stale checkout or other overrides (a different config or
    seed on one node: replicas no longer train the same model), or an environment variable that
    changes how ranks communicate or compute (``NCCL_*``, ``TORCH_*``, ``OMP_NUM_THREADS``, ...).

    How (every rank, once, at ``setup`` of fit: one ``all_gather_object`` through the process group):
    each rank contributes its host name and a flat dict of facts; rank 0 compares them and writes one
    warning per differing key, naming the key, the ranks and hosts that differ and their values. The
    values of secret-looking variables (``*TOKEN*``, ``*PASSWORD*``, ... as in
    ``src/findings/secrets.py``) never leave the rank: they travel as a digest and print as ``***``.
    Nothing happens after setup; a 1-process run compares nothing.

    Facts (keys as they appear in findings; ``ignore`` takes fnmatch patterns over them):

    - ``version.python``, ``.torch``, ``.cuda`` (torch.version.cuda), ``.cudnn``, ``.nccl`` (with CUDA),
      ``.deepspeed``, ``.transformers``, ``.lightning``, ``.numpy``;
    - ``gpu.model`` (torch.cuda.get_device_name of the rank's device), ``gpu.driver`` (pynvml, if installed);
    - ``seed`` and ``config``: a sha256 of the resolved config without ``paths`` (where files go may
      differ per node; path values inside other keys are written relative to ``paths.*``) and
      without ``seed``; a config finding names the differing keys;
    - ``env.<NAME>`` for variables matching ``env`` patterns (default below), except those that
      differ per rank by design (``CUDA_VISIBLE_DEVICES``, ``PL_GLOBAL_SEED`` = the seed, names ending
      in ``_DIR``/``_HOME``/``_PATH``: caches and install locations). RANK, LOCAL_RANK, MASTER_*,
      TORCHELASTIC_* and SLURM_* are not in the default patterns.

    Framework integrity, on in every run (conf/callbacks/default.yaml, cost: one small gather at
    start); off with ``~callbacks.consistency``.

    Example::

        OMP_NUM_THREADS=4 torchrun --nnodes 2 ... train.py trainer.num_nodes=2   # on by default
        python train.py callbacks.consistency.ignore='[env.NCCL_SOCKET_IFNAME,gpu.*]'

    | finding code | severity | when |
    |---|---|---|
    | ``version_mismatch`` | warning | a library or Python version differs between ranks |
    | ``gpu_mismatch`` | warning | GPU model or driver differs |
    | ``config_mismatch`` | warning | the resolved config differs (the differing keys are named) |
    | ``seed_mismatch`` | warning | the seed differs |
    | ``env_mismatch`` | warning | an environment variable differs (or is set on some ranks only) |

    It logs no metrics. Resume: nothing is carried over (``state_attrs`` is empty): the resumed
    processes compare themselves again.
    """
    name = "consistency"
    state_attrs = ()  # facts of the processes that run now: compared again after a resume

    #: argument rules, declared: the config layer reads them before the check is built
    #: (config/check_args.json, written by python -m dsdebug.callbacks.arg_table)
    arg_rules: ClassVar[dict[str, Rule]] = {
        "env": optional(strings("a list of name patterns such as [NCCL_*, OMP_NUM_THREADS]")),
        "ignore": optional(strings("a list of name patterns such as [NCCL_*, OMP_NUM_THREADS]")),
    }

    def __init__(self, env: list[str] | None = None, ignore: list[str] | tuple[str, ...] = ()) -> None:
        super().__init__(on_error="warn")
        self.check_declared(env=env, ignore=ignore)
        self.env_patterns = tuple(env) if env is not None else ENV_PATTERNS
        self.ignore = tuple(ignore or ())
        self.run_config: Any = None
        self.mismatches: list[dict[str, Any]] | None = None

    def bind_config(self, cfg: Any) -> None:
        """The run's config (trainer/entry.py bind_config calls this, last before fit); hashed at setup."""
        self.run_config = cfg

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or self.mismatches is not None:
            return
        mine = rank_facts(self.run_config, trainer.strategy.root_device, env_patterns=self.env_patterns)
        if trainer.world_size <= 1:
            self.mismatches = []
            return
        gathered = collectives.all_gather_object(mine)  # COLLECTIVE: every rank, once
        self.mismatches = compare_facts(gathered, self.ignore)
        if not trainer.is_global_zero:
            return
        for m in self.mismatches:
            self.report(trainer, "warning", m["code"], m["message"], advice=m["advice"], details=m["details"],
                        rank=m["rank"], step=None)
        if not self.mismatches:
            log.info("consistency: %d ranks on %d host(s) agree on versions, config, seed and environment",
                     len(gathered), len({g["host"] for g in gathered}))
