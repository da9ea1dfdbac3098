"""Every `_target_` in the config names something that exists, checked without importing it.

Hydra would only find a typo (`model.net._target_=dsdebug.models.deepseek.build_deepseek_v4`)
when it instantiates, after the heavy imports, as a multi-line `InstantiationException`.
Here modules are located with import machinery that does not execute them, and the name is
looked up in the module's source (top-level defs, classes, assignments, imports). Modules
with dynamic attributes (`__getattr__`, `import *`, lazy modules) and compiled ones are
imported to look, which only happens for those.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import importlib.machinery
import importlib.util
import pkgutil
import sys
from functools import lru_cache
from typing import Any, Iterator

from omegaconf import DictConfig, OmegaConf

from dsdebug.errors import ConfigError

__all__ = ["check_targets", "target_problem"]


def check_targets(cfg: DictConfig) -> None:
    tree = OmegaConf.to_container(cfg, resolve=False)
    for key, target in _targets(tree, ""):
        problem = target_problem(target)
        if problem:
            raise ConfigError(f"{key}={target!r}: {problem}")


def _targets(node: Any, prefix: str) -> Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        target = node.get("_target_")
        if isinstance(target, str) and "${" not in target:
            yield f"{prefix}_target_", target
        for k, v in node.items():
            if k != "hydra":
                yield from _targets(v, f"{prefix}{k}.")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _targets(v, f"{prefix}{i}.")


def target_problem(target: str) -> str | None:
    """None if `target` ('pkg.module.name[.attr...]') resolves; else what is wrong, one line."""
    parts = target.split(".")
    if not all(p.isidentifier() for p in parts):
        return "not a dotted Python path; valid: an importable 'package.module.name'"
    # the longest prefix that is a module; the next part must be a name in it (or a submodule)
    for i in range(len(parts) - 1, 0, -1):
        spec = _find_spec(".".join(parts[:i]))
        if spec is not None:
            break
    else:
        return f"no module named {parts[0]!r}; valid: an importable 'package.module.name'"
    module_name, name = ".".join(parts[:i]), parts[i]
    names = _names_in(module_name, spec, name)
    if names is None or name in names:
        return None
    public = sorted(n for n in names if not n.startswith("_"))
    close = difflib.get_close_matches(name, public, n=3)
    valid = f"did you mean {' or '.join(close)}?" if close else f"valid: {', '.join(public[:12])}{', ...' if len(public) > 12 else ''}"
    return f"{module_name} has no {name!r}; {valid}"


def _find_spec(name: str) -> Any:
    """The module's spec without executing it or its parent packages (None if not found)."""
    if name in sys.modules:
        return getattr(sys.modules[name], "__spec__", None) or importlib.machinery.ModuleSpec(name, None)
    parent, _, _ = name.rpartition(".")
    try:
        if not parent:
            return importlib.util.find_spec(name)
        parent_spec = _find_spec(parent)
        locations = getattr(parent_spec, "submodule_search_locations", None)
        if not locations:
            return None
        return importlib.machinery.PathFinder.find_spec(name, list(locations))
    except (ImportError, ValueError):
        return None


def _names_in(module_name: str, spec: Any, wanted: str) -> set[str] | None:
    """Names a target may take from the module; None = cannot tell, do not complain.
    Reads the source; imports the module only when the source cannot tell (dynamic names)."""
    names: set[str] = set()
    if spec.submodule_search_locations:  # a package: its submodules count too
        names |= {m.name for m in pkgutil.iter_modules(list(spec.submodule_search_locations))}
    module = sys.modules.get(module_name)
    if module is None and spec.origin and spec.origin.endswith(".py"):
        found, dynamic = _top_level_names(spec.origin)
        names |= found
        if wanted in names or not dynamic:
            return names
    if module is None and (spec.origin is None or spec.origin == "namespace" or spec.loader is None):
        return names  # a namespace package: only submodules
    try:
        module = module or importlib.import_module(module_name)
    except Exception:  # noqa: BLE001 - importing fails later with its own error
        return None
    if hasattr(module, "__getattr__"):
        return None
    return names | set(dir(module))


@lru_cache(maxsize=None)
def _top_level_names(path: str) -> tuple[frozenset[str], bool]:
    """(def/class/assigned/imported names at module level, whether it has others we cannot see:
    `import *`, a module `__getattr__`, a lazy module replacing itself in sys.modules)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return frozenset(), True
    names: set[str] = set()
    dynamic = False
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            dynamic |= node.name == "__getattr__"
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    dynamic = True
                else:
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Name):
                        names.add(sub.id)
                    elif isinstance(sub, ast.Subscript) and "sys.modules" in ast.unparse(sub):
                        dynamic = True  # a lazy module replaces itself
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            for field in ("body", "orelse", "finalbody"):
                stack.extend(getattr(node, field, []))
            for handler in getattr(node, "handlers", []):
                stack.extend(handler.body)
    return frozenset(names), dynamic
