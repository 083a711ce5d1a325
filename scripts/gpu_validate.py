#!/usr/bin/env python3
"""Validate chatlearn-mem on one GPU in one command: the GPU test tier, what stays on the device after
a full offload, the benchmark's GPU preset and a short colocated PPO run; results named after the GPU.

On the GPU machine (everything it lacks is carried as wheels, see scripts/gpu_wheelhouse.sh)::

    bash scripts/gpu_validate.sh --out "$OUT"          # installs .whl/ into /tmp/site, runs this

Anywhere, without a GPU (CI runs this; it needs the [test] install)::

    python scripts/gpu_validate.py --dry-run --wheelhouse .whl

The dry run does everything up to the first CUDA call: checks the wheelhouse (every package the GPU
machine lacks, one version each, built for CPython 3.12 on x86-64 Linux, within the 64 MiB a
device call may carry, and the source revision it was built from), resolves the benchmark and PPO
configs, plans the benchmark's host memory and estimates its time from the config alone (and fails
when either exceeds its bound: :data:`HOST_BOUND_BYTES`, the step's budget), imports every module
the GPU run imports, collects the GPU tier, and prints the plan (steps, commands, time budgets,
output files). Then it stops with one line saying so.

Steps, in this order (each a fresh process in its own process group, so one crash or CUDA error
cannot take the others with it; each within its time budget, :data:`BUDGET_S`, which add up to
:data:`TOTAL_BUDGET_S` = 560 s of the 600 s one device call may run, the rest for installing the
wheelhouse and writing the summary; a step that ends early leaves its unused seconds to the next):

1. ``tests``  ``pytest tests/gpu`` (exactness with NCCL, policy + critic sharing the GPU, allocated
   and reserved bytes after offload with and without expandable segments, pinned host store,
   device OOM during onload, Transformer Engine layer spec when TE imports, the device report).
2. ``report`` what stays on the device after a full offload of the PPO preset's policy trainer
   (about 0.35 B parameters) once NCCL has a communicator: :func:`chatlearn_mem.device_report`.
3. ``bench``  ``chatlearn-mem bench --config gpu`` (the preset is sized for this step's budget: its
   estimate is printed before it runs); its targets are printed PASS/MISS against the pinned
   ceiling measured in the same run.
4. ``ppo``    optional, last: ``chatlearn-mem ppo --config gpu`` scaled to one GPU (one rank, 2
   iterations plus one with the manager off, short sequences). Its outcome is reported but does
   not change the exit status.

Everything is written under ``--out`` as it happens: each step's output streams into
``<stem>_validation/<step>.log`` (with ``junit.xml`` and ``report.json``), the summary is rewritten
after every step, the benchmark rewrites its JSON after every part and the PPO run its log after
every iteration; a step cut off by its budget keeps what it wrote, and the benchmark's markdown
and plot are rebuilt from its partial JSON.

Outputs (``--out``, default ``benchmarks/results``; ``<stem>`` = ``<date>_gpu-<gpu name>``):
``<stem>_validation.{json,md,png}`` (every step's status, the test outcomes, the device reports,
the bench targets, the PPO summary; the PNG shows what stays on the device and the bench's
throughput per method), ``<stem>_validation/`` (the step logs), ``<stem>.{json,md,png}`` (the
benchmark's own files) and ``<stem>_ppo/{log.json,memory_timeline.png}``.

The source revision is recorded in every result: ``--revision``, else ``git rev-parse HEAD`` of this
checkout, else the ``REVISION`` file ``scripts/gpu_wheelhouse.sh`` writes into the wheelhouse (the
copy on the GPU machine has no ``.git``); a run without one stops before it starts.

Exit status: 0 when every required step ran and every GPU test passed or was skipped; 1 otherwise;
2 for a setup problem (no CUDA without --dry-run, a wheelhouse that is incomplete, no revision).
Benchmark targets are data, not failures.
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
    "chatlearn_mem",
)
"""Distributions the GPU machine lacks, carried as wheels (it has torch, numpy, typer, PyYAML,
matplotlib, psutil, pytest and Ray's other requirements)."""
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
STEPS = ("tests", "report", "bench", "ppo")
OPTIONAL = ("ppo",)
"""Steps whose outcome does not change the exit status (run last, when their budget is left)."""
BUDGET_S = {"tests": 100, "report": 30, "bench": 270, "ppo": 160}
"""Seconds each step may run; a step that ends early leaves the rest to the next one."""
TOTAL_BUDGET_S = 560
"""What the steps may take together: one device call runs at most 600 s, and installing the
wheelhouse (3 s on an H200 machine), starting Python and writing the summary need the rest. On the
H200 the tests took 79 s, the report 22 s, the bench 259 s (206 s measured inside it; importing,
building and exiting the rest) and the PPO step's actors 66 s to start before its 3 iterations."""
MIN_STEP_S = 20
"""A step with less than this left of the budget is skipped, not started."""
ESTIMATE_SHARE = 0.9
"""The benchmark's estimate may use at most this share of its step's budget."""
GPU_HOST_BYTES = 128 * 2**30
"""Host memory of the GPU machine."""
HOST_BOUND_BYTES = GPU_HOST_BYTES // 2
"""The benchmark's planned host memory peak (pinned + pageable) must stay under this: half the
machine, leaving the rest to the process itself, the CUDA driver, the page cache and the other steps."""


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
        py, _, plat = tags
        if not (py in ("py3", "py2.py3", "cp312") or py.startswith("cp312")):
            problems.append(f"{w} is not for CPython 3.12 (tag {py})")
        if plat != "any" and "x86_64" not in plat:
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
        for needed in ("chatlearn_mem_bench/presets/gpu.yaml", "chatlearn_mem_ray/presets/gpu.yaml"):
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


def plan(out: Path, stem: str, steps: list[str], work: Path, revision: str) -> list[dict]:
    """The steps to run, in order: name, command, time budget and the files each writes."""
    py = sys.executable
    cmds = {
        "tests": [
            py,
            "-m",
            "pytest",
            "tests/gpu",
            "-v",
            "-rA",
            "-p",
            "no:cacheprovider",
            # a test still running after 60 s prints every thread's stack into the log (and goes on)
            "-o",
            "faulthandler_timeout=60",
            "--durations=0",
            f"--junitxml={work / 'junit.xml'}",
        ],
        "report": [py, str(Path(__file__).resolve()), "--report-json", str(work / "report.json")],
        "bench": [
            py,
            "-m",
            "chatlearn_mem_cli",
            "bench",
            "--config",
            "gpu",
            f"output_dir={out}",
            f"name={stem}",
            f"revision={revision}",
            "-q",
        ],
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
        "report": [],
        "bench": [out / f"{stem}.{x}" for x in ("json", "md", "png")],
        "ppo": [out / f"{stem}_ppo" / "log.json", out / f"{stem}_ppo" / "memory_timeline.png"],
    }
    return [
        {
            "step": s,
            "command": cmds[s],
            "budget_s": BUDGET_S[s],
            "optional": s in OPTIONAL,
            "log": str(work / f"{s}.log"),
            "outputs": [str(p) for p in outputs[s]],
        }
        for s in STEPS
        if s in steps
    ]


def _resolve_configs() -> dict:
    """The benchmark and PPO configs the GPU run uses, validated (raises ConfigError)."""
    from chatlearn_mem_bench.config import load_config as bench_config
    from chatlearn_mem_ray.config import load_config as ppo_config

    bench = bench_config("gpu")
    ppo = ppo_config("gpu", list(PPO_OVERRIDES))
    return {"bench": bench.model_dump(mode="json"), "ppo": json.loads(ppo.model_dump_json())}


def bench_outlook():
    """The gpu bench preset's host memory plan and time estimate from its config (nothing built),
    as the GPU machine will run it: pinned buffers, megatron-core 0.19 (its own offload calls)."""
    from chatlearn_mem import MemoryConfig
    from chatlearn_mem_bench.config import load_config
    from chatlearn_mem_bench.overlap import plan_args as overlap_plan_args
    from chatlearn_mem_bench.plan import estimate_part_sizes, estimate_seconds, plan_host_memory

    cfg = load_config("gpu")
    sizes = estimate_part_sizes(cfg.trainer)
    overlap = overlap_plan_args(cfg)
    host = plan_host_memory(
        sizes,
        methods=cfg.methods,
        cuda=True,
        pin=True,
        overlap_bytes=overlap.get("overlap_bytes"),
        bucket_size=MemoryConfig(bucket_size_mb=cfg.bucket_size_mb).bucket_size_bytes,
    )
    time_s = estimate_seconds(
        sizes,
        methods=cfg.methods,
        repeats=cfg.repeats,
        warmup=cfg.warmup,
        cycles=cfg.cycles,
        cuda=True,
        pin=True,
        **overlap,
    )
    return host, time_s


def check_bounds(steps: list[str]) -> tuple[list[str], list[str]]:
    """Lines to print and problems: the budgets add up to at most :data:`TOTAL_BUDGET_S`, the
    bench's estimate fits :data:`ESTIMATE_SHARE` of its budget, its host plan :data:`HOST_BOUND_BYTES`."""
    lines, problems = [], []
    total = sum(BUDGET_S[s] for s in steps)
    lines.append(
        f"time budget: {' + '.join(f'{s} {BUDGET_S[s]}' for s in steps)} = {total} s "
        f"(at most {TOTAL_BUDGET_S} s); {', '.join(o for o in OPTIONAL if o in steps) or 'no step'} optional"
    )
    if sum(BUDGET_S.values()) > TOTAL_BUDGET_S:
        problems.append(f"the step budgets add up to {sum(BUDGET_S.values())} s, over {TOTAL_BUDGET_S} s")
    if "bench" in steps:
        host, time_s = bench_outlook()
        lines += [f"bench {host.summary()}", f"bench {time_s.summary()}"]
        if host.peak_bytes > HOST_BOUND_BYTES:
            problems.append(
                f"the bench plans {host.peak_bytes / 2**30:.1f} GiB of host memory, over its bound of "
                f"{HOST_BOUND_BYTES / 2**30:.0f} GiB (half the GPU machine's "
                f"{GPU_HOST_BYTES / 2**30:.0f} GiB): shrink configs/bench/gpu.yaml"
            )
        if time_s.total_s > ESTIMATE_SHARE * BUDGET_S["bench"]:
            problems.append(
                f"the bench is estimated at {time_s.total_s:.0f} s, over {ESTIMATE_SHARE:.0%} of its "
                f"{BUDGET_S['bench']} s budget: shrink configs/bench/gpu.yaml (trainer, repeats, cycles)"
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
    "chatlearn_mem_bench.run",
    "chatlearn_mem_bench.report",
    "chatlearn_mem_cli.app",
    "chatlearn_mem_ray.supervisor",
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
def measure_device_report(cfg=None, batch_size: int = 4) -> dict:
    """Build a trainer (the PPO gpu preset's policy by default), train one step, make sure NCCL holds
    a communicator, offload everything and report what stays. Returns the reports before and after.
    Works on CPU too (then the walk is the whole report)."""
    import warnings

    import torch

    from chatlearn_mem import TrainerMemoryManager, device_report
    from chatlearn_mem.models import gpt

    if cfg is None:
        from chatlearn_mem_ray.config import load_config as ppo_config

        cfg = ppo_config("gpu", list(PPO_OVERRIDES)).policy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if not torch.distributed.is_initialized():
            import tempfile

            gpt.init_distributed(init_method=f"file://{tempfile.mkdtemp()}/init", cpu_backend=True)
        trainer = gpt.build_gpt_trainer(cfg)
        mm = TrainerMemoryManager(trainer.model, trainer.optimizer)
        trainer.train_step(gpt.synthetic_batch(cfg, 0, batch_size=batch_size))
    probe = torch.ones(1, device=mm.device)
    torch.distributed.all_reduce(probe)  # NCCL creates its communicator on the first collective
    del probe
    before = device_report(trainer.model, trainer.optimizer, managers=[mm])
    mm.offload()
    after = device_report(trainer.model, trainer.optimizer, managers=[mm])
    mm.onload()
    return {
        "trainer": cfg.model_dump(mode="json"),
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
        "managed_bytes": before.by_holder["manager_residue"],
        "audit_ok": mm.audit().ok,
        "before_offload": before.to_dict(),
        "after_offload": after.to_dict(),
        "text": after.format(),
    }


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
        f"megatron-core {env.get('megatron_core', '?')}, Python {env.get('python', '?')}",
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
    report = results.get("report")
    if report:
        lines += [
            "",
            "## What stays on the device after a full offload",
            "",
            f"Trainer: {report['parameters'] / 1e6:.0f} M parameters, {report['managed_bytes'] / 2**30:.2f} GiB "
            f"managed; audit after the cycle ok: {report['audit_ok']}.",
            "",
            "```",
            report["text"],
            "```",
        ]
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
    bench = results.get("bench_timings")
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


def _collect(step: str, results: dict, work: Path, entry: dict) -> None:
    """Read what a finished step wrote into ``results``."""
    if step == "tests":
        results["tests"] = _junit(work / "junit.xml") or _pytest_log(Path(entry["log"]))
        bad = [t for t in results["tests"] if t["outcome"] in ("failed", "error")]
        if bad:
            entry["status"] = "failed"
        counts = {o: sum(t["outcome"] == o for t in results["tests"]) for o in ("passed", "failed", "error", "skipped")}
        entry["detail"] = ", ".join(f"{n} {o}" for o, n in counts.items() if n)
    elif step == "report" and (work / "report.json").exists():
        results["report"] = json.loads((work / "report.json").read_text())
        entry["detail"] = (
            f"{results['report']['after_offload']['total_bytes'] / 2**20:.0f} MiB still held after offload"
        )
    elif step == "bench":
        path = Path(entry["outputs"][0])
        if path.exists():
            from chatlearn_mem_bench.report import missing_summary, rebuild

            bench = json.loads(path.read_text())
            if not bench.get("complete", True):  # cut off: its markdown and plot from what it measured
                bench, _ = rebuild(path)
            results["bench_targets"] = bench.get("targets", [])
            results["bench_timings"] = [
                {k: r[k] for k in ("part", "method", "direction", "gb_per_s")} for r in bench["timings"]
            ]
            results["bench_outlook"] = {
                k: bench.get(k) for k in ("host_memory_plan", "time_estimate", "part_seconds", "pays_empty_cache")
            }
            met = sum(t["passed"] for t in results["bench_targets"])
            entry["detail"] = (
                f"{met} of {len(results['bench_targets'])} targets met; methods "
                f"{', '.join(bench['methods'])}"
                + (f"; {missing_summary(bench)}" if not bench.get("complete", True) else "")
            )
            if entry.get("status", "").startswith("timed out") and bench.get("complete", False):
                # Everything measured and written, then stopped while the process exited (on the
                # GPU machines: freeing GBs of pinned host memory, NCCL's teardown): not a failure.
                waited = entry.get("ended_at", path.stat().st_mtime) - path.stat().st_mtime
                entry["status"] = "ok"
                entry["detail"] += (
                    f"; complete: stopped at its limit {waited:.0f} s after writing its results, while exiting"
                )
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
    for dist in ("megatron-core", "ray", "pydantic", "chatlearn-mem"):
        try:
            env[dist.replace("-", "_")] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            env[dist.replace("-", "_")] = None
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


def _run_step(command: list[str], log: Path, limit_s: float) -> tuple[str, str]:
    """Run one step in its own process group, its output streamed into ``log``; at the limit the
    whole group is killed (the PPO step's Ray workers included). Returns the status and the output."""
    with open(log, "w") as f:
        proc = subprocess.Popen(command, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
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
    for line in check_bounds(steps)[0]:
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
            status, text = _run_step(shlex.split(entry["command"]), Path(entry["log"]), limit)
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
    for t in results.get("bench_targets", []):
        _say(f"{'PASS' if t['passed'] else 'MISS'}  {t['name']}: {t['detail']}")
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
        b, p = configs["bench"], configs["ppo"]
        _say(
            f"bench config: preset gpu: {b['trainer']['num_layers']} layers x "
            f"{b['trainer']['hidden_size']}, vocab {b['trainer']['vocab_size']}, repeats {b['repeats']}, "
            f"cycles {b['cycles']}, methods {', '.join(b['methods'])}"
        )
        _say(
            f"ppo config: preset gpu + {' '.join(PPO_OVERRIDES)}: {p['parallel']['world_size']} rank(s), "
            f"{p['ppo']['iterations']} iterations, policy {p['policy']['num_layers']} layers x "
            f"{p['policy']['hidden_size']}"
        )
        lines, bounds = check_bounds(steps)
        for line in lines:
            _say(line)
        problems += bounds
    except Exception as e:  # noqa: BLE001 - a ConfigError or an import problem, reported
        problems.append(f"config: {type(e).__name__}: {e}")
    problems += _import_all(steps)
    _say(f"imports: {len(IMPORTS) - (0 if 'ppo' in steps else 1)} modules checked")
    if "tests" in steps:
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
        _say(
            f"  {entry['step']} (budget {entry['budget_s']} s{', optional' if entry['optional'] else ''}): "
            f"{shlex.join(entry['command'])}"
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
    parser.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated subset of {','.join(STEPS)}")
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
            Path(args.report_json).write_text(json.dumps(measure_device_report(), indent=1))
        print(json.loads(Path(args.report_json).read_text())["text"])
        gpt.exit_process(0)  # at once when the process group's teardown hung
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    bad = [s for s in steps if s not in STEPS]
    if bad or not steps:
        parser.error(f"unknown step(s) {bad}; steps are {', '.join(STEPS)}")
    os.chdir(REPO)
    return dry_run(args, steps) if args.dry_run else run(args, steps)


if __name__ == "__main__":
    sys.exit(main())
