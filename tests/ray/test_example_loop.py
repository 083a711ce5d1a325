"""examples/best_of_n.py, a loop of one's own on the colocation service, runs end to end as a user
runs it (its own process, its own local Ray cluster): its iterations, its memory figure, its log."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray
pytest.importorskip("ray")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "best_of_n.py"


def test_the_best_of_n_example_runs_with_its_memory_figure(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "best_of_n.iterations=3",
            f"output_dir={tmp_path}",
            "memory.compare_iterations=1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert sum(line.startswith("iter ") for line in lines) == 4  # 3, and one with the manager off
    assert any(line.startswith("starting 2 actors (policy, rollout)") for line in lines)
    assert "memory manager on: peak colocated" in out.stdout and "= 1.000" in out.stdout
    log = json.loads((tmp_path / "log.json").read_text())
    assert log["status"] == "completed" and [m["iteration"] for m in log["iterations"]] == [1, 2, 3, 1]
    assert all(0 <= m["best"] <= 1 and m["best"] >= m["reward"] for m in log["iterations"])
    assert {p["phase"] for p in log["memory_timeline"]} == {"generate", "train"}
    assert log["summary"]["memory_manager_on"]["ratio"] == 1.0 and (tmp_path / "memory_timeline.png").exists()


def test_a_bad_override_of_the_example_is_one_error_line_and_exit_code_2(tmp_path):
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "best_of_n.n=1", f"output_dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and out.stderr.startswith("error: ") and "best_of_n.n" in out.stderr, out.stderr
