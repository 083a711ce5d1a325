"""Count the private names one module reaches in another.

Walks the packages' folders with :mod:`ast` and counts, per module:

* attribute reads and writes ``x._name`` (one leading underscore, not a dunder) where ``x`` is
  not ``self`` or ``cls``: a module's own private names are reached through ``self``, anything
  else is another object's private state;
* ``from module import _name`` where ``module`` is another module of the project.

Prints one line per module with a nonzero count (attribute accesses, private imports, total) and
the overall total. Run: ``python scripts/private_access.py [--list]`` from the repository root;
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


def accesses(path: Path) -> tuple[list[str], list[str]]:
    """The private attribute accesses and the private imports of one file, as ``line: text``."""
    attrs, imports = [], []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                attrs.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom):
            other = node.level > 0 or (node.module or "").split(".")[0] in PROJECT
            if other:
                imports += [
                    f"{node.lineno}: from {node.module} import {a.name}" for a in node.names if _private(a.name)
                ]
    return attrs, imports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--list", action="store_true", help="print every access with its line")
    args = parser.parse_args()
    total_attrs = total_imports = 0
    print(f"{'module':<44} {'attr':>5} {'import':>6} {'total':>6}")
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            attrs, imports = accesses(path)
            if not attrs and not imports:
                continue
            total_attrs += len(attrs)
            total_imports += len(imports)
            name = str(path.relative_to(ROOT))
            print(f"{name:<44} {len(attrs):>5} {len(imports):>6} {len(attrs) + len(imports):>6}")
            if args.list:
                for line in attrs + imports:
                    print(f"    {line}")
    print(f"{'total':<44} {total_attrs:>5} {total_imports:>6} {total_attrs + total_imports:>6}")


if __name__ == "__main__":
    main()
