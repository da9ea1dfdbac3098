"""The package's layers hold: no module imports a package above its own, and no import cycle.

Layers, bottom to top (docs/architecture.md): a module may import its own package and those
below it. ``test_a_planted_upward_import_fails`` plants one and checks that the rule catches it.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

from tests.helpers.runs import REPO

LAYERS = ["errors", "findings", "report", "models", "data", "distributed", "config", "checkpoint", "probes", "callbacks", "trainer",
          "doctor", "train"]


def _module_name(path: Path, src: Path) -> str:
    rel = path.relative_to(src).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(("dsdebug", *parts))


def _dynamic_target(node: ast.Call, own: str) -> str | None:
    """The module an ``importlib.import_module(...)`` / ``__import__(...)`` call names, if it is ours:
    a string constant, or an f-string whose fixed head names it (``f"{__name__}.x"`` is the module's own)."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        head = arg.value
    elif isinstance(arg, ast.JoinedStr) and arg.values:
        first = arg.values[0]
        if isinstance(first, ast.FormattedValue) and isinstance(first.value, ast.Name) and first.value.id == "__name__":
            return own
        head = first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else ""
    else:
        return None
    return head.rstrip(".") if head.startswith("dsdebug.") else None


def _imports(path: Path, src: Path | None = None) -> list[tuple[int, str]]:
    """(line, module) of every ``dsdebug.*`` import in a file, at any depth (lazy imports count):
    absolute and relative ``import``/``from`` statements and ``importlib.import_module`` of our modules."""
    own = _module_name(path, src) if src is not None else "dsdebug"
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level > 0:  # from . import x / from ..models import y
            base = package.split(".")
            base = base[:len(base) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
            out.append((node.lineno, module))
            if not node.module:
                out += [(node.lineno, f"{module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dsdebug"):
            out.append((node.lineno, node.module))
            if node.module == "dsdebug":  # from dsdebug import config
                out += [(node.lineno, f"dsdebug.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("dsdebug")]
        elif isinstance(node, ast.Call):
            target = _dynamic_target(node, own)
            if target is not None:
                out.append((node.lineno, target))
    return out


def _layer(parts: tuple[str, ...]) -> str:
    return parts[0].removesuffix(".py")


def violations(src: Path) -> list[str]:
    bad = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src).parts
        if rel == ("__init__.py",):
            continue
        own = _layer(rel)
        assert own in LAYERS, f"src/{'/'.join(rel)}: package {own!r} has no layer; add it to LAYERS and docs"
        for line, module in _imports(path, src):
            parts = module.split(".")
            if len(parts) < 2:
                continue
            target = parts[1]
            assert target in LAYERS, f"src/{'/'.join(rel)}:{line} imports {module}: no such layer"
            if LAYERS.index(target) > LAYERS.index(own):
                bad.append(f"src/{'/'.join(rel)}:{line} ({own}) imports {module} ({target} is above it)")
    return bad


def module_cycles(src: Path) -> list[list[str]]:
    """Cycles among module-level (not lazy, not TYPE_CHECKING) imports between modules."""
    names = {}
    for path in src.rglob("*.py"):
        rel = path.relative_to(src).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        names[".".join(("dsdebug", *parts))] = path
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        deps = set()
        for node in ast.parse(path.read_text()).body:  # top level only: function-level imports run later
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for cand in [node.module] + [f"{node.module}.{a.name}" for a in node.names]:
                    if cand in names and cand != name:
                        deps.add(cand)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in names and a.name != name}
        graph[name] = deps
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def test_no_upward_import():
    assert violations(REPO / "src") == []


def test_no_import_cycle():
    assert module_cycles(REPO / "src") == []


def test_every_package_has_a_layer_and_is_installed():
    src = REPO / "src"
    packages = sorted(p.name for p in src.iterdir() if p.is_dir() and any(p.glob("*.py")))
    assert set(packages) <= set(LAYERS)
    import tomllib

    listed = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    on_disk = ["dsdebug", "dsdebug.conf"] + [".".join(("dsdebug", *p.parent.relative_to(src).parts))
                                            for p in src.rglob("*/__init__.py")]
    assert sorted(listed) == sorted(on_disk)


def test_a_planted_upward_import_fails(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(REPO / "src", src, ignore=shutil.ignore_patterns("__pycache__"))
    channel = src / "findings" / "channel.py"
    channel.write_text(channel.read_text() + "\n\ndef _late():\n    from dsdebug.trainer.cli import classify  # planted\n")
    bad = violations(src)
    assert len(bad) == 1 and "src/findings/channel.py" in bad[0] and "dsdebug.trainer.cli" in bad[0], bad
    assert module_cycles(src) == []  # a lazy import is no cycle, but it is still upward
    models = src / "models" / "flops.py"
    models.write_text("from dsdebug.models.deepseek import build_deepseek_v3\n" + models.read_text())
    deepseek = src / "models" / "deepseek.py"
    deepseek.write_text("from dsdebug.models.flops import flops_per_token\n" + deepseek.read_text())
    assert any({"dsdebug.models.flops", "dsdebug.models.deepseek"} <= set(c) for c in module_cycles(src))


def test_relative_and_dynamic_imports_are_held_to_the_layers(tmp_path):
    """A relative import or an ``importlib.import_module`` of an upper layer is caught like a plain one."""
    src = tmp_path / "src"
    shutil.copytree(REPO / "src", src, ignore=shutil.ignore_patterns("__pycache__"))
    sinks = src / "findings" / "sinks.py"
    sinks.write_text(sinks.read_text() + "\n\ndef _late():\n    from ..callbacks import base  # planted\n")
    ranks = src / "findings" / "ranks.py"
    ranks.write_text(ranks.read_text() + "\n\ndef _late():\n    import importlib\n"
                     "    return importlib.import_module('dsdebug.trainer.entry')  # planted\n")
    channel = src / "findings" / "channel.py"
    channel.write_text(channel.read_text() + "\n\ndef _own():\n    from . import ranks  # same layer: fine\n")
    bad = violations(src)
    assert len(bad) == 2, bad
    assert any("src/findings/sinks.py" in b and "dsdebug.callbacks" in b for b in bad), bad
    assert any("src/findings/ranks.py" in b and "dsdebug.trainer.entry" in b for b in bad), bad


def _declared_all(tree: ast.Module) -> list | None:
    """The literal ``__all__`` of a module (None: not declared)."""
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else \
            node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(target, ast.Name) and target.id == "__all__":
            if isinstance(node.value, ast.Call):  # sorted(_MODULES): a lazy package's names, from its own table
                return []
            return ast.literal_eval(node.value)
    return None


def _top_level_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                names |= {e.id for e in (t.elts if isinstance(t, ast.Tuple) else [t]) if isinstance(e, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def test_every_module_declares_its_public_names():
    """``__all__`` on every module of the package (a script's ``__main__`` aside), each name defined or re-exported
    there: what a module offers is declared, not guessed from underscores (Composer's rule)."""
    problems = []
    for path in sorted((REPO / "src").rglob("*.py")):
        if path.name == "__main__.py":
            continue
        tree = ast.parse(path.read_text())
        declared = _declared_all(tree)
        if declared is None:
            problems.append(f"{path.relative_to(REPO)}: no __all__")
            continue
        defined = _top_level_names(tree)
        if "__getattr__" in defined:  # a lazy package: its __getattr__ imports what __all__ names on first use
            continue
        missing = [n for n in declared if n not in defined]
        if missing:
            problems.append(f"{path.relative_to(REPO)}: __all__ names {missing}, not defined there")
    assert not problems, "\n".join(problems)
