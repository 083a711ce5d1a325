"""The residency plan of a colocated PPO run (chatlearn_mem_ray.schedule), without Ray: the items,
needs and writes of the five phases, the optimum at the issue's budgets, one plan per device,
prefetch room, re-planning, and the budget checks."""

import pytest
from planner_oracle import optimum_bytes

from chatlearn_mem import Part
from chatlearn_mem_ray.config import load_config
from chatlearn_mem_ray.errors import BudgetError
from chatlearn_mem_ray.schedule import PHASES, ResidencySchedule, bundle_of, estimate_sizes, phase_needs, phase_writes
from chatlearn_mem_ray.supervisor import check_budget

NAMES = ["policy_0", "critic_0", "rollout", "reference"]
MiB = 2**20


def sizes_of(cfg_overrides=()):
    return estimate_sizes(load_config("cpu_tiny", list(cfg_overrides)))


def largest(sizes) -> int:
    return max(sum(sizes[a][p] for a, parts in need.items() for p in parts) for need in phase_needs(sizes))


def test_needs_and_writes_of_the_five_phases():
    needs, writes = phase_needs(NAMES), phase_writes(NAMES)
    assert len(needs) == len(writes) == len(PHASES) == 5
    assert needs[0] == {"rollout": (Part.WEIGHTS,)} and writes[0] == {"rollout": (Part.WEIGHTS,)}
    assert needs[1] == {"reference": (Part.WEIGHTS,)} and writes[1] == {}
    assert needs[2] == {"critic_0": (Part.WEIGHTS,)} and writes[2] == {}
    assert needs[3] == {"critic_0": tuple(Part)}
    assert needs[4] == {"policy_0": tuple(Part)}
    assert Part.GRADS not in writes[4]["policy_0"]  # grads are scratch: dropped, never copied
    assert [bundle_of(n) for n in ["policy_3", "critic_3", "rollout", "reference"]] == [3, 3, 0, 0]


@pytest.mark.parametrize("factor", [1.0, 1.25, 1.5, 2.0])
def test_the_plan_moves_exactly_the_optimum_at_the_issues_budgets(factor):
    sizes = sizes_of()
    budget = int(largest(sizes) * factor)
    schedule = ResidencySchedule(sizes, budget)
    plan = schedule.plans[0]
    items = {f"{a}/{p.value}": b for a, parts in sizes.items() for p, b in parts.items()}
    phases = [[f"{a}/{p.value}" for a, ps in need.items() for p in ps] for need in phase_needs(sizes)]
    written = [[f"{a}/{p.value}" for a, ps in w.items() for p in ps] for w in phase_writes(sizes)]
    scratch = [k for k in items if k.endswith("/grads")]
    assert plan.bytes_moved == optimum_bytes(items, phases, budget, written, scratch)
    assert plan.bytes_moved <= plan.all_or_nothing_bytes
    for i in range(len(PHASES)):
        assert sum(items[k] for k in plan.resident[i]) <= budget
    if factor == 1.0:
        assert plan.bytes_moved == plan.all_or_nothing_bytes


def test_bytes_moved_fall_from_all_or_nothing_to_nothing_as_the_budget_grows():
    sizes = sizes_of()
    total = sum(b for parts in sizes.values() for b in parts.values())
    moved = [
        ResidencySchedule(sizes, int(largest(sizes) * f)).plans[0].bytes_moved for f in (1.0, 1.25, 1.5, 1.75, 2.0)
    ] + [ResidencySchedule(sizes, total).plans[0].bytes_moved]
    assert moved == sorted(moved, reverse=True) and moved[0] > moved[-1] == 0


def test_one_plan_per_device():
    sizes = sizes_of(["parallel.world_size=2", "ppo.prompts_per_iteration=16"])
    schedule = ResidencySchedule(sizes, int(largest({n: s for n, s in sizes.items() if bundle_of(n) == 0}) * 1.5))
    assert sorted(schedule.plans) == [0, 1]
    assert not any(k.startswith(("rollout", "reference")) for r in schedule.plans[1].resident for k in r)
    assert {a for a, _ in schedule.target(4)} >= {"policy_0", "policy_1"}


def test_boundaries_prefetch_room_and_kept_parts():
    sizes = sizes_of()
    s = ResidencySchedule(sizes, int(largest(sizes) * 1.5))
    moves = s.boundary(0)
    assert not moves.out and {(a, p) for a, ps in moves.into.items() for p in ps} == s.target(0)
    s.moved(moves)
    assert s.resident == s.target(0)
    assert s.fits(s.target(0)) and not s.fits({(a, p) for a in sizes for p in sizes[a]})
    for phase in range(len(PHASES)):
        s.clear()
        s.moved(s.boundary(phase))
        kept = {(a, p) for a, ps in s.kept(phase).items() for p in ps}
        needed = {(a, p.value) for a, ps in phase_needs(sizes)[phase].items() for p in ps}
        assert not kept & needed
        assert kept | needed == {(a, p.value) for a, p in s.target(phase)}
    s.clear()
    assert s.resident == set()


def test_a_model_that_grows_is_planned_again_and_never_silently_over_budget():
    sizes = sizes_of()
    s = ResidencySchedule(sizes, int(largest(sizes) * 1.5))
    assert not s.update_sizes(sizes)  # nothing changed: no new plan
    grown = {a: dict(parts) for a, parts in sizes.items()}
    grown["critic_0"][Part.OPTIMIZER_STATES] += 64 * 1024
    assert s.update_sizes(grown) and s.replans == 1
    for i, resident in enumerate(s.plans[0].resident):
        assert sum(s.sizes[(k.rpartition("/")[0], Part(k.rpartition("/")[2]))] for k in resident) <= s.budget[0]
    grown["policy_0"][Part.OPTIMIZER_STATES] *= 4  # now train_policy alone is over the budget
    with pytest.raises(ValueError, match="train_policy needs .* but the budget is"):
        s.update_sizes(grown)


def test_a_budget_below_the_largest_phase_names_the_phase_its_bytes_and_the_budget():
    sizes = sizes_of()
    need = largest(sizes)
    with pytest.raises(ValueError) as err:
        ResidencySchedule(sizes, need - 1)
    msg = str(err.value)
    assert "train_policy needs 1.88 MiB but the budget is 1.88 MiB" in msg
    assert f"at least {-(-need // MiB)}" in msg and "\n" not in msg


def test_check_before_ray_starts():
    with pytest.raises(BudgetError, match=r"train_policy needs 1\.88 MiB but the budget is 1\.00 MiB.*before starting"):
        check_budget(load_config("cpu_tiny", ["memory.device_budget_mb=1"]))
    check_budget(load_config("cpu_tiny", ["memory.device_budget_mb=3"]))  # fits
    check_budget(load_config("cpu_tiny", ["memory.device_budget_mb=auto"]))  # known once the GPUs are up
    check_budget(load_config("cpu_tiny"))  # no budget: all or nothing


def test_the_config_names_bad_budgets():
    from chatlearn_mem import ConfigError

    for overrides, message in (
        (["memory.device_budget_mb=-2"], "must be > 0 MiB, got -2"),
        (["memory.device_budget_mb=lots"], "must be a number of MiB, 'auto' or null"),
        (["memory.device_budget_mb=3", "memory.enabled=false"], "needs memory.enabled=true"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config("cpu_tiny", overrides)


def test_gradients_stay_when_they_fit_beside_every_phase():
    """Dropping gradients copies nothing, but rebuilding them zeroes them: with room, keep them."""
    sizes = sizes_of()
    total = sum(b for parts in sizes.values() for b in parts.values())
    s = ResidencySchedule(sizes, total)
    assert all({("policy_0", Part.GRADS), ("critic_0", Part.GRADS)} <= s.target(i) for i in range(len(PHASES)))
    assert s.summary()["0"]["gradients_kept"] == ["critic_0/grads", "policy_0/grads"]
    tight = ResidencySchedule(sizes, largest(sizes))  # no room: dropped as the plan says
    assert ("policy_0", Part.GRADS) not in tight.target(0) and not tight.summary()["0"]["gradients_kept"]
    for budget in (largest(sizes), int(largest(sizes) * 1.5), total):
        s = ResidencySchedule(sizes, budget)
        assert all(sum(s.sizes[i] for i in s.target(p)) <= budget for p in range(len(PHASES)))


def test_an_engine_that_cannot_sleep_is_planned_resident_in_every_phase():
    """vLLM's CPU build cannot sleep: its weights and KV cache stay, so the plan counts them in
    every phase and schedules the trainers in what is left; a budget below a phase plus the engine
    is refused, naming it."""
    from chatlearn_mem_ray.schedule import pinned_items

    cfg = load_config("cpu_vllm")
    assert pinned_items(cfg) == {("rollout", Part.WEIGHTS)}
    assert pinned_items(load_config("cpu_vllm", ["ray.use_gpu=true"])) == set()  # on CUDA it sleeps
    assert pinned_items(load_config("cpu_tiny")) == set()
    sizes = estimate_sizes(cfg)
    engine = sizes["rollout"][Part.WEIGHTS]
    assert engine > 2**30  # its KV cache (rollout.kv_cache_gib) included
    trainer = max(sum(sizes[a].values()) for a in ("policy_0", "critic_0"))
    s = ResidencySchedule(sizes, engine + trainer, pinned=pinned_items(cfg))
    assert all("rollout/weights" in r for r in s.plans[0].resident)
    assert all(("rollout", Part.WEIGHTS) in s.target(i) for i in range(len(PHASES)))
    assert s.kept(3) == {}  # needed everywhere, so never "kept beyond need"
    with pytest.raises(ValueError, match="train_.* needs .* but the budget is"):
        ResidencySchedule(sizes, trainer + engine // 2, pinned=pinned_items(cfg))
    with pytest.raises(BudgetError, match="before starting"):
        check_budget(load_config("cpu_vllm", [f"memory.device_budget_mb={(trainer + engine // 2) // 2**20}"]))
