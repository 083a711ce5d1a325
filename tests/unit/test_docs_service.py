"""docs/service.md shows the example loop's own code: the block under its marker is, line for
line, the ``BestOfNLoop`` class of examples/best_of_n.py up to its ``progress_line`` (the page
cannot drift from the loop a test runs); and a loop of one's own needs nothing but the package's
public names."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_service_page_shows_the_example_loops_code():
    page = (ROOT / "docs" / "service.md").read_text()
    block = re.search(r"<!-- service-example:[^>]*-->\n```python\n(.*?)```", page, re.S).group(1)
    example = (ROOT / "examples" / "best_of_n.py").read_text()
    start = example.index("class BestOfNLoop(Loop):")
    end = example.index("    def progress_line(", start)
    assert block.strip() == example[start:end].strip()


def test_the_example_loop_imports_only_the_public_names():
    """What ``examples/best_of_n.py`` imports of the app is ``chatlearn_mem_ray``'s ``__all__``: a
    user writing a loop from docs/service.md never reaches into its modules."""
    import chatlearn_mem_ray

    tree = ast.parse((ROOT / "examples" / "best_of_n.py").read_text())
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    deep = [
        n.module for n in imports if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("chatlearn_mem_ray.")
    ]
    deep += [
        a.name for n in imports if isinstance(n, ast.Import) for a in n.names if a.name.startswith("chatlearn_mem_ray.")
    ]
    assert not deep, f"the example imports from the app's modules: {deep}"
    names = [
        a.name for n in imports if isinstance(n, ast.ImportFrom) and n.module == "chatlearn_mem_ray" for a in n.names
    ]
    assert names and set(names) <= set(chatlearn_mem_ray.__all__), set(names) - set(chatlearn_mem_ray.__all__)
