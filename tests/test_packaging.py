"""The distribution installs exactly one top-level import name, `v4serve`: the wheel built from this
tree holds nothing else, every package folder is in it, and no code imports the folders under their
bare names."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("server", "engine", "cache", "kernels")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    """The wheel `pip install .` would install, built from a copy of the tree (no build files here)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("dist")
    # The venv's setuptools (a test dependency), so the build needs no network.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(src)], check=True, capture_output=True, text=True)
    (built,) = out.glob("v4serve-*.whl")
    return zipfile.ZipFile(built)


def test_wheel_ships_only_the_v4serve_namespace(wheel: zipfile.ZipFile) -> None:
    tops = {name.split("/")[0] for name in wheel.namelist() if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"v4serve"}
    top_level = next(n for n in wheel.namelist() if n.endswith(".dist-info/top_level.txt"))
    assert wheel.read(top_level).decode().split() == ["v4serve"]


def test_wheel_holds_every_package_and_module(wheel: zipfile.ZipFile) -> None:
    shipped = set(wheel.namelist())
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            assert f"v4serve/{path.relative_to(ROOT).as_posix()}" in shipped, path


def test_console_script_points_into_the_namespace(wheel: zipfile.ZipFile) -> None:
    entry_points = next(n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt"))
    assert "v4serve = v4serve.server.cli:main" in wheel.read(entry_points).decode()


def test_installed_names_outside_the_source_tree(tmp_path: Path) -> None:
    """From another folder (so the checkout is not on sys.path) `v4serve.*` imports and the bare
    folder names do not."""
    probe = ("import importlib.util as u, v4serve.server.cli, v4serve.kernels.attention; "
             f"print([n for n in {FOLDERS!r} if u.find_spec(n) is not None])")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_no_code_imports_a_folder_by_its_bare_name() -> None:
    offenders = []
    for path in ROOT.rglob("*.py"):
        if any(part.startswith(".") for part in path.relative_to(ROOT).parts):  # .venv, .agents (installed code)
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in FOLDERS]
    assert not offenders
