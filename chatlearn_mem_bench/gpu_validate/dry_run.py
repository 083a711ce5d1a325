"""The dry run: everything up to the first CUDA call, anywhere (CI runs it). The wheelhouse, the
source revision, the configs (the bench presets; PPO's through its command line), each bench
step's plan against its bounds, every module the GPU run imports (in a process of its own), the GPU
tier collected; then the plan of steps, commands and files, and one line saying it stopped."""

from __future__ import annotations

import datetime as _dt
import json
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

from chatlearn_mem_bench.gpu_validate import checkout, ppo
from chatlearn_mem_bench.gpu_validate.benches import BENCH_STEPS
from chatlearn_mem_bench.gpu_validate.bounds import check_bounds
from chatlearn_mem_bench.gpu_validate.run import say
from chatlearn_mem_bench.gpu_validate.steps import plan
from chatlearn_mem_bench.gpu_validate.wheelhouse import check_wheelhouse

__all__ = ["IMPORTS", "dry_run"]

IMPORTS = (
    "torch",
    "numpy",
    "yaml",
    "typer",
    "matplotlib",
    "psutil",
    "pytest",
    "pydantic",
    "megatron.core",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "chatlearn_mem",
    "chatlearn_mem.models.gpt",
    "chatlearn_mem.process_memory",
    "chatlearn_mem_bench.run",
    "chatlearn_mem_bench.report",
    "chatlearn_mem_bench.tms",
    "chatlearn_mem_bench.tms_worker",
    "chatlearn_mem_cli.app",
    "chatlearn_mem_ray.job.run",
    "ray",
)
"""Every module the GPU run imports (Ray for the PPO step only), by name: the steps import them in
processes of their own, and so does the check."""

_IMPORT_SCRIPT = r"""
import importlib, json, sys, warnings
problems = []
for name in sys.argv[1:]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # megatron's notices about apex and TE
            importlib.import_module(name)
    except Exception as e:
        problems.append(f"import {name}: {type(e).__name__}: {e}")
print("IMPORT-JSON " + json.dumps(problems), flush=True)
"""


def _import_all(steps: list[str]) -> tuple[int, list[str]]:
    """Import :data:`IMPORTS` in a fresh process, as the steps will; returns how many were checked
    and the problems (one line each)."""
    names = [n for n in IMPORTS if n != "ray" or "ppo" in steps]
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_SCRIPT, *names], cwd=checkout.REPO, capture_output=True, text=True, timeout=300
    )
    found = [line[len("IMPORT-JSON ") :] for line in out.stdout.splitlines() if line.startswith("IMPORT-JSON ")]
    if not found:
        return len(names), [f"importing the GPU run's modules failed (exit {out.returncode}): {out.stderr[-1500:]}"]
    return len(names), json.loads(found[-1])


def _collect_gpu_tier() -> tuple[int, str]:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/gpu"],
        cwd=checkout.REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    n = sum(1 for line in out.stdout.splitlines() if "::" in line)
    return (n if out.returncode == 0 else -1), out.stdout[-2000:] + out.stderr[-2000:]


def _check_wheelhouse(wheelhouse: str | None) -> list[str]:
    if not wheelhouse:
        say("wheelhouse: not checked (no --wheelhouse)")
        return []
    problems = check_wheelhouse(Path(wheelhouse))
    if not problems:
        size = sum(p.stat().st_size for p in Path(wheelhouse).iterdir())
        say(f"wheelhouse {wheelhouse}: complete, {size / 2**20:.1f} MiB")
    return [f"wheelhouse {wheelhouse}: {p}" for p in problems]


def _check_configs(steps: list[str], budget_s: float) -> list[str]:
    """The bench presets and the PPO config, resolved and printed; the bounds checked."""
    from chatlearn_mem_bench.config import load_config

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            benches = {step: load_config(preset).model_dump(mode="json") for step, preset in BENCH_STEPS.items()}
            p = ppo.ppo_config()
        for step, preset in BENCH_STEPS.items():
            b = benches[step]
            say(
                f"{step} config: preset {preset}: {b['trainer']['num_layers']} layers x "
                f"{b['trainer']['hidden_size']}, vocab {b['trainer']['vocab_size']}, repeats {b['repeats']}, "
                f"cycles {b['cycles']}, methods {', '.join(b['methods']) or 'none'}, "
                f"release bound {'on' if b['release_bound'] else 'off'}"
            )
        say(
            f"ppo config: preset {ppo.PRESET} + {' '.join(ppo.PPO_OVERRIDES)}: {p['parallel']['world_size']} rank(s), "
            f"{p['ppo']['iterations']} iterations, policy {p['policy']['num_layers']} layers x "
            f"{p['policy']['hidden_size']}"
        )
        lines, problems = check_bounds(steps, budget_s)
        for line in lines:
            say(line)
        return problems
    except Exception as e:  # noqa: BLE001 - a ConfigError or an import problem, reported
        return [f"config: {type(e).__name__}: {e}"]


def _say_plan(out: Path, steps: list[str], budget_s: float, revision: str) -> None:
    stem = f"{_dt.date.today().isoformat()}_gpu-<gpu name>"
    work = out / f"{stem}_validation"
    say(f"plan ({len(steps)} steps, time budget {budget_s:.0f} s; outputs under {out}):")
    for entry in plan(out, stem, steps, work, revision):
        env = " ".join(f"{k}={v}" for k, v in entry["env"].items())
        say(
            f"  {entry['step']} (budget {entry['budget_s']} s{', optional' if entry['optional'] else ''}): "
            f"{env + ' ' if env else ''}{shlex.join(entry['command'])}"
        )
        for o in [entry["log"], *entry["outputs"]]:
            say(f"      writes {o}")
    for x in ("json", "md", "png"):
        say(f"  then writes {out / f'{stem}_validation.{x}'}")


def dry_run(args, steps: list[str]) -> int:
    """Everything up to the first CUDA call; 0 when nothing is wrong, else 2 with every problem."""
    say(
        f"dry run: Python {sys.version.split()[0]} ({'3.12 like' if sys.version_info[:2] == (3, 12) else 'not'} "
        "the GPU machine's)"
    )
    problems = _check_wheelhouse(args.wheelhouse)
    revision, source = checkout.source_revision(args.revision, args.wheelhouse)
    if revision:
        say(f"revision: {revision} (from {source})")
    else:
        problems.append(
            "no source revision: pass --revision, run from a git checkout, or fill the wheelhouse with "
            "scripts/gpu_wheelhouse.sh (it writes .whl/REVISION)"
        )
    problems += _check_configs(steps, args.budget_s)
    checked, failed = _import_all(steps)
    problems += failed
    say(f"imports: {checked} modules checked")
    if "tests" in steps or "handoff" in steps:
        n, text = _collect_gpu_tier()
        if n < 0:
            problems.append(f"collecting tests/gpu failed:\n{text}")
        else:
            say(f"tests/gpu: {n} tests collected")
    _say_plan(Path(args.out), steps, args.budget_s, revision or "<revision>")
    if problems:
        for p in problems:
            say(f"error: {p}")
        say(f"dry run failed: {len(problems)} problem(s)")
        return 2
    say("dry run ok: stopping before the first CUDA call (torch.cuda.is_available() comes next)")
    return 0
