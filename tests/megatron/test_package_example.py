"""The example in ``chatlearn_mem/__init__.py``'s docstring runs as written, in a fresh process."""

import subprocess
import sys
import textwrap

import torch

import chatlearn_mem

MARKER = "Example (runs as written; a test runs it)::\n"


def package_example() -> str:
    doc = chatlearn_mem.__doc__
    assert MARKER in doc, "the package docstring lost its example"
    block = doc.split(MARKER, 1)[1]
    lines = []
    for line in block.splitlines()[1:]:  # the blank line after '::' first
        if line and not line.startswith("    "):
            break  # the first unindented line ends the literal block
        lines.append(line)
    return textwrap.dedent("\n".join(lines))


def test_the_package_docstring_example_runs():
    code = package_example()
    assert "TrainerMemoryManager" in code and "mm.audit().ok" in code
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # the CPU backend is installed because the example asked for it, and it said so
    assert ("the CPU backend is on" in out.stderr) == (not torch.cuda.is_available()), out.stderr[-3000:]


def test_every_name_in_all_is_importable_and_documented():
    for name in chatlearn_mem.__all__:
        obj = getattr(chatlearn_mem, name)
        assert obj.__doc__, f"chatlearn_mem.{name} has no docstring"
