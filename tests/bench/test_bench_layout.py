"""benchmarks/: the scripts import each other without a loop (a driver imports its worker and report, they import
the shared pieces, never the driver back), counting imports inside functions too; a folder of parts (benchmarks/gpu/,
the GPU check's) counts as modules ``gpu.<part>``. No flat family of ``<name>_*.py`` files beside it."""

from __future__ import annotations

import ast

from tests.helpers.runs import REPO

BENCH = REPO / "benchmarks"


def _name(path) -> str:
    rel = path.relative_to(BENCH).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def _imports() -> dict[str, set[str]]:
    paths = [*BENCH.glob("*.py"), *BENCH.glob("*/*.py")]
    local = {_name(p) for p in paths}
    graph = {}
    for path in paths:
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        found = {f if f in local else f.split(".")[0] for f in found}
        graph[_name(path)] = (found & local) - {_name(path)}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_benchmarks_import_without_a_loop():
    graph = _imports()
    assert graph["overhead"] >= {"overhead_cells", "overhead_report", "overhead_worker"}  # the walk sees late imports
    assert graph["gpu_check"] >= {"gpu.install", "gpu.runs", "gpu.report"}  # the parts are seen
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    stems = [p.stem for p in BENCH.glob("*.py")]
    families = {s.split("_")[0] + "_" + s.split("_")[1] for s in stems if s.count("_") >= 2}
    assert not [f for f in families if sum(s.startswith(f + "_") for s in stems) > 3], sorted(stems)


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
