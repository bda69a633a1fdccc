"""The layers' arrows: server/ → engine/ → cache/ → kernels/, never back up; the HTTP side never
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
