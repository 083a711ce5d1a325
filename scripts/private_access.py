"""Count the private names one module reaches in another.

Walks the packages' folders with :mod:`ast` and counts, per module:

* attribute reads and writes ``x._name`` (one leading underscore, not a dunder) where ``x`` is
  not ``self`` or ``cls``: a module's own private names are reached through ``self``, anything
  else is another object's private state;
* ``from module import _name`` where ``module`` is another module of the project.

An attribute access counts as ``own`` when the module itself defines that name (a method, a class
attribute, or ``self._name = ...``), a heuristic for "a class of this module reaching another of
its objects", and as ``cross`` otherwise. Prints one line per module with a nonzero count
(attribute accesses, of which cross-module, private imports, total) and the overall totals. Run: ``python scripts/private_access.py [--list]`` from the repository root;
``--list`` also prints every access with its line.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("chatlearn_mem", "config_files", "ray_actors", "benchmarks", "cli")
PROJECT = (
    "chatlearn_mem",
    "chatlearn_mem_config_files",
    "chatlearn_mem_ray",
    "chatlearn_mem_bench",
    "chatlearn_mem_cli",
)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined(tree: ast.AST) -> set[str]:
    """Private names the module defines: functions, class attributes, ``self._name`` targets."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                out.add(node.attr)
    return {n for n in out if _private(n)}


def accesses(path: Path) -> tuple[list[str], list[str], list[str]]:
    """The private attribute accesses (all, and those to names the module does not define) and the
    private imports of one file, each as ``line: text``."""
    attrs, cross, imports = [], [], []
    tree = ast.parse(path.read_text(), str(path))
    own = _defined(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                attrs.append(f"{node.lineno}: {ast.unparse(node)}")
                if node.attr not in own:
                    cross.append(attrs[-1])
        elif isinstance(node, ast.ImportFrom):
            other = node.level > 0 or (node.module or "").split(".")[0] in PROJECT
            if other:
                imports += [
                    f"{node.lineno}: from {node.module} import {a.name}" for a in node.names if _private(a.name)
                ]
    return attrs, cross, imports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--list", action="store_true", help="print every access with its line")
    args = parser.parse_args()
    total_attrs = total_cross = total_imports = 0
    print(f"{'module':<44} {'attr':>5} {'cross':>5} {'import':>6} {'total':>6}")
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            attrs, cross, imports = accesses(path)
            if not attrs and not imports:
                continue
            total_attrs += len(attrs)
            total_cross += len(cross)
            total_imports += len(imports)
            name = str(path.relative_to(ROOT))
            print(f"{name:<44} {len(attrs):>5} {len(cross):>5} {len(imports):>6} {len(attrs) + len(imports):>6}")
            if args.list:
                for line in attrs + imports:
                    print(f"    {line}{'' if line in cross or line in imports else '  (own)'}")
    total = total_attrs + total_imports
    print(f"{'total':<44} {total_attrs:>5} {total_cross:>5} {total_imports:>6} {total:>6}")


if __name__ == "__main__":
    main()
