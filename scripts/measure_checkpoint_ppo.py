"""How much saving a run checkpoint lengthens a PPO iteration: asynchronous against synchronous, one run.

Runs one PPO config (default: the ``cpu_tiny`` preset with a larger policy and critic, about 7 M
parameters each; change it with ``--set key=value``) for ``--iterations`` iterations in each mode,
one after the other on one local Ray cluster:

* ``none``: no checkpoints (the baseline);
* ``sync``: ``checkpoint.every=1``, ``async_save=false``: the driver waits for every save;
* ``async``: ``checkpoint.every=1``: the trainers write in the background while the next
  iteration's generate, reference and values phases run (megatron's ``fully_reshardable``
  optimizer format, whose copy into model-space tensors happens before the save returns);
* ``async_dp``: the same with ``checkpoint.resharding=false`` (``dp_reshardable``: no copy;
  megatron-core 0.14+).

Per mode it reports the median iteration time (the first ``--warmup`` iterations left out), the
median time the driver was blocked by checkpointing per iteration, the median save duration
(start to commit), the bytes of one checkpoint, and, as the ceiling of the disk, one sequential
write of that many bytes from host memory with ``fsync``, timed in the same run. The
lengthening is each mode's median iteration time minus the baseline's.

Run: ``python scripts/measure_checkpoint_ppo.py [--iterations 6] [--out benchmarks/results/NAME]``.
Prints a table; with ``--out`` writes ``NAME.json``, ``NAME.md`` and ``NAME.png`` (each mode's
median iteration split into its phases, the checkpoint wait and the rest).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path

from measure_checkpoint import plain_write_seconds  # the same disk ceiling as the save benchmark

MODEL = ["num_layers=4", "hidden_size=256", "num_attention_heads=4", "vocab_size=8192"]
MODES = {
    "none": [],
    "sync": ["checkpoint.every=1", "checkpoint.async_save=false"],
    "async": ["checkpoint.every=1", "checkpoint.async_save=true"],
    "async_dp": ["checkpoint.every=1", "checkpoint.async_save=true", "checkpoint.resharding=false"],
}


def plot(results: dict, path: Path, samples: int) -> None:
    """One horizontal bar per mode: the median iteration split into its phases, the time the driver
    was blocked by checkpointing, and the rest (driver and Ray overhead; with a background save,
    also the phases slowed by the writers sharing the CPUs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(results)
    phases = list(next(iter(results.values()))["phase_s"])
    colors = dict(zip(phases, plt.get_cmap("tab10").colors))
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.7 * len(modes)), dpi=100)
    for y, mode in enumerate(modes):
        r, left = results[mode], 0.0
        parts = [
            *((p, r["phase_s"][p], colors[p], "") for p in phases),
            ("checkpoint (driver blocked)", r["blocked_s"], "black", ""),
            (
                "other (driver, Ray)",
                max(0.0, r["iteration_s"] - sum(r["phase_s"].values()) - r["blocked_s"]),
                "lightgray",
                "//",
            ),
        ]
        for label, width, color, hatch in parts:
            ax.barh(y, width, left=left, color=color, hatch=hatch, edgecolor="white", label=label if y == 0 else None)
            left += width
        extra = f"  {r['lengthening_s']:+.2f} s" if r.get("lengthening_s") else ""
        ax.text(left + 0.02, y, f"{r['iteration_s']:.2f} s{extra}", va="center")
    ax.set_yticks(range(len(modes)), modes)
    ax.invert_yaxis()
    ax.set_xlabel(f"seconds per PPO iteration (median of {samples})")
    ax.set_xlim(0, max(r["iteration_s"] for r in results.values()) * 1.25)
    ax.set_title("A run checkpoint after every iteration: where an iteration's time goes")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1, help="first iterations of each mode left out")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES))
    ap.add_argument("--set", action="append", default=[], help="override of the run config (key=value)")
    ap.add_argument("--dir", default=None, help="where runs and checkpoints go (default: a temporary directory)")
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = ap.parse_args()
    if args.iterations <= args.warmup:
        ap.error("--iterations must exceed --warmup")

    import ray

    from chatlearn_mem_ray import load_config, run_ppo
    from chatlearn_mem_ray.job.output import versions as _versions

    base = [
        *(f"{role}.{kv}" for role in ("policy", "critic") for kv in MODEL),
        f"ppo.iterations={args.iterations}",
        "memory.compare_iterations=0",
        "checkpoint.keep_last=1",
        *args.set,
    ]
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-ppo-"))
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    results: dict[str, dict] = {}
    try:
        for mode in args.modes.split(","):
            cfg = load_config(
                "cpu_tiny", [*base, *MODES[mode], f"output_dir={root / mode}", "output_dir_exists=overwrite"]
            )
            print(f"[{mode}] {args.iterations} iterations ...", flush=True)
            log = run_ppo(cfg, progress=lambda line: None)
            its = log["iterations"][args.warmup :]
            saves = [c for c in log["checkpoints"] if c["iterations_done"] > args.warmup]
            phases = list(its[0]["phase_seconds"])
            r = {
                "iteration_s": statistics.median(m["seconds"] for m in its),
                "phase_s": {p: statistics.median(m["phase_seconds"][p] for m in its) for p in phases},
                "iteration_s_samples": [round(m["seconds"], 4) for m in its],
                "blocked_s": statistics.median(m.get("checkpoint_seconds", 0.0) for m in its),
                "save_s": statistics.median(c["seconds"] for c in saves) if saves else None,
                "checkpoint_bytes": saves[0]["bytes"] if saves else None,
            }
            if saves:
                r["plain_write_s"] = plain_write_seconds(root, saves[0]["bytes"])
                r["save_gb_per_s"] = r["checkpoint_bytes"] / r["save_s"] / 1e9
                r["plain_write_gb_per_s"] = r["checkpoint_bytes"] / r["plain_write_s"] / 1e9
            results[mode] = r
            print(f"[{mode}] median iteration {r['iteration_s']:.3f} s, blocked {r['blocked_s']:.3f} s", flush=True)
    finally:
        ray.shutdown()
    baseline = results.get("none", {}).get("iteration_s")
    for r in results.values():
        r["lengthening_s"] = r["iteration_s"] - baseline if baseline else None
        r["lengthening_pct"] = 100 * r["lengthening_s"] / baseline if baseline else None

    rows = [
        "| mode | median iteration (s) | lengthening vs none | blocked per iteration (s) | save start to commit (s) "
        "| checkpoint (MiB) | save GB/s | plain write GB/s (ceiling) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in results.items():

        def f(key, fmt):
            return format(r[key], fmt) if r.get(key) is not None else "-"

        lengthening = (
            f"{r['lengthening_s']:+.3f} s ({r['lengthening_pct']:+.1f}%)" if r["lengthening_s"] is not None else "-"
        )
        mib = f"{r['checkpoint_bytes'] / 2**20:.1f}" if r.get("checkpoint_bytes") else "-"
        rows.append(
            f"| {mode} | {r['iteration_s']:.3f} | {lengthening} | {r['blocked_s']:.3f} | {f('save_s', '.3f')} "
            f"| {mib} | {f('save_gb_per_s', '.2f')} | {f('plain_write_gb_per_s', '.2f')} |"
        )
    table = "\n".join(rows)
    print(table)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        cfg = load_config("cpu_tiny", base)
        record = {
            "command": " ".join(
                [
                    "python scripts/measure_checkpoint_ppo.py",
                    *(f"--set {s}" for s in args.set),
                    f"--iterations {args.iterations}",
                ]
            ),
            "policy": cfg.policy.model_dump(),
            "ppo": cfg.ppo.model_dump(),
            "warmup": args.warmup,
            "versions": _versions(),
            "cpus": os.cpu_count(),
            "machine": platform.processor(),
            "results": results,
        }
        out.with_suffix(".json").write_text(json.dumps(record, indent=1))
        plot(results, out.with_suffix(".png"), args.iterations - args.warmup)
        out.with_suffix(".md").write_text(
            f"# Run checkpoints against PPO iteration time\n\n`{record['command']}` on {os.cpu_count()} CPUs "
            f"(versions: {json.dumps(record['versions'])}).\nPolicy and critic: {', '.join(MODEL)}; "
            f"{cfg.ppo.prompts_per_iteration} prompts x {cfg.ppo.response_length} tokens per iteration; "
            f"medians over iterations {args.warmup + 1}..{args.iterations}.\n\n{table}\n\n"
            f"![where the time goes]({out.with_suffix('.png').name})\n"
        )
        print(f"wrote {out.with_suffix('.json')}, {out.with_suffix('.md')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
