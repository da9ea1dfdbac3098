"""The config's path from the task function to ``trainer.fit``: every function of this package that is handed
the run's config (the object or one of its nodes) or the run plan that carries it (config/plan.py RunPlan; not
as ``self``: reading the plan's own methods is no stop; nor is a dataclass's generated ``__init__``, which only stores
its fields) as an argument, in call order, until fit starts.

``walk(overrides, run_dir, cache)`` runs ``dsdebug.train.run`` (the Hydra task function, as the command line
does) on a composed config, records with ``sys.setprofile``, and stops at ``Trainer.fit`` (nothing is trained).
``packages(stops)`` folds it into the packages it passes through, in order.
"""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig, ListConfig

__all__ = ["packages", "reentries", "walk"]


class _AtFit(Exception):
    pass


def _nodes(cfg) -> set[int]:
    found, todo = set(), [cfg]
    while todo:
        node = todo.pop()
        if id(node) in found:
            continue
        found.add(id(node))
        if isinstance(node, DictConfig):
            todo += [node._get_node(k) for k in node.keys()] if not node._is_missing() and not node._is_none() else []
        elif isinstance(node, ListConfig) and not node._is_missing() and not node._is_none():
            todo += [node._get_node(i) for i in range(len(node))]
    return found


def walk(overrides: list[str], run_dir: Path, cache: Path) -> list[str]:
    """``module.function`` of every call that received the config, until ``Trainer.fit``."""
    import lightning as L
    from hydra.core.hydra_config import HydraConfig

    from dsdebug.config.plan import RunPlan
    from dsdebug.train import run
    from tests.helpers.runs import compose_as_hydra_main

    cfg = compose_as_hydra_main(overrides, run_dir, cache)
    ids = _nodes(cfg)
    stops: list[str] = []

    def profile(frame, event, arg):
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("dsdebug."):
            return
        code = frame.f_code
        if code.co_filename == "<string>":  # code a library generated (a dataclass's __init__): stores, acts on nothing
            return
        for name in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]:
            value = frame.f_locals.get(name)
            if (isinstance(value, (DictConfig, ListConfig)) and id(value) in ids) or \
                    (isinstance(value, RunPlan) and name != "self"):
                stops.append(f"{module}.{code.co_name}")
                return

    original = L.Trainer.fit

    def at_fit(*args, **kwargs):
        raise _AtFit()

    L.Trainer.fit = at_fit
    sys.setprofile(profile)
    try:
        run(cfg)
    except (_AtFit, SystemExit):
        pass
    finally:
        sys.setprofile(None)
        L.Trainer.fit = original
        HydraConfig.instance().cfg = None
    return stops


def packages(stops: list[str]) -> list[str]:
    """The packages the config passes through, consecutive repeats folded (``dsdebug.config.validate.x`` -> config;
    the top-level entry ``dsdebug.train`` -> train)."""
    out: list[str] = []
    for stop in stops:
        package = stop.split(".")[1]
        if not out or out[-1] != package:
            out.append(package)
    return out


def reentries(path: list[str]) -> dict[str, int]:
    """How often each package is entered again after the config left it."""
    seen: dict[str, int] = {}
    for package in path:
        seen[package] = seen.get(package, 0) + 1
    return {p: n - 1 for p, n in seen.items() if n > 1}
