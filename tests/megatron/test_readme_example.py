"""The README's API example runs as printed, in a fresh interpreter, and proves its own outcome.

The example is the first ```python block after the ``<!-- readme-example`` marker in the README's
"Use" section. It builds a megatron-core trainer (the CPU backend on a machine without CUDA), puts
it to sleep between steps and asserts that the device bytes go to 0, that the audit is clean and
that the losses equal those of an identical trainer never put to sleep; here it must exit 0 and
print one line per step.
"""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
MARKER = "<!-- readme-example"


def readme_example() -> str:
    text = README.read_text(encoding="utf-8")
    assert text.count(MARKER) == 1, f"README.md must hold exactly one {MARKER!r} marker"
    use = text.index("\n## Use\n")
    start = text.index(MARKER)
    assert use < start < text.index("\n## ", use + 1), "the marked example must be in the README's 'Use' section"
    m = re.compile(r"^```python\n(.*?)^```$", re.S | re.M).search(text, start)
    assert m, "no ```python block after the readme-example marker"
    return m.group(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_readme_example_is_the_marked_block():
    code = readme_example()
    compile(code, "README.md", "exec")
    for name in (
        "TrainerMemoryManager",
        "cpu_backend.install()",
        "mm.offload()",
        "mm.onload()",
        "mm.audit().ok",
        "residency()",
    ):
        assert name in code, f"the README example no longer shows {name}"
    assert 15 <= len(code.splitlines()) <= 30, "keep the README example about 20 lines"


def test_readme_example_runs_and_proves_its_outcome(tmp_path):
    # gpt.init_distributed() rendezvous through env:// (MASTER_PORT 29500 unless set): a port of
    # its own, so that tests running beside this one cannot collide with it.
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    proc = subprocess.run(
        [sys.executable, "-c", readme_example()], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-6000:]}"
    steps = re.findall(r"^step (\d): loss [0-9.]+, ([0-9.]+) MiB awake, 0 B asleep$", proc.stdout, re.M)
    assert [s for s, _ in steps] == ["0", "1", "2"], proc.stdout
    assert all(float(mib) > 0 for _, mib in steps), proc.stdout
