"""The engine stand-in of the GPU handoff test (tests/gpu/engine_standin.py), its protocol on CPU:
``take`` allocates, writes, frees and says how much; ``hold`` holds until told to release. The
GPU part (what the device reports free, another process's CUDA memory) runs in tests/gpu only."""

import json
import subprocess
import sys
from pathlib import Path

STANDIN = Path(__file__).resolve().parents[1] / "gpu" / "engine_standin.py"
N = 8 * 2**20


def test_take_allocates_writes_and_reports_the_bytes():
    out = subprocess.run(
        [sys.executable, str(STANDIN), "take", "--device", "cpu", "--bytes", str(N)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["got_bytes"] == N and got["written"] and got["seconds"] >= 0
    assert got["free_seen_bytes"] is None  # the CPU reports no free device memory: none is made up


def test_hold_keeps_the_memory_until_released():
    proc = subprocess.Popen(
        [sys.executable, str(STANDIN), "hold", "--device", "cpu", "--bytes", str(N)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        held = json.loads(proc.stdout.readline())
        assert held == {"holding_bytes": N, "free_seen_bytes": None, "written": True}
        assert proc.poll() is None  # still holding
        proc.stdin.write("release\n")
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline()) == {"released": True}
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_cpu_needs_an_explicit_size():
    out = subprocess.run(
        [sys.executable, str(STANDIN), "take", "--device", "cpu"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0 and "--device cpu needs --bytes" in out.stderr
