"""The layers' arrows: server/ → engine/ → cache/ → kernels/, never back up; inside engine/, the
process plumbing (engine/process/) uses the runtime and the network (engine/model/), never the other
way round; no module imports one that imports it back, however long the circle; the HTTP side never
reaches into the engine's scheduler, cache or sampler (it reads the engine's stats snapshot); the
engine never handles text."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("server", "engine", "cache", "kernels")  # each may import itself and the ones after it


def modules(folder: str) -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text())) for p in sorted((ROOT / folder).rglob("*.py"))]


def imported(tree: ast.Module) -> set[str]:
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    return names


@pytest.mark.parametrize("folder", LAYERS)
def test_imports_point_down_only(folder: str) -> None:
    above = set(LAYERS[: LAYERS.index(folder)])
    bad = [f"{p.relative_to(ROOT)}: {name}" for p, tree in modules(folder) for name in imported(tree)
           if name.startswith("v4serve.") and name.split(".")[1] in above]
    assert not bad


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("v4serve", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def import_graph() -> dict[str, set[str]]:
    """Each v4serve module → the v4serve modules it imports anywhere in its file (at the top, in a
    function, under TYPE_CHECKING: a circle is a circle wherever its import stands)."""
    trees = {module_name(p): tree for folder in LAYERS for p, tree in modules(folder)}
    graph: dict[str, set[str]] = {name: set() for name in trees}
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                # `from package import module` imports the module; `from module import name` the module
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in trees else node.module
                           for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in trees and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_one_that_imports_it_back() -> None:
    assert circles(import_graph()) == []


def test_the_circle_check_finds_circles() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_runtime_never_imports_the_process_plumbing() -> None:
    """engine/ (scheduler, engine step, sampler, request, grammar) and engine/model/ run the same in
    any process arrangement; how they are run lives in engine/process/."""
    graph = import_graph()
    bad = [f"{name}: {target}" for name, targets in graph.items() for target in targets
           if name.startswith("v4serve.engine.") and not name.startswith("v4serve.engine.process")
           and target.startswith("v4serve.engine.process")]
    assert not bad


def test_the_http_side_never_touches_engine_internals() -> None:
    internals = {"scheduler", "kv", "device_kv", "sampler", "requests_by_id"}
    bad = [f"{p.relative_to(ROOT)}:{n.lineno} .{n.attr}" for p, tree in modules("server") for n in ast.walk(tree)
           if isinstance(n, ast.Attribute) and n.attr in internals]
    assert not bad


def test_the_engine_speaks_token_ids_only() -> None:
    text = {"tokenizers", "v4serve.server.text", "codecs"}
    bad = [f"{p.relative_to(ROOT)}: {name}" for p, tree in modules("engine") for name in imported(tree)
           if any(name == t or name.startswith(t + ".") for t in text)]
    assert not bad
