"""The GPU run: every chosen step in turn, each a fresh process in its own process group within
what is left of the time budget (a step that ends early leaves its unused seconds to the next),
its results read and the summary rewritten after each."""

from __future__ import annotations

import datetime as _dt
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from chatlearn_mem_bench.gpu_validate import checkout
from chatlearn_mem_bench.gpu_validate.bounds import check_bounds
from chatlearn_mem_bench.gpu_validate.steps import MIN_STEP_S, collect, gpu_slug, plan
from chatlearn_mem_bench.gpu_validate.summary import write_results

__all__ = ["command_line", "run", "say"]


def command_line() -> str:
    """This run's command as a user types it (``python -m chatlearn_mem_bench.gpu_validate ...``)."""
    return shlex.join(["python", "-m", "chatlearn_mem_bench.gpu_validate", *sys.argv[1:]])


def say(line: str) -> None:
    """One line of the validation's own output."""
    print(f"[gpu-validate] {line}", flush=True)


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
            cwd=checkout.REPO,
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


def _step(entry: dict, limit: float, results: dict, work: Path) -> dict:
    """Run one planned step within ``limit`` seconds (or skip it when too few are left) and read
    its results; returns the entry as the summary records it."""
    step = entry["step"]
    entry = {**entry, "command": shlex.join(entry["command"]), "limit_s": max(0.0, limit)}
    if limit < MIN_STEP_S:
        entry.update(status="skipped", detail=f"time budget: {limit:.0f} s left for it")
        return entry
    say(f"step {step}: {entry['command']} (limit {limit:.0f} s, output in {entry['log']})")
    t0 = time.monotonic()
    status, text = _run_step(shlex.split(entry["command"]), Path(entry["log"]), limit, entry.get("env"))
    print(text[-6000:], flush=True)
    entry.update(status=status, seconds=time.monotonic() - t0, ended_at=time.time(), output_tail=text[-4000:])
    collect(step, results, work, entry)
    say(f"step {step}: {entry['status']} in {entry['seconds']:.0f} s {entry.get('detail', '')}")
    return entry


def _say_targets(results: dict) -> None:
    for step, bench in results.get("benches", {}).items():
        for t in bench["targets"]:
            say(f"{step}: {'PASS' if t['passed'] else 'MISS'}  {t['name']}: {t['detail']}")
    target = (results.get("report") or {}).get("target")
    if target:
        say(f"report: {'PASS' if target['passed'] else 'MISS'}  {target['name']}: {target['detail']}")


def run(args, steps: list[str]) -> int:
    """The GPU run: every step in turn within the time budget, results written after each.
    Returns the exit status: 0 when every required step ran and passed, 1 otherwise, 2 for a
    setup problem (no CUDA, no source revision)."""
    import torch

    if not torch.cuda.is_available():  # the first CUDA call
        say(
            "error: no CUDA device here (torch.cuda.is_available() is False). Run it on the GPU machine, "
            "or check the setup with --dry-run"
        )
        return 2
    revision, source = checkout.source_revision(args.revision, args.wheelhouse)
    if not revision:
        say(
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
        "command": command_line(),
        "git_revision": revision,
        "revision_source": source,
        "environment": env,
        "steps": [],
        "budget_s": args.budget_s,
    }
    say(f"revision {revision} (from {source}); logs under {work}")
    for line in check_bounds(steps, args.budget_s)[0]:
        say(line)
    started = time.monotonic()
    ok = True
    entries = plan(out, stem, steps, work, revision)
    for i, entry in enumerate(entries):
        later = sum(e["budget_s"] for e in entries[i + 1 :])
        limit = args.budget_s - (time.monotonic() - started) - later  # unused seconds roll forward
        entry = _step(entry, limit, results, work)
        ok = ok and (entry["status"] == "ok" or entry["optional"])
        results["steps"].append(entry)
        write_results(results, out, stem)
    for p in write_results(results, out, stem):
        say(f"wrote {p}")
    _say_targets(results)
    say(
        "every required step ran, every GPU test passed or was skipped"
        if ok
        else "some steps failed: see the table above"
    )
    return 0 if ok else 1
