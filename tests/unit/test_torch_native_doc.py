"""docs/torch-native.md's example runs as printed, in a fresh interpreter, and proves its own outcome:
a DDP trainer on one gloo rank put to sleep between steps, 0 bytes asleep, the audit clean, the
losses those of a twin never put to sleep. Megatron-free, like the rest of this tier."""

import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "torch-native.md"
MARKER = "<!-- torch-native-example"


def doc_example() -> str:
    text = DOC.read_text(encoding="utf-8")
    assert text.count(MARKER) == 1, f"{DOC.name} must hold exactly one {MARKER!r} marker"
    m = re.compile(r"^```python\n(.*?)^```$", re.S | re.M).search(text, text.index(MARKER))
    assert m, "no ```python block after the marker"
    return m.group(1)


def test_the_example_shows_the_calls():
    code = doc_example()
    compile(code, DOC.name, "exec")
    for name in ("TrainerMemoryManager", "DistributedDataParallel", "mm.offload()", "mm.audit().ok", "residency()"):
        assert name in code, f"the example no longer shows {name}"


def test_the_example_runs_and_proves_its_outcome(tmp_path):
    code = "import sys\n" + doc_example() + "\nprint(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron'))\n"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-6000:]}"
    steps = re.findall(r"^step (\d): loss [0-9.]+, ([0-9.]+) KiB awake, 0 B asleep$", proc.stdout, re.M)
    assert [s for s, _ in steps] == ["0", "1", "2"], proc.stdout
    assert all(float(kib) > 0 for _, kib in steps)
    assert proc.stdout.strip().splitlines()[-1] == "[]"  # megatron never imported
