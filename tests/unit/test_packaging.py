"""The wheel's package map: each package lives in the folder of its name, and every package ships."""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "chatlearn_mem",
    "chatlearn_mem_ray",
    "chatlearn_mem_bench",
    "chatlearn_mem_config_files",
    "chatlearn_mem_cli",
)
OLD_FOLDERS = ("ray_actors", "benchmarks", "config_files", "cli")
"""What the packages' folders were called before each took its package's name."""


def _setuptools_table() -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_each_package_lives_in_the_folder_of_its_name():
    """``chatlearn_mem_ray.service.colocation`` is ``chatlearn_mem_ray/service/colocation.py``: a
    reader (and any tool that follows imports by path) maps an import to its file without knowing
    the packaging. Only the presets, data and no code, are mapped from ``configs/``."""
    dirs = _setuptools_table()["package-dir"]
    code_mapped = {pkg: folder for pkg, folder in dirs.items() if any((ROOT / folder).glob("[!_]*.py"))}
    assert not code_mapped, f"packages of code mapped from another folder: {code_mapped}"
    assert all(pkg.rpartition(".")[2].endswith("presets") for pkg in dirs), sorted(dirs)
    for package in PACKAGES:
        assert (ROOT / package / "__init__.py").is_file(), f"{package} has no folder of its name"
    for old in OLD_FOLDERS:
        assert not any((ROOT / old).glob("*.py")), f"{old}/ holds code again; it lives in the folder of its package"


def test_code_imports_no_folder_name():
    """``import benchmarks`` would import an unrelated PyPI package, ``import cli`` anyone's."""
    bad = []
    for folder in (*PACKAGES, "configs", "tests", "examples", "scripts"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else ([node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
                )
                bad += [
                    f"{path.relative_to(ROOT)}:{node.lineno} imports {n!r}"
                    for n in names
                    if n.split(".")[0] in OLD_FOLDERS
                ]
    assert not bad, "\n".join(bad)


def _folder(package: str, dirs: dict) -> str:
    if package in dirs:
        return dirs[package]
    parent, _, leaf = package.rpartition(".")
    return f"{_folder(parent, dirs)}/{leaf}" if parent else package


def test_every_package_folder_ships_in_the_wheel():
    """A new subpackage must be added to ``[tool.setuptools].packages``, or the wheel lacks it
    (an editable install would still find it, so only the wheel check would notice)."""
    table = _setuptools_table()
    shipped = {_folder(p, table["package-dir"]) for p in table["packages"]}
    present = {
        str(init.parent.relative_to(ROOT))
        for top in (*PACKAGES, "configs")
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
