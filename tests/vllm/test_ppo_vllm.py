"""The cpu_vllm preset end to end through a local Ray cluster: PPO generating with the real vLLM
engine, its weights taken from the sleeping policy's host store before every generate phase,
verified bit for bit by a digest on both sides and by the policy's own log-probs of the sampled
tokens every iteration. (GRPO's vLLM tests kill the engine during a sync and a generate.)"""

import pytest

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")
pytest.importorskip("vllm", reason="vLLM is not installed: see docs/vllm.md")

from chatlearn_mem.engines.vllm_rollout import expected_names  # noqa: E402
from chatlearn_mem_ray import load_config, run_ppo  # noqa: E402

ITERATIONS = 10


def test_ppo_with_the_vllm_engine_syncs_and_verifies_every_iteration(local_ray, tmp_path):
    cfg = load_config("cpu_vllm", [f"ppo.iterations={ITERATIONS}", f"output_dir={tmp_path}"])
    lines = []
    log = run_ppo(cfg, progress=lines.append)
    assert log["status"] == "completed", log.get("error")
    its = [m for m in log["iterations"] if m["manager_on"]]
    assert [m["iteration"] for m in its] == list(range(1, ITERATIONS + 1))
    # every iteration: a complete update, then the policy's log-probs equal the engine's (fp32)
    names = len(expected_names(cfg.policy))
    syncs = [c for c in log["sync_checks"] if c["manager_on"]]
    assert [c["iteration"] for c in syncs] == list(range(1, ITERATIONS + 1))
    assert all(c["engine"] == "vllm" and c["tensors"] == names and c["bytes"] > 0 for c in syncs)
    # each sync's digest, the same on both sides or the run would have stopped: one per policy
    assert all(c["verified"] for c in syncs) and len({c["digest"] for c in syncs}) == ITERATIONS
    assert all(m["logprob_mismatch"]["max"] < 1e-4 for m in log["iterations"])
    assert any(" mm " in line for line in lines)  # on the progress line
    # the policy changed and the engine followed: the KL to the (frozen) reference grows from 0
    assert its[0]["kl"] == pytest.approx(0.0, abs=1e-6) and its[-1]["kl"] > 0.01
    # the sync's time against a plain copy of the same weights from the host store, in the same run
    for m in its:
        ws = m["weight_sync"]
        assert ws["bytes"] > 0 and 0 < ws["share_of_iteration"] < 1 and ws["seconds"] <= m["seconds"]
        assert ws["plain_copy_bytes"] > 0 and ws["vs_plain_copy"] == pytest.approx(
            ws["seconds"] / ws["plain_copy_seconds"]
        )
    summary = log["summary"]["weight_sync"]
    assert summary["iterations"] == ITERATIONS - 1 and summary["vs_plain_copy"]["median"] > 0
    (line,) = [x for x in lines if x.startswith("weight sync: ")]
    assert "of the iteration" in line and "a plain copy of the same weights from the host store" in line
    # on the CPU build the engine cannot sleep: its memory is resident in every phase, and counted
    timeline = [r for r in log["memory_timeline"] if r["manager_on"]]
    assert all(r["device_bytes"]["rollout"] > 2**30 for r in timeline)


def test_a_tensor_parallel_policy_feeds_the_engine_one_merged_bucket_at_a_time(local_ray, tmp_path):
    """TP=2: each policy rank streams its own shards from its host store in small buckets (about
    50 KB: many per sync), the engine's actor merges one bucket of each rank at a time; the
    engine's log-probs then equal the policy's every iteration."""
    tp2 = ["parallel.world_size=2", "parallel.tensor_model_parallel_size=2", "policy.num_query_groups=2"]
    cfg = load_config(
        "cpu_vllm",
        [
            *tp2,
            "ppo.iterations=3",
            "memory.compare_iterations=0",
            "rollout.sync_bucket_mb=0.05",
            f"output_dir={tmp_path}",
        ],
    )
    log = run_ppo(cfg, progress=lambda line: None)
    assert log["status"] == "completed", log.get("error")
    names = len(expected_names(cfg.policy))
    assert [(c["iteration"], c["tensors"]) for c in log["sync_checks"]] == [(i, names) for i in (1, 2, 3)]
    assert all(m["logprob_mismatch"]["max"] < 1e-4 for m in log["iterations"])
    assert log["iterations"][-1]["kl"] > 0  # the engine followed a policy that changed


def test_a_device_budget_counts_the_engine_that_cannot_sleep_in_every_phase(local_ray, tmp_path):
    """On vLLM's CPU build the engine stays resident: the residency plan keeps it in every phase
    and fits the trainers in the rest (1032 MiB: the engine's 1025 MiB and about 7 MiB)."""
    budget = 1032
    cfg = load_config(
        "cpu_vllm",
        [
            "ppo.iterations=3",
            "memory.compare_iterations=0",
            f"memory.device_budget_mb={budget}",
            f"output_dir={tmp_path}",
        ],
    )
    log = run_ppo(cfg, progress=lambda line: None)
    assert log["status"] == "completed", log.get("error")
    plan = log["residency_plan"]["0"]
    assert all("rollout/weights" in resident for resident in plan["resident"])
    assert plan["bytes_moved"] > 0  # the trainers take turns in what the engine leaves
    assert max(r["colocated_bytes"] for r in log["memory_timeline"]) <= budget * 2**20
    assert not log["over_budget"] and all(m["logprob_mismatch"]["max"] < 1e-4 for m in log["iterations"])
