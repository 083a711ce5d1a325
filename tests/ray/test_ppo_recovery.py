"""Checkpoints, resume and automatic recovery of a colocated PPO run, end to end through a local Ray
cluster (CPU, gloo, megatron-core): a run that loses an actor process, or is stopped and resumed,
ends bit-identical to the same run left alone."""

import json
import os
import signal

import pytest

from chatlearn_mem_ray import ActorFailedError, CheckpointSaveError, RunInterrupted, load_config, run_ppo
from chatlearn_mem_ray.job.checkpoints import RUN_FILE, latest_run_checkpoint, list_run_checkpoints

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")
ITERATIONS = 4
BASE = ["ppo.iterations=4", "ppo.prompts_per_iteration=16", "memory.compare_iterations=0", "ray.phase_timeout_s=180"]
# measured, not computed: they differ between two runs of the same training (process RSS included)
TIMING = ("seconds", "phase_seconds", "checkpoint_seconds", "transition_seconds", "rss_bytes")


@pytest.fixture(scope="module")
def uninterrupted(local_ray, tmp_path_factory):
    """The reference: the same run, no checkpoints, nothing disturbed."""
    out = tmp_path_factory.mktemp("uninterrupted")
    return run_ppo(load_config("cpu_tiny", [*BASE, f"output_dir={out}"]), progress=lambda line: None)


def outcome(log: dict) -> dict:
    """What must not depend on how the run got there: every iteration's metrics (timings left
    out), the policy digests of every weight sync, the final weights of every trainer rank, and
    the memory each phase held."""
    return {
        "iterations": [{k: v for k, v in m.items() if k not in TIMING} for m in log["iterations"]],
        "syncs": [(c["iteration"], c["policy"], c["rollout"]) for c in log["sync_checks"]],
        "final_weights": log["final_weights"],
        "phase_bytes": [(p["iteration"], p["phase"], p["device_bytes"]) for p in log["memory_timeline"]],
    }


def test_the_reference_run_is_deterministic_and_trains(uninterrupted):
    assert [m["iteration"] for m in uninterrupted["iterations"]] == list(range(1, ITERATIONS + 1))
    assert sorted(uninterrupted["final_weights"]) == ["critic_0", "policy_0"]
    assert uninterrupted["checkpoints"] == [] and uninterrupted["restarts"] == []
    assert len({c["policy"][0] for c in uninterrupted["sync_checks"]}) == ITERATIONS  # the policy changed


def test_an_actor_killed_mid_iteration_is_restarted_and_the_run_ends_bit_identical(uninterrupted, tmp_path):
    cfg = load_config("cpu_tiny", [*BASE, f"output_dir={tmp_path}", "checkpoint.every=1", "checkpoint.max_restarts=1"])
    killed, lines = [], []

    def kill_policy(run, iteration, phase):
        # Iteration 3: the checkpoint after iteration 2 is still being written in the background,
        # so the newest complete one is after iteration 1: iteration 2 is redone (iterations_redone
        # counts it) and iteration 3 starts again.
        if (iteration, phase) == (2, "reference") and not killed:
            pid = ray.get(run.actors("policy")[0].pid.remote())
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    log = run_ppo(cfg, progress=lines.append, on_phase=kill_policy)

    assert killed and log["status"] == "completed"
    [restart] = log["restarts"]
    assert (restart["actor"], restart["phase"], restart["iteration"]) == ("policy_0", "reference", 3)
    assert restart["resumed_from"].endswith("iter_00000001") and restart["iterations_redone"] == 1
    assert any(
        line.startswith("restart 1 of 1: actor 'policy_0' failed during phase 'reference'")
        and "continuing from the checkpoint after iteration 1" in line
        for line in lines
    ), lines
    assert outcome(log) == outcome(uninterrupted)
    assert [c["iterations_done"] for c in log["checkpoints"]] == [1, 2, 3, 4]  # the first 2 never completed
    # keep_last=2: the two newest, complete; the killed save's leftovers were replaced
    assert [n for n, _ in list_run_checkpoints(tmp_path / "checkpoints")] == [3, 4]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["iter_00000003", "iter_00000004"]


def test_a_run_stopped_by_ctrl_c_resumes_to_the_same_end(uninterrupted, tmp_path):
    args = [*BASE, f"output_dir={tmp_path}", "checkpoint.every=2", "checkpoint.async_save=false"]

    def ctrl_c(run, iteration):
        if iteration == 2:
            raise KeyboardInterrupt

    with pytest.raises(RunInterrupted) as e:
        run_ppo(load_config("cpu_tiny", args), progress=lambda line: None, on_iteration=ctrl_c)
    assert e.value.iterations == 3
    assert json.loads((tmp_path / "log.json").read_text())["status"] == "interrupted"
    assert latest_run_checkpoint(tmp_path / "checkpoints").name == "iter_00000002"

    lines = []
    log = run_ppo(load_config("cpu_tiny", [*args, "checkpoint.resume=true"]), progress=lines.append)
    assert log["resumed_from"]["iterations_done"] == 2
    assert [c["iterations_done"] for c in log["checkpoints"]] == [2, 4]  # the first run's, then its own
    assert f"resumed from {tmp_path / 'checkpoints' / 'iter_00000002'}: 2 iteration(s) done" in lines
    assert sum(line.startswith("iter ") for line in lines) == 2  # only iterations 3 and 4 ran again
    assert outcome(log) == outcome(uninterrupted)
    assert json.loads((tmp_path / "log.json").read_text())["iterations"] == log["iterations"]


def test_a_damaged_newest_checkpoint_is_named_and_the_run_resumes_from_the_older_one(uninterrupted, tmp_path):
    """A tensor file of the newest checkpoint truncated: one line naming it, the run resumes from the
    checkpoint before it (the actors never read the damaged file) and ends bit-identical."""
    args = [*BASE, f"output_dir={tmp_path}", "checkpoint.every=1", "checkpoint.async_save=false"]

    def ctrl_c(run, iteration):
        if iteration == 2:
            raise KeyboardInterrupt

    with pytest.raises(RunInterrupted):
        run_ppo(load_config("cpu_tiny", args), progress=lambda line: None, on_iteration=ctrl_c)
    newest = latest_run_checkpoint(tmp_path / "checkpoints")
    assert newest.name == "iter_00000003"
    step = newest / "policy" / "step_00000003"
    data = max((f for f in os.listdir(step) if f.endswith(".distcp")), key=lambda f: os.path.getsize(step / f))
    size = os.path.getsize(step / data)
    os.truncate(step / data, size - 1)

    lines = []
    log = run_ppo(load_config("cpu_tiny", [*args, "checkpoint.resume=true"]), progress=lines.append)
    assert (
        f"checkpoint iter_00000003 is damaged, skipped: policy/step_00000003/{data} has {size - 1} bytes, "
        f"the manifest says {size}"
    ) in lines
    assert log["resumed_from"]["iterations_done"] == 2
    assert outcome(log) == outcome(uninterrupted)


def test_a_failed_save_stops_the_run_cleanly_with_the_previous_checkpoint_intact(local_ray, tmp_path):
    cfg = load_config(
        "cpu_tiny",
        [
            "ppo.iterations=3",
            "memory.compare_iterations=0",
            f"output_dir={tmp_path}",
            "checkpoint.every=1",
            "checkpoint.max_restarts=2",
        ],
    )

    def block_policy(tmp):
        if tmp.name.endswith("iter_00000002"):
            (tmp / "policy").write_text("not a directory")  # the policy ranks cannot create their directory

    with pytest.raises(CheckpointSaveError) as e:
        run_ppo(cfg, progress=lambda line: None, on_checkpoint=block_policy)
    assert "after iteration 2" in str(e.value) and "iter_00000001, is intact" in str(e.value)
    assert "cannot write checkpoints to" in str(e.value)
    assert isinstance(e.value.__cause__, ActorFailedError) and not e.value.__cause__.died  # not retried
    log = json.loads((tmp_path / "log.json").read_text())
    assert log["status"] == "failed" and log["restarts"] == [] and len(log["iterations"]) == 2
    newest = latest_run_checkpoint(tmp_path / "checkpoints")
    assert newest.name == "iter_00000001"
    state = json.loads((newest / RUN_FILE).read_text())
    assert state["iterations_done"] == 1 and len(state["iterations"]) == 1
    for role in ("policy", "critic"):
        assert os.path.isfile(newest / role / "step_00000001" / "chatlearn_checkpoint.json")
