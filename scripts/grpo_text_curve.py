"""The learning curve of the ``cpu_grpo_text`` preset: a tiny Llama learning to copy strings by GRPO,
from scratch, run as a user runs it (``chatlearn-mem grpo --config cpu_grpo_text``), for a few seeds
and with each rollout engine; writes OUT.json, OUT.md and OUT.png (reward and exact match per
iteration, minutes, the machine).

    python scripts/grpo_text_curve.py --out benchmarks/results/2026-11-28_grpo_text_cpu \\
        --seeds 0 1 2 --vllm-python .venvllm/bin/python

Each run is its own process (its own local Ray cluster); runs go one after the other.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(python: str, seed: int, engine: str, iterations: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"grpo_text_{engine}_{seed}_"))
    cmd = [
        python,
        "-m",
        "chatlearn_mem_cli",
        "grpo",
        "--config",
        "cpu_grpo_text",
        f"output_dir={out}",
        f"grpo.seed={seed}",
        f"policy.seed={1234 + seed}",
        f"rollout.engine={engine}",
        f"grpo.iterations={iterations}",
        "memory.compare_iterations=0",
    ]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    log = json.loads((out / "log.json").read_text())
    its = log["iterations"]
    return {
        "command": "chatlearn-mem grpo --config cpu_grpo_text " + " ".join(cmd[6:]),
        "seed": seed,
        "engine": engine,
        "wall_seconds": wall,
        "loop_seconds": log["summary"]["seconds"],
        "reward": [m["reward"] for m in its],
        "exact": [m.get("reward_exact", 0.0) for m in its],
        "response_tokens": [m["response_tokens"] for m in its],
        "reward_seconds": sum(m["reward_seconds"] for m in its),
        "iteration_seconds": sum(m["seconds"] for m in its),
        "samples_last": its[-1]["samples"],
        "colocation": log["summary"]["memory_manager_on"],
        "versions": log["versions"],
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def report(runs: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in runs:
        label = f"seed {r['seed']}, {r['engine']} rollout"
        style = "-" if r["engine"] == "megatron" else "--"
        a.plot(range(1, len(r["reward"]) + 1), r["reward"], style, label=label, alpha=0.85)
        b.plot(range(1, len(r["exact"]) + 1), r["exact"], style, label=label, alpha=0.85)
    a.set(
        title="(1) mean reward per iteration",
        xlabel="iteration",
        ylabel="reward (share right, less 0.25 per extra char)",
    )
    b.set(title="(2) responses that are exactly the answer", xlabel="iteration", ylabel="exact match")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("GRPO from scratch on cpu_grpo_text: copy a 1-3 letter string (2 CPU cores)")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)
    plt.close(fig)
    rows = [
        "| seed | rollout | reward, first 5 -> last 5 iterations | exact match, first 5 -> last 5 | minutes (wall) | reward's share of the iterations |",
        "|---|---|---|---|---|---|",
    ]
    for r in runs:
        rows.append(
            f"| {r['seed']} | {r['engine']} | {_mean(r['reward'][:5]):.2f} -> {_mean(r['reward'][-5:]):.2f} | "
            f"{_mean(r['exact'][:5]):.2f} -> {_mean(r['exact'][-5:]):.2f} | {r['wall_seconds'] / 60:.1f} | "
            f"{100 * r['reward_seconds'] / r['iteration_seconds']:.2f}% |"
        )
    head = runs[0]["versions"]
    text = (
        f"# GRPO on text on CPU: the cpu_grpo_text learning curve\n\n"
        f"Machine: {_cpu_model()} ({os.cpu_count()} cores), Python {head['python']}, torch {head['torch']}, "
        f"megatron-core {head['megatron-core']}. Each run: `{runs[0]['command']}` with its seed and engine.\n\n"
        + "\n".join(rows)
        + "\n\n![learning curve]("
        + out.with_suffix(".png").name
        + ")\n"
    )
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"runs": runs}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="OUT.json, OUT.md and OUT.png are written")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--iterations", type=int, default=100)
    ap.add_argument("--vllm-python", default=None, help="a Python with vLLM: one more run of seed 0 with it")
    ap.add_argument("--report-only", action="store_true", help="redraw OUT.md and OUT.png from OUT.json")
    args = ap.parse_args()
    if args.report_only:
        out = Path(args.out)
        report(json.loads(out.with_suffix(".json").read_text())["runs"], out)
        return
    runs = []
    for seed in args.seeds:
        print(f"seed {seed}, megatron rollout ...", flush=True)
        runs.append(run(sys.executable, seed, "megatron", args.iterations))
    if args.vllm_python:
        print("seed 0, vLLM rollout ...", flush=True)
        runs.append(run(args.vllm_python, args.seeds[0], "vllm", args.iterations))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report(runs, out)
    print(f"wrote {out}.json, .md and .png")


if __name__ == "__main__":
    main()
