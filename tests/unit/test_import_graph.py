"""The project's modules import each other one way: no loop, not even one for type hints, and the
app's layers only downwards.

A loop of imports is a sign the owner is missing (STYLE.md 12): the lower module gets a small
``Protocol`` for what it needs of the higher one instead. The app (``chatlearn_mem_ray``) is arranged
by role, each layer importing only the layers below it: loops -> job -> service -> actors ->
config -> inputs -> errors; its top-level ``__init__`` (the public surface) and ``_moved`` (old
paths) sit above all of them and nothing inside imports them. Read from the source with ``ast``, so
imports under ``if TYPE_CHECKING:`` and inside functions count too; nothing is imported. The one
exception: a module-level ``__getattr__`` (and the config's ``moved``) that hands out a name
which moved elsewhere is a redirect for old callers, not a dependency.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "chatlearn_mem"
PACKAGES = (
    "chatlearn_mem",
    "chatlearn_mem_config_files",
    "chatlearn_mem_bench",
    "chatlearn_mem_ray",
    "chatlearn_mem_cli",
)
"""Every package of the project, the library first: each may import only those before it (the
benchmark and the app are side by side: neither imports the other)."""
APP_LAYERS = ("errors", "inputs", "config", "actors", "service", "job", "loops")
"""The app's layers from the bottom: ``chatlearn_mem_ray.<layer>`` (a module or a folder)."""
REDIRECTS = ("__getattr__", "moved")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _statements(tree: ast.Module):
    """Every node of a module but the bodies of its module-level redirect functions."""
    for top in tree.body:
        if isinstance(top, ast.FunctionDef) and top.name in REDIRECTS:
            continue
        yield from ast.walk(top)


def _import_graph(packages=("chatlearn_mem",)) -> dict[str, set[str]]:
    """``module -> the project's modules it imports``, every import statement in the file."""
    modules = {_module_name(p): p for package in packages for p in (ROOT / package).rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _statements(ast.parse(path.read_text(), str(path))):
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


def _layer(module: str) -> int:
    """Where an app module sits: its layer's index; above every layer for the public surface."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] not in APP_LAYERS:  # chatlearn_mem_ray itself, _moved
        return len(APP_LAYERS)
    return APP_LAYERS.index(parts[1])


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import that goes against the order: a package importing a later one, an app module
    importing a higher layer or the public surface."""
    bad = []
    for module, targets in graph.items():
        top = module.split(".")[0]
        for target in sorted(targets):
            other = target.split(".")[0]
            if PACKAGES.index(other) > PACKAGES.index(top) or {top, other} == {
                "chatlearn_mem_bench",
                "chatlearn_mem_ray",
            }:
                bad.append(f"{module} imports {target} (a package above it)")
            elif top == other == "chatlearn_mem_ray" and _layer(target) > _layer(module):
                what = APP_LAYERS[_layer(target)] if _layer(target) < len(APP_LAYERS) else "the public surface"
                bad.append(f"{module} imports {target} ({what}, a layer above it)")
    return bad


def test_the_app_graph_is_read():
    graph = _import_graph(PACKAGES)
    assert "chatlearn_mem_ray.service.colocation" in graph["chatlearn_mem_ray.service.service"]
    assert "chatlearn_mem_ray.actors.vllm" in graph["chatlearn_mem_ray.service.colocation"]  # inside a function
    assert "chatlearn_mem_ray.job" in graph["chatlearn_mem_ray.loops.ppo"]
    assert "chatlearn_mem_ray.loops.ppo" not in graph["chatlearn_mem_ray.config"]  # a redirect is no dependency
    assert "chatlearn_mem_ray.loops" in graph["chatlearn_mem_cli.app"]


def test_an_upward_import_is_found():
    graph = {
        "chatlearn_mem_ray.service.service": {"chatlearn_mem_ray.actors.trainer"},  # down: fine
        "chatlearn_mem_ray.job.run": {"chatlearn_mem_ray.loops.ppo"},  # the job knowing a recipe
        "chatlearn_mem_ray.actors.trainer": {"chatlearn_mem_ray"},  # the public surface from inside
        "chatlearn_mem.trainer": {"chatlearn_mem_ray.config"},  # the library knowing the app
        "chatlearn_mem_bench.run": {"chatlearn_mem_ray.config"},  # the benchmark knowing the app
    }
    assert _upward(graph) == [
        "chatlearn_mem_ray.job.run imports chatlearn_mem_ray.loops.ppo (loops, a layer above it)",
        "chatlearn_mem_ray.actors.trainer imports chatlearn_mem_ray (the public surface, a layer above it)",
        "chatlearn_mem.trainer imports chatlearn_mem_ray.config (a package above it)",
        "chatlearn_mem_bench.run imports chatlearn_mem_ray.config (a package above it)",
    ]


def test_the_project_imports_one_way():
    """No loop anywhere, and the app's layers import only downwards (loops -> job -> service ->
    actors -> config -> inputs -> errors): the job runs any loop without knowing a recipe, and the
    service runs actors without knowing the job."""
    graph = _import_graph(PACKAGES)
    loops = _cycles(graph)
    assert not loops, "modules that import each other:\n" + "\n".join("; ".join(loop) for loop in loops)
    bad = _upward(graph)
    assert not bad, "imports against the layers:\n" + "\n".join(bad)
