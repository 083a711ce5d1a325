"""Time chatlearn_mem.plan_residency on schedules of 64 items x 8 phases (the issue's target: < 100 ms).

Two kinds of seeded schedules, each at budgets of 1.0, 1.25, 1.5 and 2.0 times the largest phase:

* ``models``: 16 models x 4 parts (weights; grads, scratch; fp32 main weights, 2x; optimizer
  states, 4x), weights of 0.1-4 GiB. A model trains in one phase (all four parts needed, all but
  the grads written) with probability 0.75 and runs forward only (weights) in 1-3 others.
* ``random``: 64 items of 1 B - 1 GiB, each needed in each phase with probability 0.35, written in
  half of those, one in ten scratch (the kind the unit tests use).

Each plan is timed ``--repeats`` times (``time.perf_counter``, one process, after one untimed run);
the script prints the median and the min-max spread of each, the plan's bytes against
all-or-nothing, whether it is proven optimal and the search nodes, then the overall median and worst
time. Run: ``python scripts/measure_planner.py [--repeats 20] [--seeds 3]`` in the project's
environment (importing ``chatlearn_mem`` loads torch; the planner itself runs no torch code).
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time

from chatlearn_mem import plan_residency

GIB = 2**30
FACTORS = (1.0, 1.25, 1.5, 2.0)


def models_schedule(rng: random.Random, n_models: int = 16, n_phases: int = 8):
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
    sizes = {f"item{k:02d}": rng.randint(1, GIB) for k in range(n_items)}
    phases = [{x for x in sizes if rng.random() < 0.35} for _ in range(n_phases)]
    return (
        sizes,
        phases,
        [{x for x in sorted(p) if rng.random() < 0.5} for p in phases],
        {x for x in sizes if rng.random() < 0.1},
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--seeds", type=int, default=3, help="schedules of each kind")
    args = ap.parse_args()
    print(
        f"python {platform.python_version()} on {platform.machine()} {platform.processor() or ''}; "
        f"{args.repeats} timed runs per plan"
    )
    medians, worst = [], 0.0
    for kind, make in (("models", models_schedule), ("random", random_schedule)):
        for seed in range(args.seeds):
            sizes, phases, written, scratch = make(random.Random(seed))
            largest = max(sum(sizes[x] for x in p) for p in phases)
            for factor in FACTORS:
                budget = int(factor * largest)
                run = lambda: plan_residency(sizes, phases, budget, written=written, scratch=scratch)  # noqa: E731
                plan = run()
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    run()
                    times.append((time.perf_counter() - t0) * 1e3)
                med = statistics.median(times)
                medians.append(med)
                worst = max(worst, max(times))
                print(
                    f"{kind:6s} seed {seed} {factor:4.2f}x largest: {med:6.1f} ms median "
                    f"({min(times):.1f}-{max(times):.1f}); {plan.bytes_moved / GIB:7.1f} GiB moved of "
                    f"{plan.all_or_nothing_bytes / GIB:7.1f} all-or-nothing, "
                    f"{'optimal' if plan.optimal else 'best found'}, {plan.search_nodes} nodes"
                )
    print(
        f"all {len(medians)} plans: median of medians {statistics.median(medians):.1f} ms, "
        f"slowest median {max(medians):.1f} ms, slowest single run {worst:.1f} ms"
    )


if __name__ == "__main__":
    main()
