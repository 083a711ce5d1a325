"""GRPO on the colocation service end to end through a local Ray cluster (CPU, gloo, megatron-core):
it learns, its memory peak is its largest phase, there is no critic and (with the KL coefficient 0)
no reference, a killed actor is restarted and the run ends bit-identical, a device budget trains
the same, and a tensor-parallel policy runs."""

import os
import signal

import pytest
from golden_outcome import outcome

from chatlearn_mem_ray import load_grpo_config, run_grpo

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")
SHORT = ["grpo.iterations=4", "memory.compare_iterations=0", "ray.phase_timeout_s=180"]
# what a device budget's residency plan changes (bytes moved and held per phase), not the training
BUDGET_DEPENDENT = {"moved_in_bytes", "moved_out_bytes", "phase_colocated_bytes", "peak_device_bytes", "budget_bytes"}


def test_grpo_learns_on_cpu_grpo_with_its_largest_phase_as_the_peak(local_ray, tmp_path):
    lines = []
    log = run_grpo(load_grpo_config("cpu_grpo", [f"output_dir={tmp_path}"]), progress=lines.append)
    its = [m for m in log["iterations"] if m["manager_on"]]
    assert len(its) == 20 and log["status"] == "completed"
    first, last = its[:5], its[-5:]
    mean = lambda ms, k="reward": sum(m[k] for m in ms) / len(ms)  # noqa: E731
    assert mean(last) > mean(first) + 0.3, [round(m["reward"], 3) for m in its]  # it learns
    assert mean(last, "entropy") < mean(first, "entropy")  # and grows sure of itself
    for m in its:  # the figures GRPO logs
        assert 0 <= m["clip_fraction"] <= 1 and m["entropy"] > 0 and m["kl"] >= 0
        assert set(m["phase_seconds"]) == {"generate", "reference", "train"}
    on, off = log["summary"]["memory_manager_on"], log["summary"]["memory_manager_off"]
    assert on["ratio"] == 1.0 and on["largest_phase"] == "train", on
    assert off["ratio"] > 1.0  # three models resident at once
    actors = {a for p in log["memory_timeline"] for a in p["device_bytes"]}
    assert actors == {"policy_0", "rollout", "reference"}  # no critic anywhere
    assert any(line.startswith("starting 3 actors (policy, rollout, reference)") for line in lines)
    assert log["audits"]["runs"] == log["audits"]["checks_clean"] == 20 * 3
    # the rollout equalled the policy after every sync: the digests themselves (a SHA-256 of every
    # tensor), taken on both sides; and the policy really changed between syncs
    syncs = [c for c in log["sync_checks"] if c["manager_on"]]
    assert [c["iteration"] for c in syncs] == list(range(1, 21))
    assert all(c["policy"] == c["rollout"] and len(c["policy"][0]) == 64 for c in log["sync_checks"])
    assert len({c["policy"][0] for c in syncs}) == 20


def test_without_a_kl_term_no_reference_is_launched(local_ray, tmp_path):
    lines = []
    cfg = load_grpo_config("cpu_grpo", ["grpo.kl_coef=0", "grpo.iterations=2", f"output_dir={tmp_path}"])
    log = run_grpo(cfg, progress=lines.append)
    assert any(line.startswith("starting 2 actors (policy, rollout)") for line in lines), lines
    assert {a for p in log["memory_timeline"] for a in p["device_bytes"]} == {"policy_0", "rollout"}
    assert {p["phase"] for p in log["memory_timeline"]} == {"generate", "train"}
    assert all("kl" not in m for m in log["iterations"])
    assert log["summary"]["memory_manager_on"]["ratio"] == 1.0


@pytest.fixture(scope="module")
def undisturbed(local_ray, tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo_undisturbed")
    return run_grpo(load_grpo_config("cpu_grpo", [*SHORT, f"output_dir={out}"]), progress=lambda line: None)


def test_a_killed_actor_is_restarted_and_the_grpo_run_ends_bit_identical(undisturbed, tmp_path):
    cfg = load_grpo_config(
        "cpu_grpo", [*SHORT, f"output_dir={tmp_path}", "checkpoint.every=1", "checkpoint.max_restarts=1"]
    )
    killed = []

    def kill_policy(svc, iteration, phase):
        if (iteration, phase) == (2, "reference") and not killed:
            pid = ray.get(svc.actors("policy")[0].pid.remote())
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    log = run_grpo(cfg, progress=lambda line: None, on_phase=kill_policy)
    assert killed and log["status"] == "completed"
    [restart] = log["restarts"]
    assert (restart["actor"], restart["phase"], restart["iteration"]) == ("policy_0", "reference", 3)
    assert outcome(log) == outcome(undisturbed)


def test_a_device_budget_trains_the_same_within_it(undisturbed, tmp_path):
    log = run_grpo(
        load_grpo_config("cpu_grpo", [*SHORT, f"output_dir={tmp_path}", "memory.device_budget_mb=2.5"]),
        progress=lambda line: None,
    )
    strip = lambda o: [{k: v for k, v in m.items() if k not in BUDGET_DEPENDENT} for m in o["iterations"]]  # noqa: E731
    assert strip(outcome(log)) == strip(outcome(undisturbed))
    assert outcome(log)["final_weights"] == outcome(undisturbed)["final_weights"]
    plan = log["residency_plan"]["0"]
    assert plan["phases"] == ["generate", "reference", "train"] and plan["bytes_moved"] < plan["all_or_nothing_bytes"]
    assert all(p["bundle_bytes"]["0"] <= 2.5 * 2**20 for p in log["memory_timeline"]) and not log["over_budget"]


@pytest.mark.slow  # as PPO's tensor-parallel run; the vocabulary-parallel entropy has its multirank test
def test_a_tensor_parallel_policy_trains_with_grpo(local_ray, tmp_path):
    """TP=2: the entropy is all-reduced over the vocabulary's two halves; the run completes with
    finite figures and the rollout synced from both ranks' shards."""
    tp2 = ["parallel.world_size=2", "parallel.tensor_model_parallel_size=2", "grpo.iterations=2"]
    log = run_grpo(load_grpo_config("cpu_grpo", [*tp2, f"output_dir={tmp_path}"]), progress=lambda line: None)
    assert log["status"] == "completed"
    assert all(c["policy"] == c["rollout"] and len(c["policy"]) == 2 for c in log["sync_checks"])
    assert all(0 < m["entropy"] <= 4.2 for m in log["iterations"])  # below log(64): a distribution, not a sum
    assert sorted(log["final_weights"]) == ["policy_0", "policy_1"]
