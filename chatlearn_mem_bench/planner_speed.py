"""The ``planner`` report (``planner: true``, off by default): how long
:func:`chatlearn_mem.plan_residency` takes on schedules of 64 items x 8 phases, against its target
of 100 ms.

Two kinds of seeded schedules, ``planner_seeds`` of each, each at budgets of 1.0, 1.25, 1.5 and
2.0 times the largest phase:

* ``models``: 16 models x 4 parts (weights; grads, scratch; fp32 main weights, 2x; optimizer
  states, 4x), weights of 0.1-4 GiB. A model trains in one phase (all four parts needed, all but
  the grads written) with probability 0.75 and runs forward only (weights) in 1-3 others.
* ``random``: 64 items of 1 B - 1 GiB, each needed in each phase with probability 0.35, written in
  half of those, one in ten scratch (the kind the unit tests use).

Each plan is timed ``planner_repeats`` times (``time.perf_counter``, after one untimed run): its
median and spread, its bytes against all-or-nothing, whether it is proven optimal and its search
nodes; then the median of the medians, the slowest median and the slowest single run. The plan
needs no trainer: pure Python, no torch code. This was ``scripts/measure_planner.py``
(``git show 8006b4f:scripts/measure_planner.py``); its figures are in docs/residency_planner.md.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Optional

__all__ = [
    "FACTORS",
    "TARGET_MS",
    "measure_planner",
    "models_schedule",
    "planner_lines",
    "planner_targets",
    "random_schedule",
]

GIB = 2**30
FACTORS = (1.0, 1.25, 1.5, 2.0)
"""Budgets, as multiples of the schedule's largest phase."""
TARGET_MS = 100.0
"""Every plan's median must stay under this (the planner's target for 64 items x 8 phases)."""


def models_schedule(rng: random.Random, n_models: int = 16, n_phases: int = 8):
    """``(sizes, phases, written, scratch)`` of 16 models' parts over 8 phases (see the module)."""
    sizes, phases, written, scratch = {}, [set() for _ in range(n_phases)], [set() for _ in range(n_phases)], set()
    for m in range(n_models):
        w = rng.randint(GIB // 10, 4 * GIB)
        parts = {
            f"m{m:02d}/weights": w,
            f"m{m:02d}/grads": w,
            f"m{m:02d}/main_weights": 2 * w,
            f"m{m:02d}/optimizer_states": 4 * w,
        }
        sizes |= parts
        scratch.add(f"m{m:02d}/grads")
        order = rng.sample(range(n_phases), 4)
        if rng.random() < 0.75:
            train = order.pop()
            phases[train] |= parts.keys()
            written[train] |= parts.keys() - scratch
        for p in order[: rng.randint(1, 3)]:
            phases[p].add(f"m{m:02d}/weights")
    return sizes, phases, written, scratch


def random_schedule(rng: random.Random, n_items: int = 64, n_phases: int = 8):
    """``(sizes, phases, written, scratch)`` of 64 random items over 8 phases (see the module)."""
    sizes = {f"item{k:02d}": rng.randint(1, GIB) for k in range(n_items)}
    phases = [{x for x in sizes if rng.random() < 0.35} for _ in range(n_phases)]
    return (
        sizes,
        phases,
        [{x for x in sorted(p) if rng.random() < 0.5} for p in phases],
        {x for x in sizes if rng.random() < 0.1},
    )


def measure_planner(repeats: int, seeds: int) -> dict:
    """Plan every schedule (``seeds`` of each kind, every budget factor), each timed ``repeats``
    times after one untimed run; the rows and the overall figures, in milliseconds."""
    from chatlearn_mem import plan_residency

    rows = []
    for kind, make in (("models", models_schedule), ("random", random_schedule)):
        for seed in range(seeds):
            sizes, phases, written, scratch = make(random.Random(seed))
            largest = max(sum(sizes[x] for x in p) for p in phases)
            for factor in FACTORS:
                budget = int(factor * largest)

                def run():
                    return plan_residency(sizes, phases, budget, written=written, scratch=scratch)

                plan = run()
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    run()
                    times.append((time.perf_counter() - t0) * 1e3)
                rows.append(
                    {
                        "kind": kind,
                        "seed": seed,
                        "factor": factor,
                        "median_ms": statistics.median(times),
                        "min_ms": min(times),
                        "max_ms": max(times),
                        "bytes_moved": plan.bytes_moved,
                        "all_or_nothing_bytes": plan.all_or_nothing_bytes,
                        "optimal": plan.optimal,
                        "search_nodes": plan.search_nodes,
                    }
                )
    medians = [r["median_ms"] for r in rows]
    return {
        "items": 64,
        "phases": 8,
        "repeats": repeats,
        "seeds": seeds,
        "rows": rows,
        "median_of_medians_ms": statistics.median(medians),
        "slowest_median_ms": max(medians),
        "fastest_median_ms": min(medians),
        "slowest_run_ms": max(r["max_ms"] for r in rows),
        "target_ms": TARGET_MS,
    }


def planner_lines(pl: Optional[dict]) -> list[str]:
    """The report's section of the markdown: every plan's time, bytes and proof, then the summary."""
    if not pl:
        return []
    lines = [
        "",
        f"## The residency planner on {len(pl['rows'])} schedules of {pl['items']} items x {pl['phases']} phases",
        "",
        f"Each plan timed {pl['repeats']} times after one untimed run; bytes moved against all-or-nothing.",
        "",
        "| kind | seed | budget / largest phase | median ms | min-max ms | GiB moved | GiB all-or-nothing | plan | nodes |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in pl["rows"]:
        lines.append(
            f"| {r['kind']} | {r['seed']} | {r['factor']:.2f} | {r['median_ms']:.1f} | {r['min_ms']:.1f}-"
            f"{r['max_ms']:.1f} | {r['bytes_moved'] / GIB:.1f} | {r['all_or_nothing_bytes'] / GIB:.1f} | "
            f"{'optimal' if r['optimal'] else 'best found'} | {r['search_nodes']} |"
        )
    lines += [
        "",
        f"Median of the medians {pl['median_of_medians_ms']:.1f} ms, slowest median {pl['slowest_median_ms']:.1f} ms, "
        f"fastest {pl['fastest_median_ms']:.1f} ms; slowest single run {pl['slowest_run_ms']:.1f} ms "
        f"(target: every median under {pl['target_ms']:.0f} ms).",
    ]
    return lines


def planner_targets(pl: Optional[dict]) -> list[dict]:
    """Every plan's median under :data:`TARGET_MS`."""
    if not pl:
        return []
    return [
        {
            "name": f"residency planner: every plan of {pl['items']} x {pl['phases']} under {pl['target_ms']:.0f} ms",
            "passed": pl["slowest_median_ms"] < pl["target_ms"],
            "detail": f"slowest median {pl['slowest_median_ms']:.1f} ms of {len(pl['rows'])} plans (median of the "
            f"medians {pl['median_of_medians_ms']:.1f} ms; slowest single run {pl['slowest_run_ms']:.1f} ms)",
        }
    ]
