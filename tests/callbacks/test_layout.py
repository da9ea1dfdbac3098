"""Each check in one place, and one source of truth for its defaults.

- ``src/callbacks/`` holds only ``__init__``, the base and the shared helpers (``SHARED``), and one module or
  package per check; a package's ``__init__`` exports the class.
- ``from dsdebug.callbacks import <every check>`` works, and each ``conf/callbacks/*.yaml`` targets that class.
- Every argument of a check's ``__init__`` is in its YAML with the same default (an interpolation such as
  ``${seed}`` is the framework's wiring and is skipped): a check used standalone behaves as under Hydra.
"""

from __future__ import annotations

import inspect
import shutil
from pathlib import Path

import hydra.utils
from omegaconf import OmegaConf

import dsdebug.callbacks as callbacks
from tests.helpers.runs import CONF, REPO

CHECKS = {name: module for name, module in callbacks._MODULES.items() if name != "DebugCallback"}


def layout_problems(folder: Path) -> list[str]:
    problems = []
    allowed = {"__init__", *callbacks.SHARED, *CHECKS.values()}
    for entry in sorted(folder.iterdir()):
        if entry.name == "__pycache__":
            continue
        stem = entry.stem if entry.is_file() else entry.name
        if entry.is_file() and entry.suffix != ".py":
            problems.append(f"{entry.name}: not a Python module")
        elif stem not in allowed:
            problems.append(f"{entry.name}: neither the base, a shared helper ({', '.join(callbacks.SHARED)}) nor a "
                            "check's module/package; a helper with one user belongs in its check's package")
        elif entry.is_dir():
            if not (entry / "__init__.py").is_file() or not (entry / "check.py").is_file():
                problems.append(f"{entry.name}/: a check's package needs __init__.py (exports the class) and check.py")
            problems += [f"{entry.name}/{sub.name}: no nested packages in a check" for sub in entry.iterdir()
                         if sub.is_dir() and sub.name != "__pycache__"]
    for module in set(CHECKS.values()):
        if not ((folder / f"{module}.py").is_file() or (folder / module).is_dir()):
            problems.append(f"{module}: a check with no module or package")
        if (folder / f"{module}.py").is_file() and (folder / module).is_dir():
            problems.append(f"{module}: both a module and a package")
    return problems


def test_callbacks_folder_holds_the_base_shared_helpers_and_one_entry_per_check():
    assert layout_problems(REPO / "src" / "callbacks") == []


def test_a_stray_helper_file_is_refused(tmp_path):
    folder = tmp_path / "callbacks"
    shutil.copytree(REPO / "src" / "callbacks", folder, ignore=shutil.ignore_patterns("__pycache__"))
    (folder / "_memory_math.py").write_text("GB = 2**30\n")
    (folder / "loss_spike" / "check.py").unlink()
    problems = layout_problems(folder)
    assert any(p.startswith("_memory_math.py:") for p in problems), problems
    assert any(p.startswith("loss_spike/:") for p in problems), problems


def cross_check_imports(folder: Path) -> list[str]:
    """A check imports the base, the shared helpers and its own package, never another check."""
    from tests.trainer.test_layering import _imports

    src, bad = folder.parent, []
    checks = set(CHECKS.values())
    for path in sorted(folder.rglob("*.py")):
        rel = path.relative_to(folder).parts
        own = rel[0].removesuffix(".py")
        if own not in checks:
            continue
        for line, module in _imports(path, src):
            parts = module.split(".")
            if parts[:2] == ["dsdebug", "callbacks"] and len(parts) > 2 and parts[2] in checks and parts[2] != own:
                bad.append(f"callbacks/{'/'.join(rel)}:{line} imports {module}: another check; share it through "
                           f"a helper ({', '.join(callbacks.SHARED)}) or a lower layer")
    return bad


def test_no_check_imports_another_check():
    assert cross_check_imports(REPO / "src" / "callbacks") == []


def test_a_planted_cross_check_import_is_refused(tmp_path):
    folder = tmp_path / "src" / "callbacks"
    shutil.copytree(REPO / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__"))
    nan = folder / "nan_triage.py"
    nan.write_text(nan.read_text() + "\n\ndef _late():\n    from dsdebug.callbacks.grad_monitor import GradMonitor\n")
    bad = cross_check_imports(folder)
    assert len(bad) == 1 and "nan_triage.py" in bad[0] and "grad_monitor" in bad[0], bad


def test_every_check_imports_from_the_facade_and_its_config_targets_it():
    targets = {}
    for path in sorted((CONF / "callbacks").glob("*.yaml")):
        for conf in (OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}).values():
            if isinstance(conf, dict) and str(conf.get("_target_", "")).startswith("dsdebug.callbacks."):
                targets[conf["_target_"]] = path.name
    for name, module in CHECKS.items():
        cls = getattr(callbacks, name)
        assert inspect.isclass(cls) and issubclass(cls, callbacks.DebugCallback), name
        path = f"dsdebug.callbacks.{module}.{name}"
        if name != "DeepSpeedWallClock":  # added by the trainer under a ds_config's wall_clock_breakdown
            assert path in targets, f"no conf/callbacks/*.yaml targets {path}"
            assert hydra.utils.get_object(path) is cls
    for target in targets:
        assert hydra.utils.get_object(target) in [getattr(callbacks, n) for n in CHECKS], target


def _same(yaml_value, default) -> bool:
    if isinstance(yaml_value, list) and isinstance(default, (list, tuple)):
        return list(yaml_value) == list(default)
    return type(yaml_value) is type(default) and yaml_value == default if isinstance(default, bool) else \
        yaml_value == default


def default_mismatches(conf_dir: Path) -> list[str]:
    out = []
    for path in sorted((conf_dir / "callbacks").glob("*.yaml")):
        for key, conf in (OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}).items():
            target = conf.get("_target_", "") if isinstance(conf, dict) else ""
            if not target.startswith("dsdebug.callbacks."):
                continue
            params = inspect.signature(hydra.utils.get_object(target).__init__).parameters
            for name, param in params.items():
                if name == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                    continue
                if name not in conf:
                    out.append(f"{path.name}: callbacks.{key}.{name} missing (class default {param.default!r})")
                    continue
                value = conf[name]
                if isinstance(value, str) and "${" in value:
                    continue
                if not _same(value, param.default):
                    out.append(f"{path.name}: callbacks.{key}.{name}: YAML {value!r}, class {param.default!r}")
            out += [f"{path.name}: callbacks.{key}.{k} is not an argument of {target}" for k in conf
                    if not k.startswith("_") and k not in params]
    return out


def test_every_yaml_default_is_the_class_default():
    assert default_mismatches(CONF) == []


def test_a_planted_default_mismatch_fails(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    grad = conf / "callbacks" / "grad_monitor.yaml"
    grad.write_text(grad.read_text().replace("every_n_steps: ", "every_n_steps: 7 #", 1))
    assert [m for m in default_mismatches(conf) if "grad_monitor.every_n_steps" in m], default_mismatches(conf)
