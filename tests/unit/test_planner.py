"""The residency planner: exact on small schedules (checked against an exhaustive search written
here), never worse than all-or-nothing, within budget, bounded work, every mistake named."""

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from planner_oracle import optimum_bytes, schedule_bytes

from chatlearn_mem import plan_residency
from chatlearn_mem.planner import _MAX_WORK, _plan, residency_bytes_moved

G = 2**30


def random_instance(rng, max_items=5, max_phases=5):
    n_items, n = rng.randint(1, max_items), rng.randint(1, max_phases)
    names = [f"model{k}/part" for k in range(n_items)]
    sizes = {x: rng.choice([0, *[rng.randint(1, 100)] * 6]) for x in names}
    phases = [{x for x in names if rng.random() < 0.4} for _ in range(n)]
    written = [{x for x in sorted(ph) if rng.random() < 0.5} for ph in phases]  # sorted: not hash order
    scratch = {x for x in names if rng.random() < 0.15}
    need = [sum(sizes[x] for x in ph) for ph in phases]
    budget = max(need) + int(rng.choice([0, 0.1, 0.25, 0.5, 0.75, 1.0, 1.2]) * (sum(sizes.values()) - max(need)))
    return sizes, phases, budget, written, scratch


def check_plan(plan, sizes, phases, budget, written, scratch):
    assert all(r >= set(p) for r, p in zip(plan.resident, phases))
    assert plan.resident_bytes == tuple(sum(sizes[x] for x in r) for r in plan.resident)
    assert max(plan.resident_bytes) <= budget
    assert plan.bytes_moved == schedule_bytes(sizes, plan.resident, written, scratch)
    assert plan.all_or_nothing_bytes == schedule_bytes(sizes, phases, written, scratch)
    assert plan.bytes_moved <= plan.all_or_nothing_bytes
    assert plan.kept == tuple(r - set(p) for r, p in zip(plan.resident, phases))


ORACLE_INSTANCES = 1000


def test_small_schedules_are_solved_exactly():
    """Up to 5 items x 5 phases the search finishes: every plan is proven optimal and moves
    exactly the exhaustive search's bytes. The greedy alone (no search) is measured beside it."""
    rng = random.Random(22)
    worst_greedy, greedy_off = 0.0, 0
    for _ in range(ORACLE_INSTANCES):
        sizes, phases, budget, written, scratch = inst = random_instance(rng)
        plan = plan_residency(sizes, phases, budget, written=written, scratch=scratch)
        check_plan(plan, *inst)
        best = optimum_bytes(*inst)
        assert plan.optimal and plan.bytes_moved == best, (inst, plan)
        greedy = _plan(sizes, phases, budget, written=written, scratch=scratch, max_work=0)
        check_plan(greedy, *inst)
        if greedy.bytes_moved > best:
            greedy_off += 1
            worst_greedy = max(worst_greedy, (greedy.bytes_moved - best) / best)
    print(
        f"{ORACLE_INSTANCES} instances: planner optimal in all; greedy alone above the optimum in "
        f"{greedy_off}, by at most {worst_greedy:.1%}"
    )


def test_cost_function_matches_a_simulation_of_the_copies():
    rng = random.Random(5)
    for _ in range(300):
        sizes, phases, _, written, scratch = random_instance(rng, max_items=6, max_phases=7)
        resident = [set(ph) | {x for x in sizes if rng.random() < 0.5} for ph in phases]
        assert residency_bytes_moved(sizes, resident, written=written, scratch=scratch) == schedule_bytes(
            sizes, resident, written, scratch
        )


# --- hand-checked examples ---------------------------------------------------------------------


def ppo_schedule():
    """generate, reference, values, train_critic, train_policy; the trainers' parts written when
    they train, grads and the KV cache scratch. Largest phase: a trainer's 16 GiB."""
    sizes = {
        "policy/weights": 2 * G,
        "policy/grads": 2 * G,
        "policy/main_weights": 4 * G,
        "policy/optimizer_states": 8 * G,
        "critic/weights": 2 * G,
        "critic/grads": 2 * G,
        "critic/main_weights": 4 * G,
        "critic/optimizer_states": 8 * G,
        "reference/weights": 2 * G,
        "rollout/weights": 2 * G,
        "rollout/kv_cache": 6 * G,
    }
    train = lambda m: {f"{m}/weights", f"{m}/grads", f"{m}/main_weights", f"{m}/optimizer_states"}  # noqa: E731
    phases = [
        {"policy/weights", "rollout/weights", "rollout/kv_cache"},
        {"reference/weights"},
        {"critic/weights"},
        train("critic"),
        train("policy"),
    ]
    written = [set(), set(), set(), train("critic"), train("policy")]
    scratch = {"policy/grads", "critic/grads", "rollout/kv_cache"}
    return sizes, phases, written, scratch


def test_ppo_schedule_at_the_largest_phase_is_all_or_nothing():
    """Every gap of every item crosses a training phase, which has no room left: nothing can stay.
    All-or-nothing by hand (GiB): policy weights 2 in + 2 out (resident train_policy -> generate),
    rollout 2, reference 2, critic weights 2 + 2, critic main 4 + 4, critic optimizer 8 + 8,
    policy main 4 + 4, policy optimizer 8 + 8 = 60."""
    sizes, phases, written, scratch = ppo_schedule()
    plan = plan_residency(sizes, phases, 16 * G, written=written, scratch=scratch)
    assert plan.bytes_moved == plan.all_or_nothing_bytes == 60 * G
    assert plan.optimal and plan.resident == tuple(map(frozenset, phases))
    into_generate = plan.boundaries[0]  # policy/weights stays: needed on both sides
    assert into_generate.move_out == ("policy/grads", "policy/main_weights", "policy/optimizer_states")
    assert into_generate.copy_out == ("policy/main_weights", "policy/optimizer_states")  # grads are dropped
    assert into_generate.move_in == ("rollout/kv_cache", "rollout/weights")
    assert (into_generate.bytes_out, into_generate.bytes_in) == (12 * G, 2 * G)  # the KV cache is rebuilt


def test_ppo_schedule_at_one_and_a_quarter_keeps_both_main_weights():
    """At 20 GiB the training phases have 4 GiB spare. Keeping policy/main_weights through phases
    0-3 and critic/main_weights through 4, 0, 1, 2 saves 8 + 8; any mix of the 2 GiB items saves
    at most 10 in that room. 60 - 16 = 44 GiB."""
    sizes, phases, written, scratch = ppo_schedule()
    plan = plan_residency(sizes, phases, 20 * G, written=written, scratch=scratch)
    assert plan.bytes_moved == 44 * G and plan.optimal
    assert plan.kept[1] == {"policy/main_weights", "critic/main_weights"}
    assert plan.kept[3] == {"policy/main_weights"} and plan.kept[4] == {"critic/main_weights"}
    into_train_policy = plan.boundaries[4]
    assert into_train_policy.move_out == ("critic/grads", "critic/optimizer_states", "critic/weights")
    assert into_train_policy.copy_out == ("critic/optimizer_states", "critic/weights")
    assert into_train_policy.move_in == ("policy/grads", "policy/optimizer_states", "policy/weights")
    assert (into_train_policy.bytes_out, into_train_policy.bytes_in) == (10 * G, 10 * G)
    assert plan.resident_bytes[3] == plan.resident_bytes[4] == 20 * G


@pytest.mark.parametrize("factor", [1.0, 1.25, 1.5, 2.0])
def test_ppo_schedule_moves_the_optimum_bytes(factor):
    sizes, phases, written, scratch = ppo_schedule()
    budget = int(factor * 16 * G)
    plan = plan_residency(sizes, phases, budget, written=written, scratch=scratch)
    check_plan(plan, sizes, phases, budget, written, scratch)
    assert plan.optimal and plan.bytes_moved == optimum_bytes(sizes, phases, budget, written, scratch)


def test_ppo_schedule_with_room_for_everything_moves_nothing():
    sizes, phases, written, scratch = ppo_schedule()
    plan = plan_residency(sizes, phases, sum(sizes.values()), written=written, scratch=scratch)
    assert plan.bytes_moved == 0 and plan.all_or_nothing_bytes == 60 * G
    stay = set(sizes) - scratch
    assert all(r - scratch == stay for r in plan.resident)
    assert all(r & scratch == set(p) & scratch for r, p in zip(plan.resident, phases))  # free to move: not kept


def test_clean_items_are_dropped_for_free_and_written_ones_copied_out():
    sizes = {"a": 10, "b": 10}
    phases = [{"a"}, {"b"}]
    assert plan_residency(sizes, phases, 10).bytes_moved == 20  # two in-moves, two free drops
    plan = plan_residency(sizes, phases, 10, written=[{"a"}, set()])
    assert plan.bytes_moved == 30 and plan.boundaries[1].copy_out == ("a",)
    assert plan_residency(sizes, phases, 20, written=[{"a"}, {"b"}]).bytes_moved == 0


def test_one_phase_and_unused_items_never_move():
    plan = plan_residency({"a": 5, "unused": 7}, [{"a"}], 5, written=[{"a"}])
    assert plan.bytes_moved == 0 and plan.resident == (frozenset({"a"}),)
    assert plan.all_or_nothing_bytes == 0


def test_an_item_with_many_gaps_gets_windows_of_gaps_and_no_optimality_claim():
    """Needed in every other phase of 24 (12 gaps): the patterns are cyclic windows of consecutive
    gaps, not all 4095 subsets, so the plan does not claim optimality; room for the item
    everywhere still keeps it resident throughout. With phase 23 taken by another item, the window
    of the other 11 gaps makes one run: 3 B in, 3 B out, plus b's 3 B in."""
    phases = [{"a"} if i % 2 == 0 else set() for i in range(24)]
    written = [{"a"} if i % 4 == 0 else set() for i in range(24)]
    plan = plan_residency({"a": 3}, phases, 3, written=written)
    assert not plan.optimal and plan.bytes_moved == 0 and plan.all_or_nothing_bytes == 12 * 3 + 6 * 3
    assert plan_residency({"a": 3, "b": 3}, [*phases[:-1], {"b"}], 3, written=written).bytes_moved == 9


def test_the_plan_is_deterministic_and_ties_break_by_name():
    """Two equal items, room for one: the same one (the first by name) every time, whatever the
    order of the inputs."""
    sizes = {"b": 4, "a": 4, "c": 8}
    phases = [["a", "b"], ["c"]]
    plan = plan_residency(sizes, phases, 12)
    assert plan.kept[1] == {"a"} and plan.bytes_moved == 4 + 8
    again = plan_residency(dict(reversed(list(sizes.items()))), [["b", "a"], {"c"}], 12)
    assert again == plan


# --- the large case: bounded work ------------------------------------------------------------


def large_instance(seed, n_items=64, n=8, spare=0.3):
    rng = random.Random(seed)
    names = [f"model{k:02d}/part" for k in range(n_items)]
    sizes = {x: rng.randint(1, G) for x in names}
    phases = [{x for x in names if rng.random() < 0.35} for _ in range(n)]
    written = [{x for x in sorted(ph) if rng.random() < 0.5} for ph in phases]
    scratch = {x for x in names if rng.random() < 0.1}
    need = [sum(sizes[x] for x in ph) for ph in phases]
    budget = max(need) + int(spare * (sum(sizes.values()) - max(need)))
    return sizes, phases, budget, written, scratch


@pytest.mark.parametrize("spare", [0.0, 0.1, 0.3, 0.8])
def test_64_items_by_8_phases_stop_within_the_work_bound(spare):
    """The time is measured by the benchmark's planner report (``chatlearn-mem bench planner=true``,
    about 40 ms); here the deterministic stand-in: the search stops within its work bound, and the
    plan is still valid and no worse than the greedy it starts from."""
    sizes, phases, budget, written, scratch = inst = large_instance(64, spare=spare)
    plan = plan_residency(sizes, phases, budget, written=written, scratch=scratch)
    check_plan(plan, *inst)
    assert plan.search_nodes <= _MAX_WORK
    greedy = _plan(sizes, phases, budget, written=written, scratch=scratch, max_work=0)
    assert plan.bytes_moved <= greedy.bytes_moved < plan.all_or_nothing_bytes
    assert plan_residency(sizes, phases, budget, written=written, scratch=scratch) == plan


# --- no torch ---------------------------------------------------------------------------------


def test_the_planner_runs_without_torch_and_plans_alike_in_every_process():
    """``chatlearn_mem/__init__.py`` imports the torch-based managers, so the package is replaced
    by a bare one and only the planner module (and what it imports) is loaded, torch blocked.
    Two processes with other string hashes (set orders) make the same 64 x 8 plan, which the
    search does not prove optimal (its neighbourhoods are drawn from a seeded generator)."""
    package = Path(__file__).resolve().parents[2] / "chatlearn_mem"
    code = textwrap.dedent(f"""
        import random, sys, types
        sys.modules["torch"] = None  # any import of torch now raises ImportError
        bare = types.ModuleType("chatlearn_mem")
        bare.__path__ = [{str(package)!r}]
        sys.modules["chatlearn_mem"] = bare
        from chatlearn_mem.planner import plan_residency
        plan = plan_residency({{"a": 4, "b": 4}}, [{{"a"}}, {{"b"}}], 8, written=[{{"a"}}, set()])
        rng = random.Random(1)
        sizes = {{f"item{{k:02d}}": rng.randint(1, 2**30) for k in range(64)}}
        phases = [{{x for x in sizes if rng.random() < 0.35}} for _ in range(8)]
        written = [{{x for x in sorted(p) if rng.random() < 0.5}} for p in phases]
        budget = int(1.5 * max(sum(sizes[x] for x in p) for p in phases))
        large = plan_residency(sizes, phases, budget, written=written)
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "ray", "megatron")
                       and sys.modules[m] is not None)
        print(plan.bytes_moved, plan.all_or_nothing_bytes, heavy, large.optimal)
        print(large.bytes_moved, [sorted(r) for r in large.resident])
    """)
    outputs = []
    for hash_seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONHASHSEED": hash_seed},
        )
        assert out.returncode == 0, out.stderr
        outputs.append(out.stdout.splitlines())
    assert outputs[0][0].split() == ["0", "12", "[]", "False"]
    assert outputs[0][1] == outputs[1][1]


# --- errors -----------------------------------------------------------------------------------


def test_a_phase_over_the_budget_is_named_with_its_bytes():
    sizes = {"a": 4 * G, "b": 8 * G, "c": 2 * G}
    with pytest.raises(
        ValueError,
        match=r"phase 2 needs 12\.00 GiB \(12884901888 B\) but budget_bytes is "
        r"10\.00 GiB \(10737418240 B\).*at least the largest phase, 12884901888 B",
    ):
        plan_residency(sizes, [{"a"}, {"c"}, {"a", "b"}], 10 * G)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(phases=[{"a", "x"}]), r"phases\[0\] names 'x', which is not in sizes \(sizes has 2 items: 'a', 'b'\)"),
        (dict(written=[{"y"}]), r"written\[0\] names 'y', which is not in sizes"),
        (dict(scratch={"z"}), r"scratch names 'z', which is not in sizes"),
        (dict(written=[{"a"}, set()]), r"written has 2 entries but phases has 1"),
        (
            dict(written=[{"b"}]),
            r"written\[0\] names 'b', which phases\[0\] lacks; an item modified in a phase must be "
            r"resident in it",
        ),
        (dict(sizes={"a": 1, "b": -3}), r"sizes\['b'\] must be >= 0 bytes, got -3"),
        (dict(budget_bytes=-1), r"budget_bytes must be >= 0 bytes, got -1"),
        (dict(phases=[]), r"phases is empty; give at least one phase"),
    ],
)
def test_mistakes_raise_value_errors_that_name_them(kwargs, message):
    args = dict(sizes={"a": 1, "b": 2}, phases=[{"a"}], budget_bytes=10) | kwargs
    with pytest.raises(ValueError, match=message):
        plan_residency(args.pop("sizes"), args.pop("phases"), args.pop("budget_bytes"), **args)


def test_wrong_types_raise_type_errors():
    with pytest.raises(
        TypeError,
        match=r"phases\[0\] is the string 'a'; give a collection of item names, "
        r"e.g. \{'a'\}",
    ):
        plan_residency({"a": 1}, ["a"], 1)
    with pytest.raises(TypeError, match=r"sizes\['a'\] must be an integer number of bytes, got 1.5 \(float\)"):
        plan_residency({"a": 1.5}, [{"a"}], 2)
    with pytest.raises(TypeError, match=r"budget_bytes must be an integer number of bytes, got True \(bool\)"):
        plan_residency({"a": 1}, [{"a"}], True)
    with pytest.raises(TypeError, match=r"scratch is the string 'a'; give a collection of item names"):
        plan_residency({"a": 1}, [{"a"}], 1, scratch="a")


def test_the_cost_function_checks_its_schedule():
    with pytest.raises(ValueError, match=r"written\[1\] names 'a', which resident\[1\] lacks"):
        residency_bytes_moved({"a": 1}, [{"a"}, set()], written=[set(), {"a"}])
    with pytest.raises(ValueError, match=r"resident\[0\] names 'q', which is not in sizes"):
        residency_bytes_moved({"a": 1}, [{"q"}])
