"""GRPO with a torch-native policy (``policy.backend: torch``, the ``cpu_grpo_torch`` preset) on the
colocation service through a local Ray cluster: a Hugging Face Llama trained with torch's AdamW
under the torch-native memory manager, its rollout and reference copies of it. It learns, its
memory peak is its largest phase, no actor imports megatron, every sync is verified, and a killed
policy actor is restarted and the run ends bit-identical."""

import json
import os
import signal
import sys

import pytest
from golden_outcome import outcome

from chatlearn_mem_ray import load_grpo_config, run_grpo

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")
SHORT = ["grpo.iterations=4", "memory.compare_iterations=0", "ray.phase_timeout_s=180"]


def _megatron_modules(actor) -> list[str]:
    return ray.get(
        actor.__ray_call__.remote(lambda self: sorted(m for m in sys.modules if m.split(".")[0] == "megatron"))
    )


def test_a_torch_native_policy_learns_at_its_largest_phase_and_never_imports_megatron(local_ray, tmp_path):
    lines, imported = [], {}

    def look_inside(svc, iteration, phase):
        if iteration == 20 and phase == "train":  # every actor has built, trained, synced, offloaded
            for model in ("policy", "rollout", "reference"):
                imported[model] = _megatron_modules(svc.actors(model)[0])

    cfg = load_grpo_config("cpu_grpo_torch", [f"output_dir={tmp_path}"])
    log = run_grpo(cfg, progress=lines.append, on_phase=look_inside)
    assert imported == {"policy": [], "rollout": [], "reference": []}
    its = [m for m in log["iterations"] if m["manager_on"]]
    assert len(its) == 20 and log["status"] == "completed"
    mean = lambda ms, k="reward": sum(m[k] for m in ms) / len(ms)  # noqa: E731
    assert mean(its[-5:]) > mean(its[:5]) + 0.3, [round(m["reward"], 3) for m in its]  # it learns
    assert mean(its[-5:], "entropy") < mean(its[:5], "entropy")
    on, off = log["summary"]["memory_manager_on"], log["summary"]["memory_manager_off"]
    assert on["ratio"] == 1.0 and on["largest_phase"] == "train", on
    assert off["ratio"] > 1.0
    train = next(p for p in log["memory_timeline"] if p["phase"] == "train" and p["manager_on"])
    assert set(train["active"]["policy_0"]) >= {"weights", "grads", "optimizer_states"}
    assert train["device_by_part"]["policy_0"]["main_weights"] == 0  # torch's optimizers keep none
    assert log["audits"]["runs"] == log["audits"]["checks_clean"] == 20 * 3
    syncs = [c for c in log["sync_checks"] if c["manager_on"]]
    assert len(syncs) == 20 and all(c["policy"] == c["rollout"] for c in log["sync_checks"])
    assert len({c["policy"][0] for c in syncs}) == 20  # the policy changed every iteration


@pytest.fixture(scope="module")
def undisturbed(local_ray, tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo_torch_undisturbed")
    return run_grpo(load_grpo_config("cpu_grpo_torch", [*SHORT, f"output_dir={out}"]), progress=lambda line: None)


def test_a_killed_torch_native_policy_is_restarted_and_the_run_ends_bit_identical(undisturbed, tmp_path):
    cfg = load_grpo_config(
        "cpu_grpo_torch", [*SHORT, f"output_dir={tmp_path}", "checkpoint.every=1", "checkpoint.max_restarts=1"]
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
    # the policy's checkpoints are torch.distributed.checkpoint's, written from the host store
    metas = [json.loads(p.read_text()) for p in tmp_path.rglob("chatlearn_checkpoint.json")]
    assert metas and all(m["backend"] == "torch" and m["parallel"] == {"dp": 1} for m in metas), metas


@pytest.mark.slow  # as the megatron policy's tensor-parallel run: two data-parallel ranks in torch's DDP
def test_a_torch_native_policy_trains_on_two_data_parallel_ranks(local_ray, tmp_path):
    dp2 = ["parallel.world_size=2", "grpo.iterations=2", "memory.compare_iterations=0"]
    log = run_grpo(load_grpo_config("cpu_grpo_torch", [*dp2, f"output_dir={tmp_path}"]), progress=lambda line: None)
    assert log["status"] == "completed" and log["summary"]["memory_manager_on"]["ratio"] == 1.0
    train = next(p for p in log["memory_timeline"] if p["phase"] == "train")
    assert all(train["device_by_part"][f"policy_{r}"]["grads"] > 0 for r in (0, 1))  # DDP's buckets, a part
    assert log["audits"]["runs"] == log["audits"]["checks_clean"]
    assert sorted(log["final_weights"]) == ["policy_0", "policy_1"]
    assert log["final_weights"]["policy_0"] == log["final_weights"]["policy_1"]  # data parallel: one model
