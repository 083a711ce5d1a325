"""The wheel's package map: folder names are never imported, and every package ships."""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDER_NAMES = {
    "ray_actors": "chatlearn_mem_ray",
    "benchmarks": "chatlearn_mem_bench",
    "config_files": "chatlearn_mem_config_files",
    "cli": "chatlearn_mem_cli",
}


def _setuptools_table() -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_code_imports_the_installed_names_not_the_folder_names():
    """``import ray_actors`` works only from a checkout's root (the folder is on sys.path there)
    and gives a second copy of the package beside ``chatlearn_mem_ray``; installed, it fails."""
    bad = []
    for folder in (
        "chatlearn_mem",
        "ray_actors",
        "benchmarks",
        "config_files",
        "cli",
        "configs",
        "tests",
        "examples",
        "scripts",
    ):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else ([node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
                )
                bad += [
                    f"{path.relative_to(ROOT)}:{node.lineno} imports {n!r}; use {FOLDER_NAMES[n.split('.')[0]]!r}"
                    for n in names
                    if n.split(".")[0] in FOLDER_NAMES
                ]
    assert not bad, "\n".join(bad)


def _folder(package: str, dirs: dict) -> str:
    if package in dirs:
        return dirs[package]
    parent, _, leaf = package.rpartition(".")
    return f"{_folder(parent, dirs)}/{leaf}"


def test_every_package_folder_ships_in_the_wheel():
    """A new subpackage must be added to ``[tool.setuptools].packages``, or the wheel lacks it
    (an editable install would still find it, so only the wheel check would notice)."""
    table = _setuptools_table()
    shipped = {_folder(p, table["package-dir"]) for p in table["packages"]}
    present = {
        str(init.parent.relative_to(ROOT))
        for top in ("chatlearn_mem", "ray_actors", "benchmarks", "config_files", "cli", "configs")
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert present == shipped, (
        f"not shipped: {sorted(present - shipped)}; listed but missing: {sorted(shipped - present)}"
    )


def test_the_core_imports_nothing_of_the_command_line():
    """``chatlearn_mem`` is a library: YAML, typer and Ray belong to the command line and the apps
    (the config loader lived in ``chatlearn_mem.config`` and imported yaml there)."""
    edge = {
        "yaml",
        "typer",
        "click",
        "ray",
        "chatlearn_mem_cli",
        "chatlearn_mem_ray",
        "chatlearn_mem_bench",
        "chatlearn_mem_config_files",
    }
    bad = []
    for path in (ROOT / "chatlearn_mem").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            )
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n!r}" for n in names if n.split(".")[0] in edge]
    assert not bad, "\n".join(bad)
