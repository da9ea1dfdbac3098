"""benchmarks/: the scripts import each other without a loop (a driver imports its worker and report, they import
the shared pieces, never the driver back), counting imports inside functions too."""

from __future__ import annotations

import ast

from tests.helpers.runs import REPO

BENCH = REPO / "benchmarks"


def _imports() -> dict[str, set[str]]:
    local = {p.stem for p in BENCH.glob("*.py")}
    graph = {}
    for path in BENCH.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module.split(".")[0])
        graph[path.stem] = (found & local) - {path.stem}
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
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
