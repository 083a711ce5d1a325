"""The colocated PPO loop end to end through a real local Ray cluster (CPU, gloo, megatron-core)."""

import functools
import json
import math

import pytest

from chatlearn_mem_ray import ActorFailedError, NonFiniteLossError, load_config, run_loop, run_ppo
from chatlearn_mem_ray.ppo import PPO, value_loss

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")
CONFIG = "cpu_tiny"


def test_ppo_iterations_colocated_with_exact_memory_switching(local_ray, tmp_path):
    cfg = load_config(CONFIG, ["ppo.iterations=3", "memory.compare_iterations=1", f"output_dir={tmp_path}"])
    lines = []
    log = run_ppo(cfg, progress=lines.append)

    assert [m["iteration"] for m in log["iterations"]] == [1, 2, 3, 1]  # then manager-off iteration 1
    assert [m["manager_on"] for m in log["iterations"]] == [True, True, True, False]
    assert sum(line.startswith("iter ") for line in lines) == 4
    for m in log["iterations"]:  # each actor's process RSS, every iteration
        assert set(m["rss_bytes"]) == {"policy_0", "critic_0", "rollout", "reference"}, m["rss_bytes"]
        assert all(b > 2**20 for b in m["rss_bytes"].values())
    on, off = log["summary"]["memory_manager_on"], log["summary"]["memory_manager_off"]
    assert on["ratio"] <= 1.1, on
    assert off["ratio"] > 1.8, off  # four models resident at once
    assert on["largest_phase_bytes"] == off["largest_phase_bytes"] > 0

    # With the manager on, every actor outside the phase holds no device memory at all.
    phases = [p for p in log["memory_timeline"] if p["manager_on"]]
    assert len(phases) == 3 * 5
    for p in phases:
        idle = {a: b for a, b in p["device_bytes"].items() if a not in p["active"]}
        assert idle and all(b == 0 for b in idle.values()), p
        assert p["colocated_bytes"] == p["need_bytes"], p

    # Audits ran after every onload (5 phases x 3 iterations, one actor each) and were clean.
    assert log["audits"] == {"runs": 15, "checks_clean": 15}
    # The rollout model equalled the policy after every sync (SHA-256 of every tensor).
    assert [(c["iteration"], c["manager_on"]) for c in log["sync_checks"]] == [
        (1, True),
        (2, True),
        (3, True),
        (1, False),
    ]
    assert all(c["equal"] and c["policy"] == c["rollout"] for c in log["sync_checks"])
    assert len({c["policy"][0] for c in log["sync_checks"]}) == 4  # the policy really changed

    written = json.loads((tmp_path / "log.json").read_text())
    assert written["summary"] == log["summary"]
    assert (tmp_path / "memory_timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_a_dead_actor_stops_the_run_naming_actor_and_phase(local_ray, tmp_path):
    cfg = load_config(
        CONFIG, ["ppo.iterations=3", "memory.compare_iterations=0", f"output_dir={tmp_path}", "ray.phase_timeout_s=120"]
    )

    def kill_critic(run, iteration):
        if iteration == 0:
            critic = run.actors("critic")[0]
            ray.kill(critic, no_restart=True)

    with pytest.raises(ActorFailedError) as e:
        run_ppo(cfg, progress=lambda line: None, on_iteration=kill_critic)
    assert e.value.actor == "critic_0"
    assert e.value.phase == "generate"  # the first phase of iteration 1 asks every actor for residency
    assert "critic_0" in str(e.value) and "died" in str(e.value)
    log = json.loads((tmp_path / "log.json").read_text())  # what the run did before is kept
    assert log["status"] == "failed" and "critic_0" in log["error"]
    assert [m["iteration"] for m in log["iterations"]] == [1]


def test_a_nan_loss_stops_the_run_naming_iteration_and_phase(local_ray, tmp_path):
    cfg = load_config(CONFIG, ["ppo.iterations=3", "memory.compare_iterations=0", f"output_dir={tmp_path}"])

    class Poisoned(PPO):
        def step(self, svc, index):
            if index == 1:  # a NaN clip range: the critic's loss (and grads) of iteration 2 are NaN
                nan_clip = functools.partial(value_loss, prompt_length=cfg.ppo.prompt_length, value_clip=math.nan)
                self._value_loss = nan_clip
            return super().step(svc, index)

    with pytest.raises(NonFiniteLossError) as e:
        run_loop(Poisoned, cfg, progress=lambda line: None)
    assert (e.value.iteration, e.value.phase) == (2, "train_critic")
    assert str(e.value).startswith("iteration 2, phase 'train_critic': non-finite ")
    assert "loss=nan" in str(e.value)
    log = json.loads((tmp_path / "log.json").read_text())
    assert log["status"] == "failed" and [m["iteration"] for m in log["iterations"]] == [1]


@pytest.mark.slow
def test_reward_rises_over_the_default_run(local_ray, tmp_path):
    cfg = load_config(CONFIG, ["memory.compare_iterations=0", f"output_dir={tmp_path}"])
    log = run_ppo(cfg, progress=lambda line: None)
    rewards = [m["reward"] for m in log["iterations"]]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.2, rewards


@pytest.mark.slow
def test_tensor_parallel_policy_syncs_merged_shards(local_ray, tmp_path):
    cfg = load_config(
        CONFIG,
        [
            "parallel.world_size=2",
            "parallel.tensor_model_parallel_size=2",
            "ppo.iterations=2",
            "memory.compare_iterations=0",
            "ray.cpus_per_rank=1",
            f"output_dir={tmp_path}",
        ],
    )
    log = run_ppo(cfg, progress=lambda line: None)
    assert len(log["iterations"]) == 2
    assert all(c["equal"] and len(c["rollout"]) == 2 for c in log["sync_checks"])
    assert log["summary"]["memory_manager_on"]["ratio"] <= 1.1
