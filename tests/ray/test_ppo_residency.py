"""A colocated PPO run under a device budget (memory.device_budget_mb) through a real local Ray
cluster: the residency plan keeps what fits, moves exactly the bytes it planned, never exceeds the
budget, and the run is bit-identical to the all-or-nothing one."""

import pytest

from chatlearn_mem_ray import load_config, run_ppo

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")

ITERATIONS = ["ppo.iterations=3", "memory.compare_iterations=0"]
TIMING = {
    "seconds",
    "phase_seconds",
    "checkpoint_seconds",
    "transition_seconds",
    "phase_colocated_bytes",
    "moved_in_bytes",
    "moved_out_bytes",
    "peak_device_bytes",
    "budget_bytes",
    "rss_bytes",  # each actor's process RSS: measured, differs between runs
}


@pytest.fixture(scope="module")
def all_or_nothing(local_ray, tmp_path_factory):
    out = tmp_path_factory.mktemp("aon")
    return run_ppo(load_config("cpu_tiny", ITERATIONS + [f"output_dir={out}"]), progress=lambda line: None)


def _same_training(a: dict, b: dict) -> None:
    assert [{k: v for k, v in m.items() if k not in TIMING} for m in a["iterations"]] == [
        {k: v for k, v in m.items() if k not in TIMING} for m in b["iterations"]
    ]
    assert [c["policy"] for c in a["sync_checks"]] == [c["policy"] for c in b["sync_checks"]]
    assert a["final_weights"] == b["final_weights"]


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "blocking"])
def test_a_budget_moves_the_planned_bytes_within_budget_and_trains_the_same(all_or_nothing, tmp_path, prefetch):
    lines = []
    log = run_ppo(
        load_config(
            "cpu_tiny",
            ITERATIONS
            + [f"output_dir={tmp_path}", "memory.device_budget_mb=3", f"memory.prefetch={str(prefetch).lower()}"],
        ),
        progress=lines.append,
    )
    _same_training(log, all_or_nothing)
    plan = log["residency_plan"]["0"]
    budget = 3 * 2**20
    assert plan["budget_bytes"] == budget and plan["optimal"]
    assert plan["bytes_moved"] < plan["all_or_nothing_bytes"]
    assert any(line.startswith("device budget 3.0 MiB: the plan copies") for line in lines)
    phases = log["memory_timeline"]
    assert len(phases) == 3 * 5
    assert all(p["bundle_bytes"]["0"] <= budget for p in phases), [p["bundle_bytes"] for p in phases]
    assert log["over_budget"] == []
    assert any(p["kept"] for p in phases)  # something really stayed beyond its phase
    for m in log["iterations"][1:]:  # steady state: exactly what the plan said
        assert m["moved_in_bytes"] + m["moved_out_bytes"] == plan["bytes_moved"]
        assert m["peak_device_bytes"]["0"] <= budget and m["budget_bytes"] == {"0": budget}
    # without a budget each phase onloads its models and offloads them after, even between two
    # phases that use the same weights (values, train_critic): at least the planner's all-or-nothing
    aon = all_or_nothing["iterations"][1]
    assert aon["moved_in_bytes"] + aon["moved_out_bytes"] >= plan["all_or_nothing_bytes"]
    assert log["audits"]["runs"] == log["audits"]["checks_clean"] > 0
