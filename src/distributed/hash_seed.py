"""Every rank starts with the same Python hash seed: the training command fixes ``PYTHONHASHSEED``
before anything runs.

Python picks the hash seed of ``str``/``bytes`` once, when the interpreter starts; setting
``PYTHONHASHSEED`` later only reaches processes started afterwards. The reproducibility check sets it
for the child ranks and data-loader workers it starts, so without this rank 0 alone iterated
str-keyed sets and dicts in a random order (finding ``hash_seed_late``), and the advice to export it
was one the default command (``make train``, ``dsdebug-train``, ``python train.py``) could not follow.

``fix_hash_seed(argv)``, first thing in the entry point, on every process it starts: when
``PYTHONHASHSEED`` is not in the environment, set it to the run's ``callbacks.reproducibility.hash_seed``
(the override on the command line, else the config's default, 0) and re-execute the same command
line (same pid: an external launcher such as torchrun keeps tracking it). A value the user exported,
``random`` included, is theirs: kept, and the check reports it where it can change a result.
"""

from __future__ import annotations

import os
import sys

__all__ = ["DEFAULT", "ENV", "MARK", "fix_hash_seed", "match_config", "wanted"]

ENV = "PYTHONHASHSEED"
MARK = "DSDEBUG_HASH_SEED_FROM_ENTRY"  # the value fix_hash_seed chose (not the user's)
DEFAULT = "0"  # conf/callbacks/reproducibility.yaml hash_seed (tests/distributed/test_hash_seed.py holds them equal)
_OVERRIDE = "callbacks.reproducibility.hash_seed="


def wanted(argv: list[str]) -> str:
    """The hash seed the run asks for: a ``callbacks.reproducibility.hash_seed=N`` override, else 0."""
    for arg in reversed(argv):
        if arg.lstrip("+").startswith(_OVERRIDE):
            value = arg.split("=", 1)[1]
            if value.isdigit() and int(value) <= 2**32 - 1:
                return value
    return DEFAULT


def fix_hash_seed(argv: list[str]) -> None:
    """Re-execute this process with ``PYTHONHASHSEED`` set, unless it is set already (never returns then)."""
    if ENV in os.environ:
        return
    os.environ[ENV] = os.environ[MARK] = wanted(argv)
    _reexec()


def match_config(cfg) -> None:
    """Once the config is composed (before Hydra makes the run dir): when the seed fix_hash_seed chose from
    the command line is not the composed ``callbacks.reproducibility.hash_seed`` (set in an experiment or
    preset YAML), re-execute with the composed one, so this process and the ranks it starts agree."""
    chosen = os.environ.get(MARK)
    if chosen is None or os.environ.get(ENV) != chosen:
        return  # the user's own PYTHONHASHSEED: theirs
    from omegaconf import OmegaConf

    want = OmegaConf.select(cfg, "callbacks.reproducibility.hash_seed", default=None)
    if want is None or str(want) == chosen or not str(want).isdigit():
        return
    os.environ[ENV] = os.environ[MARK] = str(want)
    _reexec()


def _reexec() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
