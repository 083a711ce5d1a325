"""GRPO's loss and sampling options on ``cpu_grpo`` (issue 58), run as a user runs them
(``chatlearn-mem grpo --config cpu_grpo <option>``), each its own process and local Ray cluster, one
after the other; and ``cpu_grpo_text`` with its validation and an export every 10 iterations, whose
own log gives what validating and exporting cost. Writes OUT.json and OUT.md (each option's reward,
first 5 -> last 5 iterations, and per iteration; validation and export seconds; the machine).

    python scripts/grpo_options_curve.py --out benchmarks/results/2026-11-29_grpo_options_cpu
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

OPTIONS = {
    "default (grpo, seq_mean_token_mean, ppo_clip)": [],
    "loss_agg=token_mean": ["grpo.loss_agg=token_mean"],
    "loss_agg=seq_mean_token_sum_norm": ["grpo.loss_agg=seq_mean_token_sum_norm"],
    "policy_loss=gspo": ["grpo.policy_loss=gspo"],
    "clip_ratio_c=3": ["grpo.clip_ratio_c=3"],
    "estimator=rloo": ["grpo.estimator=rloo"],
    "estimator=reinforce_pp": ["grpo.estimator=reinforce_pp"],
    "variant=dr_grpo": ["grpo.variant=dr_grpo"],
    "dynamic_sampling": ["grpo.dynamic_sampling=true"],
}


def run(preset: str, overrides: list[str]) -> dict:
    out = Path(tempfile.mkdtemp(prefix="grpo_options_"))
    cmd = [sys.executable, "-m", "chatlearn_mem_cli", "grpo", "--config", preset, f"output_dir={out}", *overrides]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    log = json.loads((out / "log.json").read_text())
    its = [m for m in log["iterations"] if m["manager_on"]]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {
        "command": f"chatlearn-mem grpo --config {preset} " + " ".join(overrides),
        "wall_seconds": wall,
        "reward": [m["reward"] for m in its],
        "first5": mean([m["reward"] for m in its[:5]]),
        "last5": mean([m["reward"] for m in its[-5:]]),
        "iteration_seconds": mean([m["seconds"] for m in its]),
        "sampling_rounds": [m.get("sampling_rounds") for m in its],
        "dropped_groups": [m.get("dropped_groups") for m in its],
        "filled_groups": [m.get("filled_groups") for m in its],
        "clip_fraction": [m["clip_fraction"] for m in its],
        "validations": log.get("validations", []),
        "validate_seconds": {
            m["iteration"]: m["phase_seconds"]["validate"] for m in its if "validate" in m["phase_seconds"]
        },
        "exports": log.get("exports", []),
        "versions": log["versions"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="results path without suffix")
    parser.add_argument("--only", nargs="*", help="option names to run (default: all)")
    args = parser.parse_args()
    results = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "date": time.strftime("%Y-%m-%d")}
    common = ["memory.compare_iterations=0"]
    results["options"] = {
        name: run("cpu_grpo", [*common, *extra])
        for name, extra in OPTIONS.items()
        if not args.only or name in args.only
    }
    text = run("cpu_grpo_text", [*common, "export.hf_every=10"])
    results["cpu_grpo_text"] = text
    Path(f"{args.out}.json").write_text(json.dumps(results, indent=1))
    lines = [
        "# GRPO's options on cpu_grpo, and what validation and export cost on cpu_grpo_text",
        "",
        f"{results['date']}, {results['machine']}; `python scripts/grpo_options_curve.py --out {args.out}`; "
        "each run its own process and local Ray cluster, one after the other. cpu_grpo: 20 iterations of 8 prompts x "
        "4 responses, the toy task (reward: share of response tokens in range).",
        "",
        "| option | reward, first 5 -> last 5 iterations | seconds per iteration | command |",
        "|---|---|---|---|",
    ]
    for name, r in results["options"].items():
        lines.append(
            f"| {name} | {r['first5']:.3f} -> {r['last5']:.3f} | {r['iteration_seconds']:.2f} | `{r['command']}` |"
        )
    iters = len(text["reward"])
    vals = ", ".join(f"{v['iteration']}: {v['val/reward']:.3f}" for v in text["validations"])
    val_s = list(text["validate_seconds"].values())
    exp_s = [e["seconds"] for e in text["exports"]]
    lines += [
        "",
        f"cpu_grpo_text ({iters} iterations, `{text['command']}`): reward {text['first5']:.3f} -> {text['last5']:.3f}; "
        f"val/reward by iteration {vals}.",
        "",
        f"- validation (16 held-out prompts, greedy, in the validate phase): {len(val_s)} runs, "
        f"{min(val_s):.2f}-{max(val_s):.2f} s each (the first one, before training, includes the first weight "
        f"sync), {sum(val_s) / iters:.3f} s per iteration on average; an iteration takes {text['iteration_seconds']:.2f} s",
        f"- export ({text['exports'][-1]['bytes'] / 2**20:.1f} MiB, {text['exports'][-1]['files']} file): "
        f"{len(exp_s)} exports, {min(exp_s):.3f}-{max(exp_s):.3f} s each, {sum(exp_s) / iters:.4f} s per iteration",
    ]
    Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
