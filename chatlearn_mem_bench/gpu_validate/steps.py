"""The validation's steps: their order, which run by default, their time budgets, and for each the
command, the files it writes and how its results are read (from the step's own module:
:mod:`.benches` for ``tms``, ``large``, ``bench``; :mod:`.device_report` for ``report``;
:mod:`.gpu_tests` for ``handoff``, ``tests``; :mod:`.ppo` for ``ppo``)."""

from __future__ import annotations

import re
from pathlib import Path

from chatlearn_mem_bench.gpu_validate import benches, device_report, gpu_tests, ppo
from chatlearn_mem_bench.gpu_validate.benches import BENCH_STEPS

__all__ = [
    "BUDGET_S",
    "DEFAULT_STEPS",
    "MIN_STEP_S",
    "OPTIONAL",
    "STEPS",
    "TOTAL_BUDGET_S",
    "collect",
    "gpu_slug",
    "plan",
]

STEPS = ("tms", "report", "handoff", "large", "tests", "bench", "ppo")
"""Every step, in the order they run (``--steps`` picks some; the order stays this one)."""
DEFAULT_STEPS = ("tms", "report", "handoff", "large", "tests")
"""What runs without ``--steps``: the figures issue 52 asks for first (the manager against
torch_memory_saver, what stays on the device by NVML, another process taking the memory, the
largest trainer one GPU holds), then the GPU test tier. ``bench`` (the ``gpu`` preset with every
alternative and the overlap rows, 270 s) and ``ppo`` ran on earlier machines: ``--steps bench,ppo``."""
OPTIONAL = ("ppo",)
"""Steps whose outcome does not change the exit status (run last, when their budget is left)."""
BUDGET_S = {"tms": 165, "report": 45, "handoff": 70, "large": 180, "tests": 100, "bench": 270, "ppo": 160}
"""Seconds each step may run; a step that ends early leaves the rest to the next one. The default
steps add up to :data:`TOTAL_BUDGET_S`."""
TOTAL_BUDGET_S = 560
"""What the steps may take together: one device call runs at most 600 s, and installing the
wheelhouse (3 s on an H200 machine), starting Python and writing the summary need the rest. On the
H200 the tests took 79 s, the report 22 s, the bench 259 s (206 s measured inside it; importing,
building and exiting the rest) and the PPO step's actors 66 s to start before its 3 iterations."""
MIN_STEP_S = 20
"""A step with less than this left of the budget is skipped, not started."""


def gpu_slug(name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``gpu-nvidia-h100-80gb-hbm3`` (the benchmark's own naming)."""
    return "gpu-" + re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-")


def plan(out: Path, stem: str, steps: list[str], work: Path, revision: str) -> list[dict]:
    """The steps to run, in order: name, command, time budget and the files each writes."""
    commands = {
        "report": device_report.command(work),
        "handoff": gpu_tests.handoff_command(work),
        "tests": gpu_tests.tests_command(work),
        "ppo": ppo.command(out, stem),
        **{step: benches.command(step, out, stem, revision) for step in BENCH_STEPS},
    }
    outputs = {
        "report": device_report.outputs(work),
        "handoff": [work / "handoff.json"],
        "tests": [],
        "ppo": ppo.outputs(out, stem),
        **{step: benches.outputs(step, out, stem) for step in BENCH_STEPS},
    }
    env = {"handoff": {gpu_tests.HANDOFF_JSON_ENV: str(work / "handoff.json")}}
    return [
        {
            "step": s,
            "command": commands[s],
            "budget_s": BUDGET_S[s],
            "optional": s in OPTIONAL,
            "log": str(work / f"{s}.log"),
            "outputs": [str(p) for p in outputs[s]],
            "env": env.get(s, {}),
        }
        for s in STEPS
        if s in steps
    ]


def collect(step: str, results: dict, work: Path, entry: dict) -> None:
    """Read what a finished step wrote (in ``work`` and its ``outputs``) into ``results``, and set
    the step's detail (and its status, where a test failed or a cut-off bench had finished)."""
    if step == "tests":
        gpu_tests.collect_tests(results, work, entry)
    elif step == "handoff":
        gpu_tests.collect_handoff(results, work, entry)
    elif step == "report":
        device_report.collect(results, work, entry)
    elif step in BENCH_STEPS:
        benches.collect(step, results, entry)
    elif step == "ppo":
        ppo.collect(results, entry)
