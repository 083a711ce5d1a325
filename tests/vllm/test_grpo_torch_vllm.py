"""GRPO with a torch-native policy (``policy.backend: torch``) generating with the real vLLM engine,
through a local Ray cluster (the ``cpu_grpo_torch_vllm`` preset): the engine takes the policy's
weights from its host store in Hugging Face naming, every sync verified bit for bit before the
engine samples; it learns; no actor imports megatron; a killed policy actor is restarted and the
run ends bit-identical to the undisturbed one, the engine's digests included."""

import os
import signal
import sys

import pytest

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")
pytest.importorskip("vllm", reason="vLLM is not installed: see docs/vllm.md")

from golden_outcome import outcome  # noqa: E402

from chatlearn_mem_ray import load_grpo_config, run_grpo  # noqa: E402

PRESET = "cpu_grpo_torch_vllm"
SHORT = ["grpo.iterations=4", "memory.compare_iterations=0", "ray.phase_timeout_s=180"]


def _megatron_modules(actor) -> list[str]:
    return ray.get(
        actor.__ray_call__.remote(lambda self: sorted(m for m in sys.modules if m.split(".")[0] == "megatron"))
    )


def test_a_torch_native_policy_learns_with_vllm_every_sync_verified_and_no_megatron(local_ray, tmp_path):
    imported = {}

    def look_inside(svc, iteration, phase):
        if iteration == 20 and phase == "train":  # every actor has built, trained, synced, offloaded
            for model in ("policy", "rollout", "reference"):
                imported[model] = _megatron_modules(svc.actors(model)[0])

    log = run_grpo(
        load_grpo_config(PRESET, [f"output_dir={tmp_path}"]), progress=lambda line: None, on_phase=look_inside
    )
    assert imported == {"policy": [], "rollout": [], "reference": []}
    its = [m for m in log["iterations"] if m["manager_on"]]
    mean = lambda ms: sum(m["reward"] for m in ms) / len(ms)  # noqa: E731
    assert mean(its[-5:]) > mean(its[:5]) + 0.2, [round(m["reward"], 3) for m in its]
    syncs = [c for c in log["sync_checks"] if c["manager_on"]]
    assert [c["iteration"] for c in syncs] == list(range(1, 21))
    assert all(c["verified"] and len(c["digest"]) == 64 for c in syncs)
    assert len({c["digest"] for c in syncs}) == 20  # a new policy each time, and the engine holds it
    assert all(m["logprob_mismatch"]["max"] < 1e-4 for m in its)  # fp32: the engine computes as the policy
    # every model outside its phase sleeps but the engine, which cannot on vLLM's CPU build
    for p in (p for p in log["memory_timeline"] if p["manager_on"]):
        awake_idle = {a for a, b in p["device_bytes"].items() if b and a not in p["active"]}
        assert awake_idle <= {"rollout"}, (p["phase"], awake_idle)


@pytest.fixture(scope="module")
def undisturbed(local_ray, tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo_torch_vllm")
    return run_grpo(load_grpo_config(PRESET, [*SHORT, f"output_dir={out}"]), progress=lambda line: None)


def test_a_killed_torch_native_policy_is_restarted_and_the_run_ends_bit_identical(undisturbed, tmp_path):
    cfg = load_grpo_config(
        PRESET, [*SHORT, f"output_dir={tmp_path}", "checkpoint.every=1", "checkpoint.max_restarts=1"]
    )
    killed = []

    def kill_policy(svc, iteration, phase):
        if (iteration, phase) == (2, "reference") and not killed:
            pid = ray.get(svc.actors("policy")[0].pid.remote())
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    log = run_grpo(cfg, progress=lambda line: None, on_phase=kill_policy)
    assert killed and log["status"] == "completed", log.get("error")
    [restart] = log["restarts"]
    assert (restart["actor"], restart["phase"], restart["iteration"]) == ("policy_0", "reference", 3)
    assert outcome(log) == outcome(undisturbed)  # the engine's digests of what it loaded among them
