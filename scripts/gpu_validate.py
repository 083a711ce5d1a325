#!/usr/bin/env python3
"""Validate chatlearn-mem on one GPU in one command: the GPU test tier, what stays on the device after
a full offload, the benchmark's GPU preset and a short colocated PPO run; results named after the GPU.

On the GPU machine (everything it lacks is carried as wheels, see scripts/gpu_wheelhouse.sh)::

    bash scripts/gpu_validate.sh --out "$OUT"          # installs .whl/ into /tmp/site, runs this

Anywhere, without a GPU (CI runs this; it needs the [test] install)::

    python scripts/gpu_validate.py --dry-run --wheelhouse .whl

The dry run does everything up to the first CUDA call: checks the wheelhouse (every package the GPU
machine lacks, one version each, built for CPython 3.12 on x86-64 Linux, within the 64 MiB a
device call may carry), resolves the benchmark and PPO configs with the overrides below, imports
every module the GPU run imports, collects the GPU tier, and prints the plan (steps, commands,
time limits, output files). Then it stops with one line saying so.

Steps (each a fresh process, so one crash or CUDA error cannot take the others with it; results
are written after every step, so a run cut short still leaves what it measured):

1. ``tests``  ``pytest tests/gpu`` (exactness with NCCL, policy + critic sharing the GPU, allocated
   and reserved bytes after offload with and without expandable segments, pinned host store,
   device OOM during onload, Transformer Engine layer spec when TE imports, the device report).
2. ``report`` what stays on the device after a full offload of the PPO preset's policy trainer
   (about 0.35 B parameters) once NCCL has a communicator: :func:`chatlearn_mem.device_report`.
3. ``bench``  ``chatlearn-mem bench --config gpu`` with fewer repeats (fits the 10 minutes); its
   targets are printed PASS/MISS against the pinned ceiling measured in the same run.
4. ``ppo``    ``chatlearn-mem ppo --config gpu`` scaled to one GPU (one rank, 3 iterations plus one
   with the manager off, short sequences).

Outputs (``--out``, default ``benchmarks/results``; ``<stem>`` = ``<date>_gpu-<gpu name>``):
``<stem>_validation.{json,md,png}`` (every step's status, the test outcomes, the device reports,
the bench targets, the PPO summary; the PNG shows what stays on the device and the bench's
throughput per method), ``<stem>.{json,md,png}`` (the benchmark's own files) and
``<stem>_ppo/{log.json,memory_timeline.png}``: 8 files, what one device call can bring back.

Exit status: 0 when every step ran and every GPU test passed or was skipped; 1 otherwise; 2 for a
setup problem (no CUDA without --dry-run, a wheelhouse that is incomplete). Benchmark targets are
data, not failures.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import shlex
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
WHEELS = ("megatron_core", "pydantic", "pydantic_core", "annotated_types", "typing_inspection", "jsonschema",
          "jsonschema_specifications", "referencing", "rpds_py", "chatlearn_mem")
"""Distributions the GPU machine lacks, carried as wheels (it has torch, numpy, typer, PyYAML,
matplotlib, psutil, pytest and Ray's other requirements)."""
RAY_ARCHIVE = re.compile(r"^ray-[0-9.]+-cp312-pruned\.tar\.xz$")
"""Ray's cp312 wheel is 79 MB, over what one device call carries: scripts/gpu_wheelhouse.sh repacks
it without Java, RLlib, Data, Serve, Train, Tune, LLM and the dashboard's web client (28 MB)."""
CARRY_LIMIT = 64 * 2**20
WHEELHOUSE_LIMIT = 60 * 2**20  # the rest of the 64 MiB is the repository itself

BENCH_OVERRIDES = ("repeats=5", "warmup=1", "cycles=10")
"""The gpu preset, fewer repeats: the whole validation must end within one 10-minute device call."""
PPO_OVERRIDES = ("parallel.world_size=1", "parallel.tensor_model_parallel_size=1", "ppo.iterations=3",
                 "ppo.prompts_per_iteration=64", "ppo.prompt_length=64", "ppo.response_length=64",
                 "ppo.minibatch_size=16", "memory.compare_iterations=1", "memory.verify_sync=true",
                 "ray.cpus_per_rank=4")
"""configs/ppo/gpu.yaml (8 ranks, TP=2) scaled to one GPU and about two minutes."""
STEPS = ("tests", "report", "bench", "ppo")
TIMEOUTS_S = {"tests": 240, "report": 120, "bench": 360, "ppo": 240}
MIN_S = {"tests": 60, "report": 30, "bench": 150, "ppo": 90}
"""A step starts only when at least this much of the time budget is left."""


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
    unknown = [f for f in files if f not in wheels and f not in rays]
    if unknown:
        problems.append(f"files that are neither wheels nor the Ray archive: {', '.join(unknown)}")
    total = sum((path / f).stat().st_size for f in files)
    if total > WHEELHOUSE_LIMIT:
        problems.append(f"{total / 2**20:.1f} MiB: more than {WHEELHOUSE_LIMIT / 2**20:.0f} MiB, which leaves too "
                        f"little of the {CARRY_LIMIT / 2**20:.0f} MiB one device call carries for the repository")
    return problems


def _repo_version() -> str:
    text = (REPO / "pyproject.toml").read_text()
    return re.search(r'^version = "([^"]+)"', text, re.M).group(1)


# -- the plan ---------------------------------------------------------------------------------------
def gpu_slug(name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``gpu-nvidia-h100-80gb-hbm3`` (the benchmark's own naming)."""
    return "gpu-" + re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-")


def plan(out: Path, stem: str, steps: list[str], work: Path) -> list[dict]:
    """The steps to run: name, command, time limit and the files each writes."""
    py = sys.executable
    cmds = {
        "tests": [py, "-m", "pytest", "tests/gpu", "-v", "-rA", "-p", "no:cacheprovider",
                  f"--junitxml={work / 'junit.xml'}"],
        "report": [py, str(Path(__file__).resolve()), "--report-json", str(work / "report.json")],
        "bench": [py, "-m", "chatlearn_mem_ray", "bench", "--config", "gpu", *BENCH_OVERRIDES,
                  f"output_dir={out}", f"name={stem}", "-q"],
        "ppo": [py, "-m", "chatlearn_mem_ray", "ppo", "--config", "gpu", *PPO_OVERRIDES,
                f"output_dir={out / (stem + '_ppo')}"],
    }
    outputs = {"tests": [], "report": [], "bench": [out / f"{stem}.{x}" for x in ("json", "md", "png")],
               "ppo": [out / f"{stem}_ppo" / "log.json", out / f"{stem}_ppo" / "memory_timeline.png"]}
    return [{"step": s, "command": cmds[s], "timeout_s": TIMEOUTS_S[s], "outputs": [str(p) for p in outputs[s]]}
            for s in steps]


def _resolve_configs() -> dict:
    """The benchmark and PPO configs the GPU run uses, validated (raises ConfigError)."""
    from chatlearn_mem_bench.config import load_config as bench_config
    from chatlearn_mem_ray.config import load_config as ppo_config

    bench = bench_config("gpu", list(BENCH_OVERRIDES))
    ppo = ppo_config("gpu", list(PPO_OVERRIDES))
    return {"bench": bench.model_dump(mode="json"), "ppo": json.loads(ppo.model_dump_json())}


IMPORTS = ("torch", "numpy", "yaml", "typer", "matplotlib", "psutil", "pytest", "pydantic", "megatron.core",
           "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.distributed", "megatron.core.optimizer",
           "chatlearn_mem", "chatlearn_mem.testbed.gpt", "chatlearn_mem_bench.run", "chatlearn_mem_bench.report",
           "chatlearn_mem_ray.cli", "chatlearn_mem_ray.ppo", "ray")
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
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "tests/gpu"], cwd=REPO, capture_output=True, text=True, timeout=120)
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
    from chatlearn_mem.testbed import gpt

    if cfg is None:
        from chatlearn_mem_ray.config import load_config as ppo_config

        cfg = ppo_config("gpu", list(PPO_OVERRIDES)).policy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if not torch.distributed.is_initialized():
            import tempfile

            gpt.init_distributed(init_method=f"file://{tempfile.mkdtemp()}/init")
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
    return {"trainer": cfg.model_dump(mode="json"),
            "parameters": sum(p.numel() for p in trainer.model.parameters()),
            "managed_bytes": before.by_holder["manager_residue"], "audit_ok": mm.audit().ok,
            "before_offload": before.to_dict(), "after_offload": after.to_dict(), "text": after.format()}


# -- running and summarising ------------------------------------------------------------------------
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
        out.append({"test": f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}",
                    "outcome": outcome, "seconds": float(case.get("time") or 0), "message": message})
    return out


def summarise(results: dict) -> str:
    """The markdown of a validation run."""
    env = results.get("environment", {})
    lines = [f"# chatlearn-mem GPU validation, {results['date']}", "",
             f"Produced by `{results['command']}` (git {results.get('git_revision') or 'unknown'}).", "",
             f"- GPU: {env.get('gpu_name', '?')} ({env.get('gpu_memory_bytes', 0) / 2**30:.1f} GiB), "
             f"driver {env.get('driver', '?')}; torch {env.get('torch', '?')} (CUDA {env.get('torch_cuda', '?')}), "
             f"megatron-core {env.get('megatron_core', '?')}, Python {env.get('python', '?')}",
             "", "## Steps", "", "| step | status | seconds | detail |", "|---|---|---:|---|"]
    for s in results["steps"]:
        lines.append(f"| {s['step']} | {s['status']} | {s.get('seconds', 0):.0f} | {s.get('detail', '')} |")
    tests = results.get("tests", [])
    if tests:
        lines += ["", "## GPU tests", "", "| test | outcome | seconds | message |", "|---|---|---:|---|"]
        for t in tests:
            msg = t["message"].replace("|", "/").replace("\n", " ")[:200]
            lines.append(f"| {t['test']} | {t['outcome']} | {t['seconds']:.1f} | {msg} |")
    report = results.get("report")
    if report:
        lines += ["", "## What stays on the device after a full offload", "",
                  f"Trainer: {report['parameters'] / 1e6:.0f} M parameters, {report['managed_bytes'] / 2**30:.2f} GiB "
                  f"managed; audit after the cycle ok: {report['audit_ok']}.", "", "```", report["text"], "```"]
    targets = results.get("bench_targets")
    if targets:
        met = sum(t["passed"] for t in targets)
        lines += ["", f"## Benchmark targets ({met} of {len(targets)} met)", "", "| target | result | detail |",
                  "|---|---|---|"]
        lines += [f"| {t['name']} | {'PASS' if t['passed'] else 'MISS'} | {t['detail']} |" for t in targets]
    ppo = results.get("ppo")
    if ppo:
        lines += ["", "## Colocated PPO on one GPU", ""]
        for key in ("memory_manager_on", "memory_manager_off"):
            s = ppo["summary"].get(key)
            if s:
                lines.append(f"- {key.replace('_', ' ')}: peak colocated {s['peak_colocated_bytes'] / 2**30:.2f} GiB "
                             f"({s['peak_phase']}) / largest phase {s['largest_phase_bytes'] / 2**30:.2f} GiB "
                             f"({s['largest_phase']}) = {s['ratio']:.3f}")
        lines.append(f"- {ppo['iterations']} iterations in {ppo['summary'].get('seconds', 0):.0f} s; "
                     f"weight syncs verified: {ppo['sync_ok']}; audits clean: {ppo['audits_ok']}")
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
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}_validation.{x}" for x in ("json", "md", "png")]
    paths[0].write_text(json.dumps(results, indent=1) + "\n")
    paths[1].write_text(summarise(results))
    plot_summary(results, paths[2])
    return paths


def _collect(step: str, results: dict, work: Path, entry: dict) -> None:
    """Read what a finished step wrote into ``results``."""
    if step == "tests":
        results["tests"] = _junit(work / "junit.xml")
        bad = [t for t in results["tests"] if t["outcome"] in ("failed", "error")]
        if bad:
            entry["status"] = "failed"
        counts = {o: sum(t["outcome"] == o for t in results["tests"]) for o in ("passed", "failed", "error", "skipped")}
        entry["detail"] = ", ".join(f"{n} {o}" for o, n in counts.items() if n)
    elif step == "report" and (work / "report.json").exists():
        results["report"] = json.loads((work / "report.json").read_text())
        entry["detail"] = f"{results['report']['after_offload']['total_bytes'] / 2**20:.0f} MiB still held after offload"
    elif step == "bench":
        path = Path(entry["outputs"][0])
        if path.exists():
            bench = json.loads(path.read_text())
            results["bench_targets"] = bench["targets"]
            results["bench_timings"] = [{k: r[k] for k in ("part", "method", "direction", "gb_per_s")}
                                        for r in bench["timings"]]
            met = sum(t["passed"] for t in bench["targets"])
            entry["detail"] = f"{met} of {len(bench['targets'])} targets met; methods {', '.join(bench['methods'])}"
    elif step == "ppo":
        path = Path(entry["outputs"][0])
        if path.exists():
            log = json.loads(path.read_text())
            audits = log.get("audits") or {}
            results["ppo"] = {"summary": log["summary"], "iterations": len(log["iterations"]),
                              "sync_ok": all(c.get("equal", False) for c in log.get("sync_checks", [])),
                              "audits_ok": audits.get("runs") == audits.get("checks_clean"), "audits": audits}
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
        env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=30).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["driver"] = None
    return env


def run(args, steps: list[str]) -> int:
    """The GPU run: every step in turn, results written after each."""
    import tempfile

    import torch

    if not torch.cuda.is_available():  # the first CUDA call
        _say("error: no CUDA device here (torch.cuda.is_available() is False). Run it on the GPU machine, "
             "or check the setup with --dry-run")
        return 2
    from chatlearn_mem_bench.measure import git_revision

    env = _environment()
    date = _dt.date.today().isoformat()
    stem = f"{date}_{gpu_slug(env['gpu_name'])}"
    out = Path(args.out)
    results = {"date": date, "command": shlex.join(sys.argv), "git_revision": git_revision(),
               "environment": env, "steps": [], "budget_s": args.budget_s}
    started = time.monotonic()
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for entry in plan(out, stem, steps, work):
            step = entry["step"]
            left = args.budget_s - (time.monotonic() - started)
            entry = {**entry, "command": shlex.join(entry["command"])}
            if left < MIN_S[step]:
                entry.update(status="skipped", detail=f"time budget: {left:.0f} s left, needs {MIN_S[step]} s")
                results["steps"].append(entry)
                ok = False
                continue
            timeout = min(entry["timeout_s"], left)
            _say(f"step {step}: {entry['command']} (limit {timeout:.0f} s)")
            t0 = time.monotonic()
            try:
                proc = subprocess.run(shlex.split(entry["command"]), cwd=REPO, timeout=timeout,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                text, status = proc.stdout, ("ok" if proc.returncode == 0 else f"exit {proc.returncode}")
            except subprocess.TimeoutExpired as e:
                text = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
                status = f"timed out after {timeout:.0f} s"
            print(text[-6000:], flush=True)
            entry.update(status=status, seconds=time.monotonic() - t0, output_tail=text[-4000:])
            _collect(step, results, work, entry)
            ok = ok and entry["status"] == "ok"
            results["steps"].append(entry)
            write_results(results, out, stem)
            _say(f"step {step}: {entry['status']} in {entry['seconds']:.0f} s {entry.get('detail', '')}")
    paths = write_results(results, out, stem)
    for p in paths:
        _say(f"wrote {p}")
    for t in results.get("bench_targets", []):
        _say(f"{'PASS' if t['passed'] else 'MISS'}  {t['name']}: {t['detail']}")
    _say("all steps ran, every GPU test passed or was skipped" if ok else "some steps failed: see the table above")
    return 0 if ok else 1


def dry_run(args, steps: list[str]) -> int:
    """Everything up to the first CUDA call."""
    problems = []
    _say(f"dry run: Python {sys.version.split()[0]} ({'3.12 like' if sys.version_info[:2] == (3, 12) else 'not'} "
         "the GPU machine's)")
    if args.wheelhouse:
        wh = check_wheelhouse(Path(args.wheelhouse))
        problems += [f"wheelhouse {args.wheelhouse}: {p}" for p in wh]
        if not wh:
            size = sum(p.stat().st_size for p in Path(args.wheelhouse).iterdir())
            _say(f"wheelhouse {args.wheelhouse}: complete, {size / 2**20:.1f} MiB")
    else:
        _say("wheelhouse: not checked (no --wheelhouse)")
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            configs = _resolve_configs()
        b, p = configs["bench"], configs["ppo"]
        _say(f"bench config: preset gpu + {' '.join(BENCH_OVERRIDES)}: {b['trainer']['num_layers']} layers x "
             f"{b['trainer']['hidden_size']}, vocab {b['trainer']['vocab_size']}, repeats {b['repeats']}, "
             f"cycles {b['cycles']}, methods {', '.join(b['methods'])}")
        _say(f"ppo config: preset gpu + {' '.join(PPO_OVERRIDES)}: {p['parallel']['world_size']} rank(s), "
             f"{p['ppo']['iterations']} iterations, policy {p['policy']['num_layers']} layers x "
             f"{p['policy']['hidden_size']}")
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
    _say(f"plan ({len(steps)} steps, time budget {args.budget_s} s; outputs under {out}):")
    for entry in plan(out, stem, steps, Path("<tmp>")):
        _say(f"  {entry['step']} (limit {entry['timeout_s']} s): {shlex.join(entry['command'])}")
        for o in entry["outputs"]:
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
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="seconds for all steps; a step with too little left is skipped (default 540)")
    parser.add_argument("--report-json", default=None, help=argparse.SUPPRESS)  # the report step's own process
    args = parser.parse_args(argv)
    if args.report_json:
        Path(args.report_json).write_text(json.dumps(measure_device_report(), indent=1))
        print(json.loads(Path(args.report_json).read_text())["text"])
        return 0
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    bad = [s for s in steps if s not in STEPS]
    if bad or not steps:
        parser.error(f"unknown step(s) {bad}; steps are {', '.join(STEPS)}")
    os.chdir(REPO)
    return dry_run(args, steps) if args.dry_run else run(args, steps)


if __name__ == "__main__":
    sys.exit(main())
