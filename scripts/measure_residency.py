"""Bytes moved and iteration time of a colocated PPO run for device budgets from the largest phase up
to every model at once, against all-or-nothing, in one run.

One local Ray cluster and one set of actors (the ``cpu_tiny`` preset with a wide, shallow policy and
critic: 2 layers of 1024, a 32 k vocabulary, about 93 M parameters and 1.5 GB of state each, so that
moving them takes a visible share of an iteration on a CPU; change it with ``--set key=value``) run one segment of
iterations per schedule, one after the other (every model is put to sleep between segments; the
training goes on, bit-identical whatever the schedule):

* ``all_or_nothing``: no budget, each phase onloads its models and offloads them after, blocking
  (what a run does without ``memory.device_budget_mb``);
* ``<f>x``: a budget of ``f`` times the largest phase, the plan's transitions non-blocking with
  prefetch (``memory.prefetch=true``), for ``f`` in ``--factors`` and for the budget that holds
  every model (``all``);
* ``<f>x_blocking``: the same plan with every transition completed before the phase goes on
  (``memory.prefetch=false``), for ``--blocking-factors``: the serial schedule prefetch is compared with.

Per segment (medians over its iterations after the first ``--warmup``): bytes copied per iteration
(measured by the actors' transfers) and the plan's own figure, the peak device bytes against the
budget, the iteration time and the *exposed* transition time (seconds the driver waited on
transitions rather than work).

Run: ``python scripts/measure_residency.py [--iterations 4] [--out benchmarks/results/NAME]``.
Prints a table; with ``--out`` writes ``NAME.json``, ``NAME.md`` and ``NAME.png`` (bytes moved and
exposed time against the budget).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

MODEL = ["num_layers=2", "hidden_size=1024", "num_attention_heads=8", "vocab_size=32768"]


def plot(results: dict, path: Path, largest: int) -> None:
    """Left: bytes copied per iteration against the budget (the plan's and the measured). Right: the
    exposed transition seconds and the iteration time, prefetch against blocking."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    planned = {k: r for k, r in results.items() if r["budget_bytes"] and not r["blocking"]}
    xs = [r["budget_bytes"] / largest for r in planned.values()]
    aon = results["all_or_nothing"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8), dpi=100)
    ax1.plot(
        xs,
        [r["moved_bytes"] / 2**20 for r in planned.values()],
        "o-",
        color="tab:blue",
        label="measured (actors' copies)",
    )
    ax1.plot(xs, [r["planned_bytes"] / 2**20 for r in planned.values()], "x--", color="black", label="the plan")
    ax1.axhline(aon["moved_bytes"] / 2**20, color="tab:red", ls=":", label="all or nothing (no budget)")
    ax1.set_xlabel("device budget / largest phase")
    ax1.set_ylabel("MiB copied per iteration")
    ax1.set_title("(1) bytes moved per iteration against the budget", loc="left", fontsize=10)
    ax1.legend(fontsize=8)
    ax1.set_ylim(bottom=0)
    ax1.grid(alpha=0.3)
    ax2.plot(
        xs, [r["transition_s"] for r in planned.values()], "o-", color="tab:blue", label="exposed transitions, prefetch"
    )
    blocking = {k: r for k, r in results.items() if r["blocking"]}
    if blocking:
        ax2.plot(
            [r["budget_bytes"] / largest for r in blocking.values()],
            [r["transition_s"] for r in blocking.values()],
            "s",
            color="tab:orange",
            label="exposed transitions, blocking (same plan)",
        )
    ax2.axhline(aon["transition_s"], color="tab:red", ls=":", label="exposed transitions, all or nothing")
    ax2.plot(xs, [r["iteration_s"] for r in planned.values()], "^-", color="0.4", label="iteration, prefetch")
    ax2.axhline(aon["iteration_s"], color="0.4", ls=":", label="iteration, all or nothing")
    ax2.set_xlabel("device budget / largest phase")
    ax2.set_ylabel("seconds per iteration (median)")
    ax2.set_title("(2) time per iteration and the part spent waiting on transitions", loc="left", fontsize=10)
    ax2.legend(fontsize=8)
    ax2.set_ylim(bottom=0)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _segment(run, loop, iterations: int, warmup: int, start: int) -> tuple[dict, int]:
    its = []
    for it in range(start, start + iterations):
        run.begin_iteration(it)
        its.append(run.end_iteration(loop.step(run, it)))
    kept = its[warmup:]
    phases = [r for r in run.timeline.records if r.iteration > start + warmup]  # numbered from 1
    budget = max(run.schedule.budget.values()) if run.schedule is not None else None
    return {
        "iteration_s": statistics.median(m["seconds"] for m in kept),
        "iteration_s_samples": [round(m["seconds"], 4) for m in kept],
        "transition_s": statistics.median(m["transition_seconds"] for m in kept),
        "transition_s_samples": [round(m["transition_seconds"], 4) for m in kept],
        "moved_bytes": statistics.median(m["moved_in_bytes"] + m["moved_out_bytes"] for m in kept),
        "peak_bytes": max(max(r.bundle_bytes.values()) for r in phases),
        "over_budget": bool(budget) and any(max(r.bundle_bytes.values()) > budget for r in phases),
        "rewards": [m["reward"] for m in its],
    }, start + iterations


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=3, help="iterations per segment")
    ap.add_argument("--warmup", type=int, default=1, help="first iterations of each segment left out")
    ap.add_argument("--factors", default="1.0,1.25,1.5,1.75,2.0", help="budgets, times the largest phase")
    ap.add_argument("--blocking-factors", default="1.0,1.25,1.5", help="budgets also run with blocking transitions")
    ap.add_argument("--set", action="append", default=[], help="override of the run config (key=value)")
    ap.add_argument("--out", default=None, help="write OUT.json, OUT.md and OUT.png")
    args = ap.parse_args()
    if args.iterations <= args.warmup:
        ap.error("--iterations must exceed --warmup")

    import ray

    from chatlearn_mem_ray import load_config
    from chatlearn_mem_ray.job.output import versions as _versions
    from chatlearn_mem_ray.loops.ppo import PPO
    from chatlearn_mem_ray.service.schedule import ResidencySchedule
    from chatlearn_mem_ray.service.service import Service

    base = [
        *(f"{role}.{kv}" for role in ("policy", "critic") for kv in MODEL),
        "memory.compare_iterations=0",
        f"output_dir={tempfile.mkdtemp(prefix='residency-')}",
        *args.set,
    ]
    cfg = load_config("cpu_tiny", base)
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    results: dict[str, dict] = {}
    t0 = time.perf_counter()
    try:
        loop = PPO(cfg)
        with Service(cfg, loop.models(), loop.phases(), progress=print) as run:
            colo, demands = run.colo, run.runner.demands
            sizes = {
                colo.names[a]: s
                for a, s in colo.call("plan", {a: a.part_sizes.remote() for a in colo.all_actors}).items()
            }
            from chatlearn_mem import Part

            sizes = {n: {Part(p): b for p, b in s.items()} for n, s in sizes.items()}
            largest = max(sum(sizes[a][p] for a, parts in d.needs.items() for p in parts) for d in demands)
            total = sum(b for s in sizes.values() for b in s.values())
            segments = [("all_or_nothing", None, False)]
            for f in args.factors.split(","):
                segments.append((f"{float(f):g}x", int(float(f) * largest), False))
            segments.append(("all", total, False))
            for f in args.blocking_factors.split(","):
                if f:
                    segments.append((f"{float(f):g}x_blocking", int(float(f) * largest), True))
            start = 0
            for name, budget, blocking in segments:
                run.sleep_all()
                run.runner.schedule = ResidencySchedule(sizes, budget, demands, colo.bundle_of) if budget else None
                run.runner.prefetch = not blocking
                print(f"[{name}] {args.iterations} iterations ...", flush=True)
                r, start = _segment(run, loop, args.iterations, args.warmup, start)
                r.update(
                    budget_bytes=budget,
                    blocking=blocking,
                    planned_bytes=run.schedule.plans[0].bytes_moved if run.schedule else None,
                    all_or_nothing_planned_bytes=run.schedule.plans[0].all_or_nothing_bytes if run.schedule else None,
                    kept={run.schedule.phase_names[i]: sorted(k) for i, k in enumerate(run.schedule.plans[0].resident)}
                    if run.schedule
                    else None,
                )
                if run.schedule is not None:  # sizes after the first steps (optimizer states)
                    sizes = {n: {p: run.schedule.sizes[(n, p)] for p in parts} for n, parts in sizes.items()}
                results[name] = r
                print(
                    f"[{name}] {r['moved_bytes'] / 2**20:.2f} MiB moved, iteration {r['iteration_s']:.3f} s, "
                    f"exposed transitions {r['transition_s']:.3f} s",
                    flush=True,
                )
    finally:
        ray.shutdown()
    aon = results["all_or_nothing"]
    rows = [
        "| schedule | budget (MiB) | budget / largest phase | MiB copied per iteration (plan) | peak MiB "
        "| iteration (s) | exposed transitions (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        b = r["budget_bytes"]
        plan = f" ({r['planned_bytes'] / 2**20:.2f})" if r["planned_bytes"] is not None else ""
        rows.append(
            f"| {name} | {b / 2**20:.1f} | {b / largest:.2f} | {r['moved_bytes'] / 2**20:.2f}{plan} | "
            f"{r['peak_bytes'] / 2**20:.1f} | {r['iteration_s']:.3f} | {r['transition_s']:.3f} |"
            if b
            else f"| {name} | - | - | {r['moved_bytes'] / 2**20:.2f} | {r['peak_bytes'] / 2**20:.1f} | "
            f"{r['iteration_s']:.3f} | {r['transition_s']:.3f} |"
        )
    ratios = {
        name[: -len("_blocking")]: results[name[: -len("_blocking")]]["transition_s"] / r["transition_s"]
        for name, r in results.items()
        if r["blocking"] and r["transition_s"]
    }
    table = "\n".join(rows)
    print(table)
    for k, v in ratios.items():
        print(f"exposed transitions, prefetch / blocking at {k}: {v:.2f}")
    print(
        f"exposed transitions, prefetch at 1x / all or nothing: {results['1x']['transition_s'] / aon['transition_s']:.2f}"
        if "1x" in results and aon["transition_s"]
        else ""
    )
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "command": " ".join(
                [
                    "python scripts/measure_residency.py",
                    *(f"--set {s}" for s in args.set),
                    f"--iterations {args.iterations}",
                    f"--factors {args.factors}",
                    f"--blocking-factors {args.blocking_factors}",
                ]
            ),
            "policy": cfg.policy.model_dump(),
            "critic": cfg.critic.model_dump(),
            "ppo": cfg.ppo.model_dump(),
            "largest_phase_bytes": largest,
            "all_models_bytes": total,
            "warmup": args.warmup,
            "versions": _versions(),
            "cpus": os.cpu_count(),
            "machine": platform.processor(),
            "seconds": time.perf_counter() - t0,
            "prefetch_vs_blocking_exposed": ratios,
            "results": results,
        }
        out.with_suffix(".json").write_text(json.dumps(record, indent=1))
        plot(results, out.with_suffix(".png"), largest)
        out.with_suffix(".md").write_text(
            f"# Residency plan: bytes moved and time for a device budget\n\n`{record['command']}` on "
            f"{os.cpu_count()} CPUs (versions: {json.dumps(record['versions'])}).\nPolicy and critic: {', '.join(MODEL)}; "
            f"largest phase {largest / 2**20:.1f} MiB, every model {total / 2**20:.1f} MiB; medians over iterations "
            f"{args.warmup + 1}..{args.iterations} of each segment.\n\n{table}\n\n"
            + "".join(f"Exposed transitions, prefetch / blocking at {k}: {v:.2f}\n\n" for k, v in ratios.items())
            + f"![bytes moved and time against the budget]({out.with_suffix('.png').name})\n"
        )
        print(f"wrote {out.with_suffix('.json')}, {out.with_suffix('.md')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
