"""The residency plan of a loop's declared phases (chatlearn_mem_ray.service.schedule), without Ray, on
PPO's declarations: the items, needs and writes of its five phases, the optimum at the issue's
budgets, one plan per device, prefetch room, re-planning, and the budget checks; GRPO's phases
without a reference."""

import pytest
from planner_oracle import optimum_bytes

from chatlearn_mem import Part
from chatlearn_mem_ray import GRPORunConfig, load_config
from chatlearn_mem_ray.errors import BudgetConfigError, BudgetError
from chatlearn_mem_ray.loops.grpo.loop import GRPO
from chatlearn_mem_ray.loops.ppo import PPO
from chatlearn_mem_ray.service.budget import check_budget, estimate_sizes, pinned_items
from chatlearn_mem_ray.service.declare import phase_demands
from chatlearn_mem_ray.service.schedule import ResidencySchedule

MiB = 2**20
PHASES = ["generate", "reference", "values", "train_critic", "train_policy"]


def declared(overrides=(), preset="cpu_tiny"):
    """A PPO run's config, models and phases, as the supervisor gets them."""
    cfg = load_config(preset, list(overrides))
    loop = PPO(cfg)
    return cfg, loop.models(), loop.phases()


def demands(overrides=(), preset="cpu_tiny"):
    cfg, models, phases = declared(overrides, preset)
    return phase_demands(models, phases, cfg.parallel.world_size)


def bundles(overrides=(), preset="cpu_tiny") -> dict[str, int]:
    cfg, models, _ = declared(overrides, preset)
    ws = cfg.parallel.world_size
    return {a: b for m in models for a, b in zip(m.actor_names(ws), m.bundles(ws))}


def sizes_of(overrides=(), preset="cpu_tiny"):
    cfg, models, _ = declared(overrides, preset)
    return estimate_sizes(cfg, models)


def plan(sizes, budget, overrides=(), preset="cpu_tiny", pinned=()) -> ResidencySchedule:
    return ResidencySchedule(sizes, budget, demands(overrides, preset), bundles(overrides, preset), pinned=pinned)


def phase_needs(overrides=()):
    return [d.needs for d in demands(overrides)]


def largest(sizes) -> int:
    return max(sum(sizes[a][p] for a, parts in need.items() if a in sizes for p in parts) for need in phase_needs())


def test_needs_and_writes_of_the_five_phases():
    ds = demands()
    needs, writes = [d.needs for d in ds], [d.writes for d in ds]
    assert [d.name for d in ds] == PHASES
    assert needs[0] == {"rollout": (Part.WEIGHTS,)} and writes[0] == {"rollout": (Part.WEIGHTS,)}
    assert needs[1] == {"reference": (Part.WEIGHTS,)} and writes[1] == {}
    assert needs[2] == {"critic_0": (Part.WEIGHTS,)} and writes[2] == {}
    assert needs[3] == {"critic_0": tuple(Part)}
    assert needs[4] == {"policy_0": tuple(Part)}
    assert Part.GRADS not in writes[4]["policy_0"]  # grads are scratch: dropped, never copied
    four = bundles(["parallel.world_size=4", "ppo.prompts_per_iteration=32"])
    assert [four[n] for n in ["policy_3", "critic_3", "rollout", "reference"]] == [3, 3, 0, 0]


@pytest.mark.parametrize("factor", [1.0, 1.25, 1.5, 2.0])
def test_the_plan_moves_exactly_the_optimum_at_the_issues_budgets(factor):
    sizes = sizes_of()
    budget = int(largest(sizes) * factor)
    schedule = plan(sizes, budget)
    plan_ = schedule.plans[0]
    items = {f"{a}/{p.value}": b for a, parts in sizes.items() for p, b in parts.items()}
    phases = [[f"{a}/{p.value}" for a, ps in d.needs.items() for p in ps] for d in demands()]
    written = [[f"{a}/{p.value}" for a, ps in d.writes.items() for p in ps] for d in demands()]
    scratch = [k for k in items if k.endswith("/grads")]
    assert plan_.bytes_moved == optimum_bytes(items, phases, budget, written, scratch)
    assert plan_.bytes_moved <= plan_.all_or_nothing_bytes
    for i in range(len(PHASES)):
        assert sum(items[k] for k in plan_.resident[i]) <= budget
    if factor == 1.0:
        assert plan_.bytes_moved == plan_.all_or_nothing_bytes


def test_bytes_moved_fall_from_all_or_nothing_to_nothing_as_the_budget_grows():
    sizes = sizes_of()
    total = sum(b for parts in sizes.values() for b in parts.values())
    moved = [plan(sizes, int(largest(sizes) * f)).plans[0].bytes_moved for f in (1.0, 1.25, 1.5, 1.75, 2.0)] + [
        plan(sizes, total).plans[0].bytes_moved
    ]
    assert moved == sorted(moved, reverse=True) and moved[0] > moved[-1] == 0


def test_one_plan_per_device():
    two = ["parallel.world_size=2", "ppo.prompts_per_iteration=16"]
    sizes = sizes_of(two)
    on = bundles(two)
    schedule = plan(sizes, int(largest({n: s for n, s in sizes.items() if on[n] == 0}) * 1.5), two)
    assert sorted(schedule.plans) == [0, 1]
    assert not any(k.startswith(("rollout", "reference")) for r in schedule.plans[1].resident for k in r)
    assert {a for a, _ in schedule.target(4)} >= {"policy_0", "policy_1"}


def test_boundaries_prefetch_room_and_kept_parts():
    sizes = sizes_of()
    s = plan(sizes, int(largest(sizes) * 1.5))
    moves = s.boundary(0)
    assert not moves.out and {(a, p) for a, ps in moves.into.items() for p in ps} == s.target(0)
    s.moved(moves)
    assert s.resident == s.target(0)
    assert s.fits(s.target(0)) and not s.fits({(a, p) for a in sizes for p in sizes[a]})
    for phase in range(len(PHASES)):
        s.clear()
        s.moved(s.boundary(phase))
        kept = {(a, p) for a, ps in s.kept(phase).items() for p in ps}
        needed = {(a, p.value) for a, ps in phase_needs()[phase].items() for p in ps}
        assert not kept & needed
        assert kept | needed == {(a, p.value) for a, p in s.target(phase)}
    s.clear()
    assert s.resident == set()


def test_a_model_that_grows_is_planned_again_and_never_silently_over_budget():
    sizes = sizes_of()
    s = plan(sizes, int(largest(sizes) * 1.5))
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
        plan(sizes, need - 1)
    msg = str(err.value)
    assert "train_policy needs 1.88 MiB but the budget is 1.88 MiB" in msg
    assert f"at least {-(-need // MiB)}" in msg and "\n" not in msg


def test_check_before_ray_starts():
    """A budget below the largest declared phase is a config error (exit code 2), said before Ray starts."""
    from chatlearn_mem import ConfigError

    with pytest.raises(
        BudgetConfigError, match=r"train_policy needs 1\.88 MiB but the budget is 1\.00 MiB.*before starting"
    ) as e:
        check_budget(*declared(["memory.device_budget_mb=1"]))
    assert isinstance(e.value, ConfigError) and isinstance(e.value, BudgetError)
    check_budget(*declared(["memory.device_budget_mb=3"]))  # fits
    check_budget(*declared(["memory.device_budget_mb=auto"]))  # known once the GPUs are up
    check_budget(*declared())  # no budget: all or nothing


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
    s = plan(sizes, total)
    assert all({("policy_0", Part.GRADS), ("critic_0", Part.GRADS)} <= s.target(i) for i in range(len(PHASES)))
    assert s.summary()["0"]["gradients_kept"] == ["critic_0/grads", "policy_0/grads"]
    tight = plan(sizes, largest(sizes))  # no room: dropped as the plan says
    assert ("policy_0", Part.GRADS) not in tight.target(0) and not tight.summary()["0"]["gradients_kept"]
    for budget in (largest(sizes), int(largest(sizes) * 1.5), total):
        s = plan(sizes, budget)
        assert all(sum(s.sizes[i] for i in s.target(p)) <= budget for p in range(len(PHASES)))


def test_an_engine_that_cannot_sleep_is_planned_resident_in_every_phase():
    """vLLM's CPU build cannot sleep: its weights and KV cache stay, so the plan counts them in
    every phase and schedules the trainers in what is left; a budget below a phase plus the engine
    is refused, naming it."""
    cfg, models, _ = declared(preset="cpu_vllm")
    assert pinned_items(cfg, models) == {("rollout", Part.WEIGHTS)}
    assert pinned_items(*declared(["ray.use_gpu=true"], "cpu_vllm")[:2]) == set()  # on CUDA it sleeps
    assert pinned_items(*declared()[:2]) == set()
    sizes = estimate_sizes(cfg, models)
    pinned = pinned_items(cfg, models)
    engine = sizes["rollout"][Part.WEIGHTS]
    assert engine > 2**30  # its KV cache (rollout.kv_cache_gib) included
    trainer = max(sum(sizes[a].values()) for a in ("policy_0", "critic_0"))
    s = plan(sizes, engine + trainer, preset="cpu_vllm", pinned=pinned)
    assert all("rollout/weights" in r for r in s.plans[0].resident)
    assert all(("rollout", Part.WEIGHTS) in s.target(i) for i in range(len(PHASES)))
    assert s.kept(3) == {}  # needed everywhere, so never "kept beyond need"
    with pytest.raises(ValueError, match="train_.* needs .* but the budget is"):
        plan(sizes, trainer + engine // 2, preset="cpu_vllm", pinned=pinned)
    with pytest.raises(BudgetError, match="before starting"):
        check_budget(*declared([f"memory.device_budget_mb={(trainer + engine // 2) // 2**20}"], "cpu_vllm"))


@pytest.mark.parametrize("kl_coef", [0.0, 0.001])
def test_grpo_plans_the_phases_it_declared_and_no_reference_without_a_kl_term(kl_coef):
    """GRPO has no critic, and with grpo.kl_coef=0 no reference: neither is in the models, the
    phases, the sizes or the plan; the largest phase is the policy's training either way."""
    cfg = GRPORunConfig.model_validate({"grpo": {"kl_coef": kl_coef}})
    loop = GRPO(cfg)
    models, phases = loop.models(), loop.phases()
    expected = ["policy", "rollout", "reference"] if kl_coef else ["policy", "rollout"]
    assert [m.name for m in models] == expected
    assert [p.name for p in phases] == (["generate", "reference", "train"] if kl_coef else ["generate", "train"])
    sizes = estimate_sizes(cfg, models)
    assert sorted(sizes) == sorted(["policy_0", *expected[1:]])
    ds = phase_demands(models, phases, 1)
    train = sum(sizes["policy_0"].values())
    s = ResidencySchedule(sizes, train, ds, {a: 0 for a in sizes})
    assert s.phase_names == [p.name for p in phases]
    assert all(not any(k.startswith("critic") for k in r) for r in s.plans[0].resident)
    with pytest.raises(ValueError, match="train needs"):
        ResidencySchedule(sizes, train - 1, ds, {a: 0 for a in sizes})
