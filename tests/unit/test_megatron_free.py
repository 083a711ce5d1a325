"""The core package and the unit tier stay megatron-free.

In a fresh interpreter: ``import chatlearn_mem`` and every import statement of the unit tier's
test files (top level and inside functions), then check that no ``megatron`` module was loaded.
A unit test that needs megatron-core belongs in tests/megatron/.
"""

import ast
import subprocess
import sys
from pathlib import Path

UNIT = Path(__file__).parent


def _unit_imports() -> list[str]:
    """Every import statement in the unit tier's test files but this one, as source lines."""
    lines = set()
    for path in sorted(UNIT.glob("test_*.py")):
        if path.name == Path(__file__).name:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                lines.update(f"import {a.name}" for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                lines.update(f"from {node.module} import {a.name}" for a in node.names)
    return sorted(lines)


def test_unit_tier_imports_are_read():
    lines = _unit_imports()
    assert "import torch" in lines
    assert any(line.startswith("from chatlearn_mem.storage import") for line in lines)


def test_core_and_unit_tier_do_not_import_megatron():
    lines = ["import chatlearn_mem", *_unit_imports()]
    code = "\n".join(
        [
            "import sys",
            f"sys.path[:0] = {sys.path!r}",  # resolve the packages exactly as this process does
            *lines,
            "loaded = sorted(m for m in sys.modules if m == 'megatron' or m.startswith('megatron.'))",
            "print(repr(loaded[:5]))",
        ]
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", (
        "megatron imported by one of:\n" + "\n".join(lines) + f"\nloaded: {out.stdout}"
    )
