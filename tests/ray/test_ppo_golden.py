"""``chatlearn-mem ppo`` on its default preset (``cpu_tiny``) gives the log it gave before PPO moved
onto the colocation service: every metric of every iteration, the weight-sync digests, every
phase's device bytes, the colocation figures and the final weights, bit for bit
(``golden/ppo_cpu_tiny.json``, recorded before the move; ``golden/record.py`` says how)."""

import json
from pathlib import Path

import pytest
import torch
from golden_outcome import outcome

from chatlearn_mem_ray import load_config, run_ppo

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")
GOLDEN = json.loads((Path(__file__).parent / "golden" / "ppo_cpu_tiny.json").read_text())


def _close(a, b) -> bool:
    """Equal up to float rounding (CPU kernels of another instruction set round differently)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == pytest.approx(b, rel=1e-4, abs=1e-6)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b


def test_the_default_ppo_run_gives_the_recorded_log_bit_for_bit(local_ray, tmp_path):
    log = run_ppo(load_config("cpu_tiny", [f"output_dir={tmp_path}"]), progress=lambda line: None)
    got = json.loads(json.dumps(outcome(log)))  # tuples as the JSON file holds them
    want = GOLDEN["outcome"]
    if torch.backends.cpu.get_cpu_capability() == GOLDEN["cpu_capability"]:
        assert got["iterations"] == want["iterations"]
        assert got == want
    else:  # the digests of trained weights then differ too: compare the metrics, closely
        assert _close(got["iterations"], want["iterations"])
        assert got["phase_bytes"] == want["phase_bytes"] and got["colocation"] == want["colocation"]
