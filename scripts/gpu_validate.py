#!/usr/bin/env python3
"""Validate chatlearn-mem on one GPU in one command: the manager against torch_memory_saver, what
stays on the device after a full offload (by NVML), another process taking the memory a sleeping
trainer gave back, the largest trainer one GPU holds, the GPU test tier; results named after the GPU.

On the GPU machine (everything it lacks is carried as wheels, see scripts/gpu_wheelhouse.sh)::

    bash scripts/gpu_validate.sh --out "$OUT"          # installs .whl/ into /tmp/site, runs this

Anywhere, without a GPU (CI runs this; it needs the [test] install)::

    python scripts/gpu_validate.py --dry-run --wheelhouse .whl

The dry run does everything up to the first CUDA call: checks the wheelhouse (every package the GPU
machine lacks, one version each, built for CPython 3.12 on x86-64 Linux, within the 64 MiB a
device call may carry, and the source revision it was built from), resolves the benchmark presets
and the PPO config, plans each bench step's host and device memory and estimates its time from the
config alone (and fails when one exceeds its bound: :data:`HOST_BOUND_BYTES`, :data:`DEVICE_SHARE`
of :data:`GPU_DEVICE_BYTES`, :data:`ESTIMATE_SHARE` of the step's budget), imports every module the
GPU run imports, collects the GPU tier, and prints the plan (steps, commands, time budgets, output
files). Then it stops with one line saying so.

Steps (:data:`STEPS`; without ``--steps`` the :data:`DEFAULT_STEPS`, most important first), each a
fresh process in its own process group, so one crash or CUDA error cannot take the others with it;
each within its time budget (:data:`BUDGET_S`; the default steps add up to :data:`TOTAL_BUDGET_S`
= 560 s of the 600 s one device call may run, the rest for installing the wheelhouse and writing
the summary; a step that ends early leaves its unused seconds to the next):

1. ``tms``     ``chatlearn-mem bench --config gpu_tms``: the manager against torch_memory_saver (as
   slime runs it, in a worker process) and megatron-core's own offload, per part, in one run.
2. ``report``  what stays on the device after a full offload of the PPO preset's policy trainer
   (about 0.35 B parameters), by the allocator and by NVML: the CUDA context, NCCL's communicator,
   cuBLAS workspaces, the allocator's cache, with and without the release of idle memory, its cost
   to the next step, the target (context + 1% of the awake state), and a NCCL communicator's
   bytes, destroy and re-create times (in a process of its own).
3. ``handoff`` ``pytest tests/gpu/test_gpu_handoff.py``: another process allocates what the
   sleeping trainer gave back; a trainer that cannot wake fails cleanly and wakes later, exact.
4. ``large``   ``chatlearn-mem bench --config gpu_large``: a 2.3 B-parameter trainer, full sleep and
   wake against the ceiling.
5. ``tests``   ``pytest tests/gpu`` but the handoff and torch_memory_saver files (exactness with NCCL,
   policy + critic sharing the GPU, allocated and reserved bytes after offload with and without
   expandable segments, pinned host store, device OOM during onload, TE layer spec when TE imports,
   the device report and the release of idle memory).
6. ``bench``   not by default: ``chatlearn-mem bench --config gpu`` (every alternative, the overlap
   rows; 270 s).
7. ``ppo``     not by default, optional, last: ``chatlearn-mem ppo --config gpu`` scaled to one GPU.
   Its outcome is reported but does not change the exit status.

Everything is written under ``--out`` as it happens: each step's output streams into
``<stem>_validation/<step>.log`` (with the junit files, ``report.json`` and ``handoff.json``), the
summary is rewritten after every step, each benchmark rewrites its JSON after every part and the
PPO run its log after every iteration; a step cut off by its budget keeps what it wrote, and a
benchmark's markdown and plot are rebuilt from its partial JSON.

Outputs (``--out``, default ``benchmarks/results``; ``<stem>`` = ``<date>_gpu-<gpu name>``):
``<stem>_validation.{json,md,png}`` (every step's status, the test outcomes, the device reports,
the manager against its peers, the handoff's figures, the targets), ``<stem>_validation/`` (the
step logs), ``<stem>_tms.{json,md,png}`` and ``<stem>_large.{json,md,png}`` (the benchmarks' own
files; ``<stem>.{json,md,png}`` for ``bench``) and ``<stem>_ppo/{log.json,memory_timeline.png}``.

The source revision is recorded in every result: ``--revision``, else ``git rev-parse HEAD`` of this
checkout, else the ``REVISION`` file ``scripts/gpu_wheelhouse.sh`` writes into the wheelhouse (the
copy on the GPU machine has no ``.git``); a run without one stops before it starts.

Exit status: 0 when every required step ran and every GPU test passed or was skipped; 1 otherwise;
2 for a setup problem (no CUDA without --dry-run, a wheelhouse that is incomplete, no revision).
Benchmark and report targets are data, not failures.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # trainer_runs, for the report step

MEGATRON_VERSION = "0.19.2"
"""The megatron-core the GPU machine runs (Python 3.12 there)."""
WHEELS = (
    "megatron_core",
    "pydantic",
    "pydantic_core",
    "annotated_types",
    "typing_inspection",
    "jsonschema",
    "jsonschema_specifications",
    "referencing",
    "rpds_py",
    "torch_memory_saver",
    "nvidia_ml_py",
    "chatlearn_mem",
)
"""Distributions the GPU machine lacks, carried as wheels (it has torch, numpy, typer, PyYAML,
matplotlib, psutil, pytest and Ray's other requirements). torch_memory_saver (one abi3 wheel with
CUDA 12 and 13 builds, 2.6 MB) for the ``tms`` step's peer; nvidia-ml-py (``pynvml``, 58 kB) for the
device report's per-process view."""
RAY_ARCHIVE = re.compile(r"^ray-[0-9.]+-cp312-pruned\.tar\.xz$")
"""Ray's cp312 wheel is 79 MB, over what one device call carries: scripts/gpu_wheelhouse.sh repacks
it without Java, RLlib, Data, Serve, Train, Tune, LLM and the dashboard's web client (28 MB)."""
CARRY_LIMIT = 64 * 2**20
WHEELHOUSE_LIMIT = 60 * 2**20  # the rest of the 64 MiB is the repository itself

PPO_OVERRIDES = (
    "parallel.world_size=1",
    "parallel.tensor_model_parallel_size=1",
    "ppo.iterations=2",
    "ppo.prompts_per_iteration=64",
    "ppo.prompt_length=64",
    "ppo.response_length=64",
    "ppo.minibatch_size=16",
    "memory.compare_iterations=1",
    "memory.verify_sync=true",
    "ray.cpus_per_rank=4",
)
"""configs/ppo/gpu.yaml (8 ranks, TP=2) scaled to one GPU and its step's budget."""
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
BENCH_STEPS = {"tms": "gpu_tms", "large": "gpu_large", "bench": "gpu"}
"""Steps that run ``chatlearn-mem bench``, and their presets (configs/bench/)."""
HANDOFF_TEST = "tests/gpu/test_gpu_handoff.py"
TMS_TEST = "tests/gpu/test_gpu_tms.py"
"""GPU tests the ``tests`` step leaves to the steps that cover them (``handoff``, ``tms``)."""
MIN_STEP_S = 20
"""A step with less than this left of the budget is skipped, not started."""
ESTIMATE_SHARE = 0.9
"""The benchmark's estimate may use at most this share of its step's budget."""
GPU_HOST_BYTES = 128 * 2**30
"""Host memory of the GPU machine."""
HOST_BOUND_BYTES = GPU_HOST_BYTES // 2
"""The benchmark's planned host memory peak (pinned + pageable) must stay under this: half the
machine, leaving the rest to the process itself, the CUDA driver, the page cache and the other steps."""
GPU_DEVICE_BYTES = 81559 * 2**20
"""Memory of the smallest GPU the validation is sized for (an H100 80GB HBM3, as CUDA reports it)."""
DEVICE_SHARE = 0.9
"""A benchmark's planned device peak may use at most this share of :data:`GPU_DEVICE_BYTES` (the
rest: CUDA contexts, NCCL, cuBLAS workspaces, the allocator's rounding and fragmentation)."""


def _say(line: str) -> None:
    print(f"[gpu-validate] {line}", flush=True)


# -- the wheelhouse ---------------------------------------------------------------------------------
def _dist_name(filename: str) -> str:
    return filename.split("-")[0].lower().replace(".", "_")


def check_wheelhouse(path: Path) -> list[str]:
    """Problems with the wheelhouse at ``path`` (empty: complete and small enough)."""
    if not path.is_dir():
        return [f"{path} does not exist: run `bash scripts/gpu_wheelhouse.sh` to fill it"]
    problems = []
    files = sorted(p.name for p in path.iterdir() if p.is_file())
    wheels = [f for f in files if f.endswith(".whl")]
    by_dist: dict[str, list[str]] = {}
    for w in wheels:
        by_dist.setdefault(_dist_name(w), []).append(w)
    for dist in WHEELS:
        found = by_dist.get(dist, [])
        if not found:
            problems.append(f"no wheel of {dist}")
        elif len(found) > 1:
            problems.append(f"{len(found)} wheels of {dist} ({', '.join(found)}): keep one, pip stops on two")
    for w in wheels:
        tags = w[:-4].split("-")[-3:]
        py, abi, plat = tags
        abi3 = abi == "abi3" and py.startswith("cp3") and py[3:].isdigit() and int(py[3:]) <= 12
        if not (py in ("py3", "py2.py3", "cp312") or py.startswith("cp312") or abi3):
            problems.append(f"{w} is not for CPython 3.12 (tag {py})")
        if plat != "any" and "x86_64" not in plat:  # abi3 wheels (cp39-abi3) serve 3.12 too
            problems.append(f"{w} is not for x86-64 Linux (platform {plat})")
    mc = by_dist.get("megatron_core", [])
    if len(mc) == 1 and f"-{MEGATRON_VERSION}-" not in mc[0]:
        problems.append(f"{mc[0]}: the GPU run uses megatron-core {MEGATRON_VERSION}")
    ours = by_dist.get("chatlearn_mem", [])
    if len(ours) == 1:
        version = _repo_version()
        if f"-{version}-" not in ours[0]:
            problems.append(f"{ours[0]} is not this checkout's version {version}: rebuild it")
        try:
            names = zipfile.ZipFile(path / ours[0]).namelist()
        except zipfile.BadZipFile:
            names = []
        needed = [f"chatlearn_mem_bench/presets/{preset}.yaml" for preset in BENCH_STEPS.values()]
        for needed in (*needed, "chatlearn_mem_ray/presets/gpu.yaml"):
            if needed not in names:
                problems.append(f"{ours[0]} lacks {needed}")
    rays = [f for f in files if RAY_ARCHIVE.match(f)]
    if len(rays) != 1:
        problems.append(f"want one ray-<version>-cp312-pruned.tar.xz, found {rays or 'none'}")
    built_from, here = wheelhouse_revision(path), _checkout_revision()
    if not built_from:
        problems.append(
            f"no {REVISION_FILE} file (the source revision the wheel was built from): run "
            "`bash scripts/gpu_wheelhouse.sh` again"
        )
    elif here and here.split("+")[0] != built_from.split("+")[0]:
        problems.append(
            f"built from {built_from}, but this checkout is at {here}: run `bash scripts/gpu_wheelhouse.sh` again"
        )
    unknown = [f for f in files if f not in wheels and f not in rays and f != REVISION_FILE]
    if unknown:
        problems.append(f"files that are neither wheels nor the Ray archive: {', '.join(unknown)}")
    total = sum((path / f).stat().st_size for f in files)
    if total > WHEELHOUSE_LIMIT:
        problems.append(
            f"{total / 2**20:.1f} MiB: more than {WHEELHOUSE_LIMIT / 2**20:.0f} MiB, which leaves too "
            f"little of the {CARRY_LIMIT / 2**20:.0f} MiB one device call carries for the repository"
        )
    return problems


def _repo_version() -> str:
    text = (REPO / "pyproject.toml").read_text()
    return re.search(r'^version = "([^"]+)"', text, re.M).group(1)


REVISION_FILE = "REVISION"
"""The wheelhouse's record of the source revision its chatlearn-mem wheel was built from."""


def wheelhouse_revision(path: Path) -> str | None:
    """The revision in ``path/REVISION`` (None when there is none)."""
    try:
        return (Path(path) / REVISION_FILE).read_text().strip() or None
    except OSError:
        return None


def _checkout_revision() -> str | None:
    from chatlearn_mem_bench.measure import git_revision

    return git_revision(REPO)


def source_revision(explicit: str | None, wheelhouse: str | None) -> tuple[str | None, str]:
    """The revision to record and where it came from: ``--revision``, else, with ``--wheelhouse``
    given (the library that runs is then the wheel's), its ``REVISION`` when this checkout's git is
    at another commit (a copy of the repository may carry a ``.git`` of an older commit, the newer
    changes dirty on it), else this checkout's git ``HEAD`` (``+dirty`` kept), else the
    wheelhouse's ``REVISION`` (a copy without ``.git``)."""
    if explicit:
        return explicit, "--revision"
    here = _checkout_revision()
    wh = Path(wheelhouse) if wheelhouse else REPO / ".whl"
    built_from = wheelhouse_revision(wh)
    if wheelhouse and here and built_from and here.split("+")[0] != built_from.split("+")[0]:
        return built_from, f"{wh / REVISION_FILE}, the wheel's; git in {REPO} says {here}"
    if here:
        return here, f"git in {REPO}"
    return (built_from, f"{wh / REVISION_FILE}") if built_from else (None, "")


# -- the plan ---------------------------------------------------------------------------------------
def gpu_slug(name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``gpu-nvidia-h100-80gb-hbm3`` (the benchmark's own naming)."""
    return "gpu-" + re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-")


def bench_stem(stem: str, step: str) -> str:
    """The file stem of a bench step's results: ``<stem>`` for ``bench`` (as every earlier run),
    ``<stem>_<step>`` for the others."""
    return stem if step == "bench" else f"{stem}_{step}"


def plan(out: Path, stem: str, steps: list[str], work: Path, revision: str) -> list[dict]:
    """The steps to run, in order: name, command, time budget and the files each writes."""
    py = sys.executable

    def pytest(*paths: str, junit: str) -> list[str]:
        return [
            py,
            "-m",
            "pytest",
            *paths,
            "-v",
            "-rA",
            "-p",
            "no:cacheprovider",
            # a test still running after 60 s prints every thread's stack into the log (and goes on)
            "-o",
            "faulthandler_timeout=60",
            "--durations=0",
            f"--junitxml={work / junit}",
        ]

    def bench(step: str) -> list[str]:
        return [
            py,
            "-m",
            "chatlearn_mem_cli",
            "bench",
            "--config",
            BENCH_STEPS[step],
            f"output_dir={out}",
            f"name={bench_stem(stem, step)}",
            f"revision={revision}",
            "-q",
        ]

    cmds = {
        "tms": bench("tms"),
        "report": [py, str(Path(__file__).resolve()), "--report-json", str(work / "report.json")],
        "handoff": pytest(HANDOFF_TEST, junit="junit_handoff.xml"),
        "large": bench("large"),
        "tests": pytest("tests/gpu", f"--ignore={HANDOFF_TEST}", f"--ignore={TMS_TEST}", junit="junit.xml"),
        "bench": bench("bench"),
        "ppo": [
            py,
            "-m",
            "chatlearn_mem_cli",
            "ppo",
            "--config",
            "gpu",
            *PPO_OVERRIDES,
            f"output_dir={out / (stem + '_ppo')}",
        ],
    }
    outputs = {
        "tests": [],
        "report": [work / "report.json"],
        "handoff": [work / "handoff.json"],
        "ppo": [out / f"{stem}_ppo" / "log.json", out / f"{stem}_ppo" / "memory_timeline.png"],
        **{step: [out / f"{bench_stem(stem, step)}.{x}" for x in ("json", "md", "png")] for step in BENCH_STEPS},
    }
    env = {"handoff": {"CHATLEARN_MEM_HANDOFF_JSON": str(work / "handoff.json")}}
    return [
        {
            "step": s,
            "command": cmds[s],
            "budget_s": BUDGET_S[s],
            "optional": s in OPTIONAL,
            "log": str(work / f"{s}.log"),
            "outputs": [str(p) for p in outputs[s]],
            "env": env.get(s, {}),
        }
        for s in STEPS
        if s in steps
    ]


def _resolve_configs() -> dict:
    """The benchmark presets and the PPO config the GPU run uses, validated (raises ConfigError)."""
    from chatlearn_mem_bench.config import load_config as bench_config
    from chatlearn_mem_ray import load_config as ppo_config

    benches = {step: bench_config(preset).model_dump(mode="json") for step, preset in BENCH_STEPS.items()}
    ppo = ppo_config("gpu", list(PPO_OVERRIDES))
    return {"bench": benches["bench"], "benches": benches, "ppo": json.loads(ppo.model_dump_json())}


def bench_outlook(preset: str = "gpu"):
    """A bench preset's host memory plan, time estimate and device memory plan from its config
    (nothing built), as the GPU machine will run it: pinned buffers, megatron-core 0.19 (its own
    offload calls), torch_memory_saver installed (the wheelhouse carries it)."""
    from chatlearn_mem import MemoryConfig
    from chatlearn_mem_bench.config import load_config
    from chatlearn_mem_bench.estimate import estimate_seconds
    from chatlearn_mem_bench.overlap import plan_args as overlap_plan_args
    from chatlearn_mem_bench.plan import (
        activation_bytes,
        estimate_part_sizes,
        plan_device_memory,
        plan_host_memory,
    )

    cfg = load_config(preset)
    sizes = estimate_part_sizes(cfg.trainer)
    overlap = overlap_plan_args(cfg)
    host = plan_host_memory(
        sizes,
        methods=cfg.methods,
        cuda=True,
        pin=True,
        overlap_bytes=overlap.get("overlap_bytes"),
        bucket_size=MemoryConfig(bucket_size_mb=cfg.bucket_size_mb).bucket_size_bytes,
        release_bound=cfg.release_bound,
        tms_retain_cpu_backup=cfg.tms_retain_cpu_backup,
    )
    time_s = estimate_seconds(
        sizes,
        methods=cfg.methods,
        repeats=cfg.repeats,
        warmup=cfg.warmup,
        cycles=cfg.cycles,
        cuda=True,
        pin=True,
        release_bound=cfg.release_bound,
        **overlap,
    )
    device = plan_device_memory(
        sizes,
        methods=cfg.methods,
        release_bound=cfg.release_bound,
        activations=activation_bytes(cfg.trainer, cfg.batch_size),
    )
    return host, time_s, device


def check_bounds(steps: list[str], budget_s: float = TOTAL_BUDGET_S) -> tuple[list[str], list[str]]:
    """Lines to print and problems: the chosen steps' budgets add up to at most ``budget_s``, and
    for every bench step its estimate fits :data:`ESTIMATE_SHARE` of its budget, its host plan
    :data:`HOST_BOUND_BYTES` and its device plan :data:`DEVICE_SHARE` of :data:`GPU_DEVICE_BYTES`."""
    lines, problems = [], []
    total = sum(BUDGET_S[s] for s in steps)
    lines.append(
        f"time budget: {' + '.join(f'{s} {BUDGET_S[s]}' for s in steps)} = {total} s "
        f"(at most {budget_s:.0f} s); {', '.join(o for o in OPTIONAL if o in steps) or 'no step'} optional"
    )
    if total > budget_s:
        problems.append(f"the steps' budgets add up to {total} s, over {budget_s:.0f} s: run fewer steps per call")
    if sum(BUDGET_S[s] for s in DEFAULT_STEPS) > TOTAL_BUDGET_S:
        problems.append(f"the default steps' budgets add up to over {TOTAL_BUDGET_S} s")
    for step in (s for s in steps if s in BENCH_STEPS):
        preset = BENCH_STEPS[step]
        host, time_s, device = bench_outlook(preset)
        lines += [f"{step} ({preset}) {host.summary()}", f"{step} ({preset}) {time_s.summary()}"]
        lines.append(
            f"{step} ({preset}) device memory plan: peak {device['peak_bytes'] / 2**30:.1f} GiB (setup "
            f"{device['setup_bytes'] / 2**30:.1f} GiB, timing {device['timing_bytes'] / 2**30:.1f} GiB) of "
            f"{GPU_DEVICE_BYTES / 2**30:.1f} GiB: "
            + "; ".join(f"{what} {n / 2**30:.1f} GiB" for what, n in device["items"])
        )
        if host.peak_bytes > HOST_BOUND_BYTES:
            problems.append(
                f"the {step} step's bench plans {host.peak_bytes / 2**30:.1f} GiB of host memory, over its bound of "
                f"{HOST_BOUND_BYTES / 2**30:.0f} GiB (half the GPU machine's "
                f"{GPU_HOST_BYTES / 2**30:.0f} GiB): shrink configs/bench/{preset}.yaml"
            )
        if time_s.total_s > ESTIMATE_SHARE * BUDGET_S[step]:
            problems.append(
                f"the {step} step's bench is estimated at {time_s.total_s:.0f} s, over {ESTIMATE_SHARE:.0%} of its "
                f"{BUDGET_S[step]} s budget: shrink configs/bench/{preset}.yaml (trainer, repeats, cycles)"
            )
        if device["peak_bytes"] > DEVICE_SHARE * GPU_DEVICE_BYTES:
            problems.append(
                f"the {step} step's bench plans {device['peak_bytes'] / 2**30:.1f} GiB of device memory, over "
                f"{DEVICE_SHARE:.0%} of an H100's {GPU_DEVICE_BYTES / 2**30:.1f} GiB: shrink configs/bench/{preset}.yaml"
            )
    return lines, problems


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
"""Every module the GPU run imports (Ray for the PPO step only)."""


def _import_all(steps: list[str]) -> list[str]:
    import importlib
    import warnings

    problems = []
    for name in IMPORTS:
        if name == "ray" and "ppo" not in steps:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # megatron's notices about apex and TE
                importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - reported, not raised
            problems.append(f"import {name}: {type(e).__name__}: {e}")
    return problems


def _collect_gpu_tier() -> tuple[int, str]:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/gpu"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    n = sum(1 for line in out.stdout.splitlines() if "::" in line)
    return (n if out.returncode == 0 else -1), out.stdout[-2000:] + out.stderr[-2000:]


# -- the report step (runs in its own process) ------------------------------------------------------
SLEEP_SHARE = 0.01
"""Target: after a full offload the trainer process holds no more than its CUDA context plus this
share of its awake state, by NVML (issue 52)."""
NCCL_TIMEOUT_S = 20
"""Seconds the report step gives its NCCL measurement (a process of its own)."""


def _timed_step(trainer, batch) -> float:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    trainer.train_step(batch)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def sleep_target(context_bytes: int, awake_state_bytes: int, asleep: dict) -> dict:
    """Issue 52's target on one full offload's report (``DeviceReport.to_dict()``): the process holds
    at most its CUDA context plus :data:`SLEEP_SHARE` of its awake state; judged on NVML's figure
    for the process where there is one, else on the device's (which counts every process)."""
    bound = context_bytes + SLEEP_SHARE * awake_state_bytes
    held = asleep["total_bytes"]
    rest = sorted(((h, n) for h, n in asleep["by_holder"].items() if n and h != "cuda_context"), key=lambda x: -x[1])
    return {
        "name": f"after a full offload: the process holds <= its CUDA context + {SLEEP_SHARE:.0%} of its awake state",
        "passed": held <= bound,
        "per_process": asleep.get("per_process", False),
        "held_bytes": held,
        "bound_bytes": int(bound),
        "detail": f"{held / 2**20:.0f} MiB held by {'this process (NVML)' if asleep.get('per_process') else 'the device'}"
        f" against {bound / 2**20:.0f} MiB (context {context_bytes / 2**20:.0f} MiB + "
        f"{SLEEP_SHARE:.0%} of {awake_state_bytes / 2**30:.2f} GiB); besides the context: "
        + ", ".join(f"{h} {n / 2**20:.0f} MiB" for h, n in rest[:5]),
    }


def measure_device_report(cfg=None, batch_size: int = 4, nccl: bool = True) -> dict:
    """What stays on the device after a full offload of a trainer (the PPO gpu preset's policy by
    default), by the allocator and by NVML, with and without the release of idle memory; what that
    release costs the next training step; and (``nccl``) what a NCCL communicator holds and how fast
    one comes back (:func:`measure_nccl`, in a process of its own). Works on CPU too: the walk is
    then the whole report and the driver's figures say "not measured here: no CUDA".

    Sequence: CUDA starts (the context's bytes, nothing allocated yet); the trainer is built and
    trained one step; NCCL makes its communicator (the first collective: its bytes); awake report;
    offload keeping the idle memory (``release_idle_memory=False``) and its report; onload and a
    timed step; offload keeping it again, then the release (its bytes) and the asleep report;
    onload and a timed step (the release's cost is the difference); the default full offload (which
    releases) and its report, judged against :data:`SLEEP_SHARE`.
    """
    import warnings

    import torch

    from chatlearn_mem import TrainerMemoryManager, device_report
    from chatlearn_mem.models import gpt
    from chatlearn_mem.process_memory import NOT_MEASURED, process_memory, release_idle_memory

    cuda = torch.cuda.is_available()
    if cuda:  # the context alone: before megatron, NCCL or any allocation
        torch.cuda.init()
        torch.cuda.set_device(0)
        torch.cuda.synchronize()
    context = process_memory()
    if cfg is None:
        from chatlearn_mem_ray import load_config as ppo_config

        cfg = ppo_config("gpu", list(PPO_OVERRIDES)).policy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if not torch.distributed.is_initialized():
            import tempfile

            gpt.init_distributed(init_method=f"file://{tempfile.mkdtemp()}/init", cpu_backend=True)
        trainer = gpt.build_gpt_trainer(cfg)
        mm = TrainerMemoryManager(trainer.model, trainer.optimizer)
        trainer.train_step(gpt.synthetic_batch(cfg, 0, batch_size=batch_size))
    before_nccl = process_memory()
    probe = torch.ones(1, device=mm.device)
    torch.distributed.all_reduce(probe)  # NCCL creates its communicator on the first collective
    del probe
    after_nccl = process_memory()
    measured = {}
    if cuda:
        measured["cuda_context"] = context.used
        measured["nccl_communicators"] = max(0, after_nccl.outside_allocator - before_nccl.outside_allocator)

    def report(**extra):
        return device_report(trainer.model, trainer.optimizer, managers=[mm], measured={**measured, **extra})

    def batch(step):
        return gpt.synthetic_batch(cfg, step, batch_size=batch_size)

    awake = report()
    managed = awake.by_holder["manager_residue"]
    mm.offload(release_idle_memory=False)
    kept = report()
    mm.onload()
    step_kept_s = _timed_step(trainer, batch(1)) if cuda else None
    mm.offload(release_idle_memory=False)
    release = release_idle_memory()
    asleep = report(**({"cublas_workspaces": 0} if cuda else {}))
    mm.onload()
    step_released_s = _timed_step(trainer, batch(2)) if cuda else None
    trainer.train_step(batch(3))
    mm.offload()  # the default: a full offload releases the idle memory
    default = report(**({"cublas_workspaces": 0} if cuda else {}))
    mm.onload()
    out = {
        "trainer": cfg.model_dump(mode="json"),
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
        "managed_bytes": managed,
        "audit_ok": mm.audit().ok,
        "context": context.to_dict() if context else NOT_MEASURED,
        "nccl_first_collective": {
            "before": before_nccl.to_dict() if before_nccl else NOT_MEASURED,
            "after": after_nccl.to_dict() if after_nccl else NOT_MEASURED,
        },
        "measured": measured,
        "before_offload": awake.to_dict(),
        "after_offload_kept": kept.to_dict(),
        "release": release.to_dict() if release else NOT_MEASURED,
        "after_offload_released": asleep.to_dict(),
        "after_offload": default.to_dict(),
        "step_after_offload_kept_s": step_kept_s,
        "step_after_offload_released_s": step_released_s,
        "text": default.format(),
    }
    if cuda:
        out["target"] = sleep_target(measured["cuda_context"], managed, out["after_offload"])
        if nccl:
            out["nccl"] = measure_nccl()
    return out


_NCCL_SCRIPT = r"""
import json, tempfile, time
import torch
import torch.distributed as dist
from chatlearn_mem.process_memory import process_memory

out = {}
def emit(stage):  # after every stage: a teardown that hangs still leaves what came before
    out["stage"] = stage
    print("NCCL-JSON " + json.dumps(out), flush=True)

def now():
    torch.cuda.synchronize()
    return process_memory()

def group():
    dist.init_process_group("nccl", init_method=f"file://{tempfile.mkdtemp()}/init", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    dist.all_reduce(x)

torch.cuda.init(); torch.cuda.set_device(0)
x = torch.ones(1, device="cuda")
base = now()
out.update(nccl_version=".".join(map(str, torch.cuda.nccl.version())), ranks=1, per_process=base.per_process,
           nvml_note=base.nvml_note, context_bytes=base.used)
t0 = time.perf_counter(); group(); made = now()
out.update(create_s=time.perf_counter() - t0, communicator_bytes=made.outside_allocator - base.outside_allocator)
emit("created")
t0 = time.perf_counter(); dist.destroy_process_group(); gone = now()
out.update(destroy_s=time.perf_counter() - t0, freed_by_destroy_bytes=made.outside_allocator - gone.outside_allocator)
emit("destroyed")
t0 = time.perf_counter(); group(); again = now()
out.update(recreate_s=time.perf_counter() - t0, recreated_bytes=again.outside_allocator - gone.outside_allocator)
emit("recreated")
dist.destroy_process_group()
"""


def measure_nccl(timeout_s: float = NCCL_TIMEOUT_S) -> dict:
    """What one NCCL communicator (one rank) holds on the device outside the allocator, what
    destroying it gives back, and how long destroying and re-creating it take: in a process of its
    own (megatron's groups in this one are held by DDP and the optimizer). A one-rank figure: with
    peers NCCL allocates buffers per channel and peer (about 1 GiB per rank at TP4, reported)."""
    try:
        out = subprocess.run(
            [sys.executable, "-c", _NCCL_SCRIPT], capture_output=True, text=True, timeout=timeout_s, cwd=REPO
        )
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return {"error": f"timed out after {timeout_s:.0f} s", **_nccl_json(text)}
    found = _nccl_json(out.stdout)
    if not found:
        return {"error": f"exit status {out.returncode}: {(out.stdout + out.stderr)[-1500:]}"}
    return found


def measure_teardown(timeout_s: float = 10.0) -> dict:
    """Destroy this process's process groups (megatron's and the default one: every NCCL
    communicator it made) and say what that gave back outside the allocator and how long it took.
    Last thing the report step does; a teardown that does not return in ``timeout_s`` is left
    behind (``returned`` False) and the process ends without waiting for it."""
    from chatlearn_mem.models import gpt
    from chatlearn_mem.process_memory import process_memory

    before = process_memory()
    t0 = time.perf_counter()
    returned = gpt.shutdown_distributed(timeout_s)
    seconds = time.perf_counter() - t0
    after = process_memory() if returned else None
    return {
        "returned": returned,
        "seconds": seconds,
        "freed_bytes": before.outside_allocator - after.outside_allocator if after else None,
        "per_process": bool(after and before.per_process and after.per_process),
    }


def _nccl_json(text: str) -> dict:
    """The last stage the NCCL measurement reported (``{}`` when none)."""
    found = [line[len("NCCL-JSON ") :] for line in text.splitlines() if line.startswith("NCCL-JSON ")]
    return json.loads(found[-1]) if found else {}


# -- running and summarising ------------------------------------------------------------------------
_PYTEST_LINE = re.compile(r"^(tests/\S+?\.py)::(\S+) (PASSED|FAILED|ERROR|SKIPPED)")


def _pytest_log(path: Path) -> list[dict]:
    """Outcomes of the tests a ``pytest -v`` log reports (for a run cut off before its junit file)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        m = _PYTEST_LINE.match(line)
        if m:
            out.append(
                {
                    "test": f"{Path(m.group(1)).stem}::{m.group(2)}",
                    "outcome": m.group(3).lower(),
                    "seconds": 0.0,
                    "message": "from the log (the run was cut off before its junit file)",
                }
            )
    return out


def _junit(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (el.get("message") or "")[:500]
        out.append(
            {
                "test": f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}",
                "outcome": outcome,
                "seconds": float(case.get("time") or 0),
                "message": message,
            }
        )
    return out


def summarise(results: dict) -> str:
    """The markdown of a validation run."""
    env = results.get("environment", {})
    lines = [
        f"# chatlearn-mem GPU validation, {results['date']}",
        "",
        f"Produced by `{results['command']}` (git {results.get('git_revision') or 'unknown'}"
        f"{', from ' + results['revision_source'] if results.get('revision_source') else ''}).",
        "",
        f"- GPU: {env.get('gpu_name', '?')} ({env.get('gpu_memory_bytes', 0) / 2**30:.1f} GiB), "
        f"driver {env.get('driver', '?')}; torch {env.get('torch', '?')} (CUDA {env.get('torch_cuda', '?')}), "
        f"megatron-core {env.get('megatron_core', '?')}, Python {env.get('python', '?')}"
        + (f", NCCL {env['nccl']}" if env.get("nccl") else "")
        + (f", torch_memory_saver {env['torch_memory_saver']}" if env.get("torch_memory_saver") else ""),
        "",
        "## Steps",
        "",
        f"Time budget {results.get('budget_s', TOTAL_BUDGET_S):.0f} s; a step that ends "
        "early leaves its unused seconds to the next; optional steps do not change the exit status.",
        "",
        "| step | status | seconds | limit s | detail |",
        "|---|---|---:|---:|---|",
    ]
    for s in results["steps"]:
        lines.append(
            f"| {s['step']}{' (optional)' if s.get('optional') else ''} | {s['status']} | "
            f"{s.get('seconds', 0):.0f} | {s.get('limit_s', s.get('budget_s', 0)):.0f} | {s.get('detail', '')} |"
        )
    tests = results.get("tests", [])
    if tests:
        lines += ["", "## GPU tests", "", "| test | outcome | seconds | message |", "|---|---|---:|---|"]
        for t in tests:
            msg = t["message"].replace("|", "/").replace("\n", " ")[:200]
            lines.append(f"| {t['test']} | {t['outcome']} | {t['seconds']:.1f} | {msg} |")
    lines += _versus_lines(results.get("benches", {}).get("tms"))
    report = results.get("report")
    if report:
        lines += [
            "",
            "## What stays on the device after a full offload",
            "",
            f"Trainer: {report['parameters'] / 1e6:.0f} M parameters, {report['managed_bytes'] / 2**30:.2f} GiB "
            f"managed; audit after the cycle ok: {report['audit_ok']}.",
            *_report_lines(report),
            "",
            "```",
            report["text"],
            "```",
        ]
    lines += _handoff_lines(results)
    lines += _large_lines(results.get("benches", {}).get("large"))
    for step, bench in results.get("benches", {}).items():
        if step == "bench":
            continue
        met = sum(t["passed"] for t in bench["targets"])
        lines += ["", f"## Targets of the `{step}` step ({bench['preset']}: {met} of {len(bench['targets'])} met)", ""]
        lines += ["| target | result | detail |", "|---|---|---|"]
        lines += [f"| {t['name']} | {'PASS' if t['passed'] else 'MISS'} | {t['detail']} |" for t in bench["targets"]]
    targets = results.get("bench_targets")
    if targets:
        met = sum(t["passed"] for t in targets)
        lines += ["", f"## Benchmark targets ({met} of {len(targets)} met)", ""]
        outlook = results.get("bench_outlook") or {}
        plan, est = outlook.get("host_memory_plan"), outlook.get("time_estimate")
        if plan and est:
            took = outlook.get("part_seconds") or {}
            lines += [
                f"Planned host memory peak {plan['pinned_bytes'] / 2**30:.2f} GiB pinned + "
                f"{plan['pageable_bytes'] / 2**30:.2f} GiB pageable; estimated "
                + ", ".join(
                    f"{p} {s:.0f} s" + (f" (took {took[p]:.0f} s)" if p in took else " (not run)")
                    for p, s in est["parts_s"].items()
                )
                + "; `empty_cache` paid by "
                + (", ".join(m for m, x in (outlook.get("pays_empty_cache") or {}).items() if x) or "none")
                + ".",
                "",
            ]
        lines += ["| target | result | detail |", "|---|---|---|"]
        lines += [f"| {t['name']} | {'PASS' if t['passed'] else 'MISS'} | {t['detail']} |" for t in targets]
    ppo = results.get("ppo")
    if ppo:
        lines += ["", "## Colocated PPO on one GPU", ""]
        for key in ("memory_manager_on", "memory_manager_off"):
            s = ppo["summary"].get(key)
            if s:
                lines.append(
                    f"- {key.replace('_', ' ')}: peak colocated {s['peak_colocated_bytes'] / 2**30:.2f} GiB "
                    f"({s['peak_phase']}) / largest phase {s['largest_phase_bytes'] / 2**30:.2f} GiB "
                    f"({s['largest_phase']}) = {s['ratio']:.3f}"
                )
        lines.append(
            f"- {ppo['iterations']} iterations in {ppo['summary'].get('seconds', 0):.0f} s; "
            f"weight syncs verified: {ppo['sync_ok']}; audits clean: {ppo['audits_ok']}"
        )
    return "\n".join(lines) + "\n"


def _mib(n) -> str:
    return f"{n / 2**20:.0f}" if n is not None else "-"


def _versus_lines(bench) -> list[str]:
    """The manager against torch_memory_saver and megatron-core's own offload, per part (the
    ``tms`` step): median ms and each peer's time over the manager's."""
    if not bench:
        return []
    by = {(r["part"], r["method"], r["direction"]): r for r in bench["timings"]}
    peers = [m for m in ("torch_memory_saver", "megatron_builtin") if any(k[1] == m for k in by)]
    lines = ["", f"## The manager against {' and '.join(peers) or 'its peers'} (`tms` step, {bench['preset']})", ""]
    for m, why in bench.get("skipped_methods", {}).items():
        lines.append(f"`{m}` did not run: {why}.")
    if not peers:
        return lines
    lines += [
        "",
        "| part | direction | manager ms |" + "".join(f" {m} ms | {m} / manager |" for m in peers),
        "|---|---|---:|" + "---:|---:|" * len(peers),
    ]
    for part in ("weights", "grads", "main_weights", "optimizer_states", "full"):
        for d in ("offload", "onload"):
            mgr = by.get((part, "manager", d))
            if mgr is None or not any((part, m, d) in by for m in peers):
                continue
            row = f"| {part} | {d} | {mgr['seconds']['median'] * 1e3:.1f} |"
            for m in peers:
                r = by.get((part, m, d))
                row += f" {r['seconds']['median'] * 1e3:.1f} | **{r['time_vs_manager']:.1f}x** |" if r else " - | - |"
            lines.append(row)
    tms = bench.get("torch_memory_saver") or {}
    if tms:
        lines += [
            "",
            f"torch_memory_saver {(tms.get('worker') or {}).get('version')}: parts whose bytes changed after a resume: "
            f"{', '.join(tms.get('parts_changed') or []) or 'none'}"
            + (f"; failed: {tms['failed']}" if tms.get("failed") else ""),
        ]
    return lines


def _report_lines(report: dict) -> list[str]:
    """The report step's process view before and after a full offload, the release and its cost,
    the target, NCCL."""
    lines = []
    rows = [
        ("awake", report.get("before_offload")),
        ("asleep, idle memory kept", report.get("after_offload_kept")),
        ("asleep, idle memory released", report.get("after_offload_released")),
        ("asleep, the default offload", report.get("after_offload")),
    ]
    if any(r and r.get("process") for _, r in rows):
        lines += [
            "",
            "| state | held MiB | by | allocated MiB | reserved MiB | outside the allocator MiB |",
            "|---|---:|---|---:|---:|---:|",
        ]
        for name, r in rows:
            if r and r.get("process"):
                pr = r["process"]
                lines.append(
                    f"| {name} | {_mib(r['total_bytes'])} | {'NVML' if r.get('per_process') else 'device'} | "
                    f"{_mib(pr['allocated'])} | {_mib(pr['reserved'])} | {_mib(pr['outside_allocator'])} |"
                )
    release = report.get("release")
    if isinstance(release, dict):
        kept, freed = report.get("step_after_offload_kept_s"), report.get("step_after_offload_released_s")
        lines += [
            "",
            f"The release of idle memory gave back {_mib(release['cublas_workspaces_bytes'])} MiB of cuBLAS "
            f"workspaces and {_mib(release['allocator_cache_bytes'])} MiB of the allocator's cache "
            f"({_mib(release['process_bytes'])} MiB by {'NVML' if release['per_process'] else 'the device'}) in "
            f"{release['seconds'] * 1e3:.1f} ms; the first training step after a wake took "
            + (f"{freed * 1e3:.1f} ms with it, {kept * 1e3:.1f} ms without." if kept and freed else "(not timed)."),
        ]
    target = report.get("target")
    if target:
        lines += ["", f"**{'PASS' if target['passed'] else 'MISS'}** {target['name']}: {target['detail']}."]
    teardown = report.get("teardown")
    if teardown:
        lines += [
            "",
            (
                f"Destroying every process group of the report's process (megatron's and the default one) took "
                f"{teardown['seconds'] * 1e3:.0f} ms and gave back {_mib(teardown['freed_bytes'])} MiB outside the "
                f"allocator ({'NVML' if teardown['per_process'] else 'the device'})."
                if teardown["returned"]
                else f"Destroying the report's process groups did not return in {teardown['seconds']:.0f} s."
            ),
        ]
    nccl = report.get("nccl")
    if nccl:
        if "create_s" in nccl:
            lines += [
                "",
                f"NCCL {nccl.get('nccl_version')} (one rank): a communicator holds {_mib(nccl.get('communicator_bytes'))} "
                f"MiB outside the allocator; destroying it took {nccl.get('destroy_s', float('nan')) * 1e3:.0f} ms and gave "
                f"back {_mib(nccl.get('freed_by_destroy_bytes'))} MiB; re-creating it (and its first collective) "
                f"{nccl.get('recreate_s', float('nan')) * 1e3:.0f} ms"
                + (f"; stopped: {nccl['error']}" if nccl.get("error") else "")
                + ".",
            ]
        else:
            lines += ["", f"NCCL measurement failed: {nccl.get('error')}"]
    return lines


def _handoff_lines(results: dict) -> list[str]:
    tests, figures = results.get("handoff_tests"), results.get("handoff") or {}
    if not tests and not figures:
        return []
    lines = ["", "## Another process takes the memory the trainer gave back (`handoff` step)", ""]
    lines += [f"- {t['test']}: {t['outcome']} ({t['seconds']:.1f} s) {t['message'][:200]}" for t in tests or []]
    take = figures.get("take")
    if take:
        lines.append(
            f"- the trainer's state {take['trainer_state_bytes'] / 2**30:.2f} GiB; its offload freed "
            f"{take['freed_by_the_offload_bytes'] / 2**30:.2f} GiB; the other process got "
            f"{take['engine_got_bytes'] / 2**30:.2f} GiB ({take['engine_got_over_state']:.1f}x the state) of the "
            f"{take['engine_free_seen_bytes'] / 2**30:.2f} GiB it saw free, wrote it in {take['engine_seconds']:.1f} s"
        )
    hold = figures.get("hold")
    if hold:
        lines.append(
            f"- while another process held {hold['engine_held_bytes'] / 2**30:.2f} GiB, the onload failed and left "
            f"{', '.join(hold['parts_still_offloaded_after_the_failed_onload'])} offloaded; it woke once the memory was back"
        )
    return lines


def _large_lines(bench) -> list[str]:
    """The ``large`` step: full sleep and wake, seconds and GB/s, beside the ceiling."""
    if not bench:
        return []
    by = {(r["part"], r["method"], r["direction"]): r for r in bench["timings"]}
    model = bench.get("model") or {}
    lines = [
        "",
        f"## The largest trainer on one GPU (`large` step, {bench['preset']}: "
        f"{model.get('parameters', 0) / 1e9:.2f} B parameters, "
        f"{(model.get('bytes_per_part') or {}).get('full', 0) / 2**30:.1f} GiB copied per full cycle)",
        "",
        "| direction | manager s | manager GB/s | ceiling GB/s | manager / ceiling |",
        "|---|---:|---:|---:|---:|",
    ]
    for d in ("offload", "onload"):
        m, c = by.get(("full", "manager", d)), by.get(("full", "ceiling", d))
        if m:
            ratio = c["seconds"]["median"] / m["seconds"]["median"] if c else None
            lines.append(
                f"| full {d} | {m['seconds']['median']:.3f} | {m['gb_per_s'] or 0:.1f} | "
                f"{(c or {}).get('gb_per_s') or 0:.1f} | {ratio:.2f} |"
                if ratio
                else f"| full {d} | {m['seconds']['median']:.3f} | | | |"
            )
    return lines


def plot_summary(results: dict, path: Path) -> None:
    """Left: what stays on the device after a full offload, per holder. Right: the benchmark's
    throughput per part and method (copied parts, offload and onload)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5))
    report = results.get("report")
    if report:
        held = {k: v / 2**20 for k, v in report["after_offload"]["by_holder"].items()}
        ax1.barh(list(held), list(held.values()), color="tab:red")
        ax1.set_xlabel("MiB still on the device after a full offload")
        ax1.set_title(f"What stays ({report['managed_bytes'] / 2**30:.2f} GiB managed before)")
    else:
        ax1.text(0.5, 0.5, "report step not run", ha="center")
    bench = results.get("bench_timings") or next(
        (
            [{k: r[k] for k in ("part", "method", "direction", "gb_per_s")} for r in b["timings"]]
            for b in results.get("benches", {}).values()
        ),
        None,
    )
    if bench:
        rows = [r for r in bench if r.get("gb_per_s")]
        groups = sorted({(r["part"], r["direction"]) for r in rows}, key=lambda g: (g[0], g[1] != "offload"))
        methods = list(dict.fromkeys(r["method"] for r in rows))
        width = 0.8 / max(len(methods), 1)
        for i, m in enumerate(methods):
            xs, ys = [], []
            for g, (part, d) in enumerate(groups):
                r = next((r for r in rows if (r["part"], r["direction"], r["method"]) == (part, d, m)), None)
                if r:
                    xs.append(g + (i - (len(methods) - 1) / 2) * width)
                    ys.append(r["gb_per_s"])
            ax2.bar(xs, ys, width, label=m)
        ax2.set_xticks(range(len(groups)), [f"{p}\n{d}" for p, d in groups], fontsize=8)
        ax2.set_ylabel("GB/s (median)")
        ax2.set_title("Benchmark: throughput per method")
        ax2.legend(fontsize=7)
    else:
        ax2.text(0.5, 0.5, "bench step not run", ha="center")
    fig.suptitle(f"chatlearn-mem on {results.get('environment', {}).get('gpu_name', 'GPU')}, {results['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_results(results: dict, out: Path, stem: str) -> list[Path]:
    """``<stem>_validation.{json,md,png}`` under ``out``."""
    from chatlearn_mem.atomic_files import write_json_atomic

    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}_validation.{x}" for x in ("json", "md", "png")]
    write_json_atomic(paths[0], results)
    paths[1].write_text(summarise(results))
    plot_summary(results, paths[2])
    return paths


def _tests(results: dict, key: str, junit: Path, entry: dict) -> None:
    """A pytest step's outcomes into ``results[key]`` and the step's status and detail."""
    results[key] = _junit(junit) or _pytest_log(Path(entry["log"]))
    if any(t["outcome"] in ("failed", "error") for t in results[key]):
        entry["status"] = "failed"
    counts = {o: sum(t["outcome"] == o for t in results[key]) for o in ("passed", "failed", "error", "skipped")}
    entry["detail"] = ", ".join(f"{n} {o}" for o, n in counts.items() if n)


def _collect_bench(step: str, results: dict, entry: dict) -> None:
    """A bench step's results (its JSON; its markdown and plot rebuilt from it when it was cut off)."""
    path = Path(entry["outputs"][0])
    if not path.exists():
        return
    from chatlearn_mem_bench.report import missing_summary, rebuild

    bench = json.loads(path.read_text())
    if not bench.get("complete", True):  # cut off: its markdown and plot from what it measured
        bench, _ = rebuild(path)
    keep = ("part", "method", "direction", "gb_per_s", "seconds", "bytes_part", "time_vs_manager", "tms_released_bytes")
    summary = {
        "preset": BENCH_STEPS[step],
        "targets": bench.get("targets", []),
        "timings": [{k: r.get(k) for k in keep} for r in bench["timings"]],
        "outlook": {
            k: bench.get(k)
            for k in ("host_memory_plan", "time_estimate", "part_seconds", "pays_empty_cache", "elapsed_seconds")
        },
        "model": bench.get("model"),
        "skipped_methods": bench.get("skipped_methods") or {},
        "torch_memory_saver": bench.get("torch_memory_saver"),
        "cycles": (bench.get("cycles") or {}).get("cycle_s_all"),
        "complete": bench.get("complete", True),
    }
    results.setdefault("benches", {})[step] = summary
    if step == "bench":  # the keys of the earlier runs' summaries
        results["bench_targets"] = summary["targets"]
        results["bench_timings"] = [
            {k: r[k] for k in ("part", "method", "direction", "gb_per_s")} for r in summary["timings"]
        ]
        results["bench_outlook"] = {
            k: summary["outlook"][k] for k in ("host_memory_plan", "time_estimate", "part_seconds", "pays_empty_cache")
        }
    met = sum(t["passed"] for t in summary["targets"])
    entry["detail"] = (
        f"{met} of {len(summary['targets'])} targets met; methods {', '.join(bench['methods'])}"
        + "".join(f"; {m} not run: {why}" for m, why in summary["skipped_methods"].items())
        + (f"; {missing_summary(bench)}" if not bench.get("complete", True) else "")
    )
    if entry.get("status", "").startswith("timed out") and bench.get("complete", False):
        # Everything measured and written, then stopped while the process exited (on the GPU
        # machines: freeing GBs of pinned host memory, NCCL's teardown): not a failure.
        waited = entry.get("ended_at", path.stat().st_mtime) - path.stat().st_mtime
        entry["status"] = "ok"
        entry["detail"] += f"; complete: stopped at its limit {waited:.0f} s after writing its results, while exiting"


def _collect(step: str, results: dict, work: Path, entry: dict) -> None:
    """Read what a finished step wrote into ``results``."""
    if step == "tests":
        _tests(results, "tests", work / "junit.xml", entry)
    elif step == "handoff":
        _tests(results, "handoff_tests", work / "junit_handoff.xml", entry)
        figures = work / "handoff.json"
        if figures.exists():
            results["handoff"] = json.loads(figures.read_text())
            take = results["handoff"].get("take")
            if take:
                entry["detail"] += (
                    f"; the other process got {take['engine_got_bytes'] / 2**30:.1f} GiB, "
                    f"{take['engine_got_over_state']:.1f}x the trainer's state"
                )
    elif step == "report" and (work / "report.json").exists():
        results["report"] = json.loads((work / "report.json").read_text())
        entry["detail"] = (
            f"{results['report']['after_offload']['total_bytes'] / 2**20:.0f} MiB still held after offload"
        )
        target = results["report"].get("target")
        if target:
            entry["detail"] += f"; {'PASS' if target['passed'] else 'MISS'}: {target['detail']}"
    elif step in BENCH_STEPS:
        _collect_bench(step, results, entry)
    elif step == "ppo":
        path = Path(entry["outputs"][0])
        if path.exists():
            log = json.loads(path.read_text())
            audits = log.get("audits") or {}
            results["ppo"] = {
                "summary": log["summary"],
                "iterations": len(log["iterations"]),
                "sync_ok": all(c.get("equal", False) for c in log.get("sync_checks", [])),
                "audits_ok": audits.get("runs") == audits.get("checks_clean"),
                "audits": audits,
            }
            on = log["summary"].get("memory_manager_on") or {}
            entry["detail"] = f"colocation ratio {on.get('ratio', float('nan')):.3f} with the manager on"


def _environment() -> dict:
    import platform
    from importlib import metadata

    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda}
    for dist in ("megatron-core", "ray", "pydantic", "chatlearn-mem", "torch_memory_saver", "nvidia-ml-py"):
        try:
            env[dist.replace("-", "_")] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            env[dist.replace("-", "_")] = None
    try:
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001 - a torch built without NCCL: say nothing
        env["nccl"] = None
    props = torch.cuda.get_device_properties(0)
    env.update(gpu_name=props.name, gpu_memory_bytes=props.total_memory, gpu_count=torch.cuda.device_count())
    try:
        env["driver"] = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        env["driver"] = None
    return env


def _run_step(command: list[str], log: Path, limit_s: float, env: dict | None = None) -> tuple[str, str]:
    """Run one step in its own process group, its output streamed into ``log``; at the limit the
    whole group is killed (the PPO step's Ray workers and the TMS worker included). Returns the
    status and the output. ``env``: variables added to this process's environment."""
    with open(log, "w") as f:
        proc = subprocess.Popen(
            command,
            cwd=REPO,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        try:
            code = proc.wait(timeout=limit_s)
            status = "ok" if code == 0 else f"exit {code}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = f"timed out after {limit_s:.0f} s"
    return status, log.read_text(errors="replace")


def run(args, steps: list[str]) -> int:
    """The GPU run: every step in turn within the time budget, results written after each."""
    import torch

    if not torch.cuda.is_available():  # the first CUDA call
        _say(
            "error: no CUDA device here (torch.cuda.is_available() is False). Run it on the GPU machine, "
            "or check the setup with --dry-run"
        )
        return 2
    revision, source = source_revision(args.revision, args.wheelhouse)
    if not revision:
        _say(
            "error: no source revision to record: pass --revision, run from a git checkout, or carry the "
            "wheelhouse scripts/gpu_wheelhouse.sh filled (it writes .whl/REVISION)"
        )
        return 2
    env = _environment()
    date = _dt.date.today().isoformat()
    stem = f"{date}_{gpu_slug(env['gpu_name'])}"
    out = Path(args.out)
    work = out / f"{stem}_validation"
    work.mkdir(parents=True, exist_ok=True)
    results = {
        "date": date,
        "command": shlex.join(sys.argv),
        "git_revision": revision,
        "revision_source": source,
        "environment": env,
        "steps": [],
        "budget_s": args.budget_s,
    }
    _say(f"revision {revision} (from {source}); logs under {work}")
    for line in check_bounds(steps, args.budget_s)[0]:
        _say(line)
    started = time.monotonic()
    ok = True
    entries = plan(out, stem, steps, work, revision)
    for i, entry in enumerate(entries):
        step = entry["step"]
        later = sum(e["budget_s"] for e in entries[i + 1 :])
        limit = args.budget_s - (time.monotonic() - started) - later  # unused seconds roll forward
        entry = {**entry, "command": shlex.join(entry["command"]), "limit_s": max(0.0, limit)}
        if limit < MIN_STEP_S:
            entry.update(status="skipped", detail=f"time budget: {limit:.0f} s left for it")
            ok = ok and entry["optional"]
        else:
            _say(f"step {step}: {entry['command']} (limit {limit:.0f} s, output in {entry['log']})")
            t0 = time.monotonic()
            status, text = _run_step(shlex.split(entry["command"]), Path(entry["log"]), limit, entry.get("env"))
            print(text[-6000:], flush=True)
            entry.update(status=status, seconds=time.monotonic() - t0, ended_at=time.time(), output_tail=text[-4000:])
            _collect(step, results, work, entry)
            ok = ok and (entry["status"] == "ok" or entry["optional"])
            _say(f"step {step}: {entry['status']} in {entry['seconds']:.0f} s {entry.get('detail', '')}")
        results["steps"].append(entry)
        write_results(results, out, stem)
    paths = write_results(results, out, stem)
    for p in paths:
        _say(f"wrote {p}")
    for step, bench in results.get("benches", {}).items():
        for t in bench["targets"]:
            _say(f"{step}: {'PASS' if t['passed'] else 'MISS'}  {t['name']}: {t['detail']}")
    target = (results.get("report") or {}).get("target")
    if target:
        _say(f"report: {'PASS' if target['passed'] else 'MISS'}  {target['name']}: {target['detail']}")
    _say(
        "every required step ran, every GPU test passed or was skipped"
        if ok
        else "some steps failed: see the table above"
    )
    return 0 if ok else 1


def dry_run(args, steps: list[str]) -> int:
    """Everything up to the first CUDA call."""
    problems = []
    _say(
        f"dry run: Python {sys.version.split()[0]} ({'3.12 like' if sys.version_info[:2] == (3, 12) else 'not'} "
        "the GPU machine's)"
    )
    if args.wheelhouse:
        wh = check_wheelhouse(Path(args.wheelhouse))
        problems += [f"wheelhouse {args.wheelhouse}: {p}" for p in wh]
        if not wh:
            size = sum(p.stat().st_size for p in Path(args.wheelhouse).iterdir())
            _say(f"wheelhouse {args.wheelhouse}: complete, {size / 2**20:.1f} MiB")
    else:
        _say("wheelhouse: not checked (no --wheelhouse)")
    revision, source = source_revision(args.revision, args.wheelhouse)
    if revision:
        _say(f"revision: {revision} (from {source})")
    else:
        problems.append(
            "no source revision: pass --revision, run from a git checkout, or fill the wheelhouse with "
            "scripts/gpu_wheelhouse.sh (it writes .whl/REVISION)"
        )
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            configs = _resolve_configs()
        p = configs["ppo"]
        for step, preset in BENCH_STEPS.items():
            b = configs["benches"][step]
            _say(
                f"{step} config: preset {preset}: {b['trainer']['num_layers']} layers x "
                f"{b['trainer']['hidden_size']}, vocab {b['trainer']['vocab_size']}, repeats {b['repeats']}, "
                f"cycles {b['cycles']}, methods {', '.join(b['methods']) or 'none'}, "
                f"release bound {'on' if b['release_bound'] else 'off'}"
            )
        _say(
            f"ppo config: preset gpu + {' '.join(PPO_OVERRIDES)}: {p['parallel']['world_size']} rank(s), "
            f"{p['ppo']['iterations']} iterations, policy {p['policy']['num_layers']} layers x "
            f"{p['policy']['hidden_size']}"
        )
        lines, bounds = check_bounds(steps, args.budget_s)
        for line in lines:
            _say(line)
        problems += bounds
    except Exception as e:  # noqa: BLE001 - a ConfigError or an import problem, reported
        problems.append(f"config: {type(e).__name__}: {e}")
    problems += _import_all(steps)
    _say(f"imports: {len(IMPORTS) - (0 if 'ppo' in steps else 1)} modules checked")
    if "tests" in steps or "handoff" in steps:
        n, text = _collect_gpu_tier()
        if n < 0:
            problems.append(f"collecting tests/gpu failed:\n{text}")
        else:
            _say(f"tests/gpu: {n} tests collected")
    stem = f"{_dt.date.today().isoformat()}_gpu-<gpu name>"
    out = Path(args.out)
    work = out / f"{stem}_validation"
    _say(f"plan ({len(steps)} steps, time budget {args.budget_s:.0f} s; outputs under {out}):")
    for entry in plan(out, stem, steps, work, revision or "<revision>"):
        env = " ".join(f"{k}={v}" for k, v in entry["env"].items())
        _say(
            f"  {entry['step']} (budget {entry['budget_s']} s{', optional' if entry['optional'] else ''}): "
            f"{env + ' ' if env else ''}{shlex.join(entry['command'])}"
        )
        for o in [entry["log"], *entry["outputs"]]:
            _say(f"      writes {o}")
    for x in ("json", "md", "png"):
        _say(f"  then writes {out / f'{stem}_validation.{x}'}")
    if problems:
        for p in problems:
            _say(f"error: {p}")
        _say(f"dry run failed: {len(problems)} problem(s)")
        return 2
    _say("dry run ok: stopping before the first CUDA call (torch.cuda.is_available() comes next)")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="check everything up to the first CUDA call, then stop")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="where the results go")
    parser.add_argument("--wheelhouse", default=None, help="check this wheelhouse (e.g. .whl)")
    parser.add_argument(
        "--steps",
        default=",".join(DEFAULT_STEPS),
        help=f"comma-separated subset of {','.join(STEPS)} (default {','.join(DEFAULT_STEPS)}); they run in that order",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=float(TOTAL_BUDGET_S),
        help=f"seconds for all steps; a step with too little left is skipped (default {TOTAL_BUDGET_S})",
    )
    parser.add_argument(
        "--revision",
        default=None,
        help="source revision to record (default: git HEAD here, else the wheelhouse's REVISION)",
    )
    parser.add_argument("--report-json", default=None, help=argparse.SUPPRESS)  # the report step's own process
    args = parser.parse_args(argv)
    if args.report_json:
        from chatlearn_mem.models import gpt

        with gpt.owned_process_group():  # destroyed before exit: a NCCL group left to it holds it up
            report = measure_device_report(nccl=False)
            Path(args.report_json).write_text(json.dumps(report, indent=1))  # kept if what follows hangs
            print(report["text"])
            if "target" in report:  # CUDA: what a NCCL communicator holds, in a process of its own
                report["nccl"] = measure_nccl()
                Path(args.report_json).write_text(json.dumps(report, indent=1))
                print(f"NCCL: {report['nccl']}")
                report["teardown"] = measure_teardown()  # every group of this process, destroyed
                Path(args.report_json).write_text(json.dumps(report, indent=1))
                print(f"teardown: {report['teardown']}")
        gpt.exit_process(0)  # at once when the process group's teardown hung
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    bad = [s for s in steps if s not in STEPS]
    if bad or not steps:
        parser.error(f"unknown step(s) {bad}; steps are {', '.join(STEPS)}")
    os.chdir(REPO)
    return dry_run(args, steps) if args.dry_run else run(args, steps)


if __name__ == "__main__":
    sys.exit(main())
