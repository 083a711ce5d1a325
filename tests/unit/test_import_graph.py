"""The library's modules import each other one way: no loop, not even one for type hints.

A loop of imports is a sign the owner is missing (STYLE.md 12): the lower module gets a small
``Protocol`` for what it needs of the higher one instead. Read from the source with ``ast``, so
imports under ``if TYPE_CHECKING:`` and inside functions count too; nothing is imported.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "chatlearn_mem"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """``module -> the chatlearn_mem modules it imports``, every import statement in the file."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1 packages
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                # ``from pkg import sub`` imports the submodule where one has that name
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_is_read():
    graph = _import_graph()
    assert "chatlearn_mem.storage" in graph["chatlearn_mem.parts_state"]
    assert "chatlearn_mem.mcore.checks" in graph["chatlearn_mem.mcore.backend"]  # ``from pkg import sub``
    assert "chatlearn_mem.trainer" in graph["chatlearn_mem.checkpoint_serving"]  # inside a function


def test_a_loop_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_the_library_imports_one_way():
    graph = _import_graph()
    loops = _cycles(graph)
    described = ["; ".join(f"{m} -> {', '.join(sorted(graph[m] & set(loop)))}" for m in loop) for loop in loops]
    assert not loops, "modules that import each other (give the lower one a Protocol):\n" + "\n".join(described)
