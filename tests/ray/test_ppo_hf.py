"""The cpu_tiny_llama preset end to end through a local Ray cluster: the run writes its tiny Llama
checkpoint, trains from it with exact memory switching, and a second run reads it back. Slow
(two runs, about a minute on 2 cores): skipped when CI=true; tests/megatron/test_ppo_from_hf.py
checks in CI that every actor starts from the checkpoint."""

import pytest

from chatlearn_mem_ray import load_config, run_ppo

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ray = pytest.importorskip("ray")
pytest.importorskip("transformers", reason="the [hf] extra (transformers) is not installed")


def test_tiny_llama_preset_writes_its_checkpoint_then_reads_it_back(local_ray, tmp_path):
    overrides = ["ppo.iterations=2", "memory.compare_iterations=0", f"output_dir={tmp_path}"]
    lines = []
    log = run_ppo(load_config("cpu_tiny_llama", overrides), progress=lines.append)
    assert f"wrote a randomly initialised LlamaForCausalLM to {tmp_path / 'hf_tiny_llama'}" in lines
    assert log["status"] == "completed" and [m["iteration"] for m in log["iterations"]] == [1, 2]
    assert log["iterations"][0]["kl"] == 0.0  # policy and reference start from the same weights
    assert log["summary"]["memory_manager_on"]["ratio"] <= 1.1
    assert all(c["equal"] for c in log["sync_checks"])
    lines.clear()
    again = run_ppo(load_config("cpu_tiny_llama", [*overrides, "output_dir_exists=overwrite"]), lines.append)
    assert not any(line.startswith("wrote a randomly") for line in lines)  # read back, not written again
    assert again["iterations"][0]["reward"] == log["iterations"][0]["reward"]  # the same start, the same rollouts
