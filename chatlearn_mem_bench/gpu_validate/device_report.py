"""The ``report`` step: what stays on the device after a full offload of the PPO preset's policy
trainer, by the allocator and by NVML, with and without the release of idle memory, what that
release costs the next training step, and the target (the CUDA context plus 1% of the awake state);
with NCCL's figures (:mod:`~chatlearn_mem_bench.gpu_validate.nccl`). Runs in a process of its own
(:func:`main`, ``--report-json``); here too how its JSON is read and its section of the summary."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from chatlearn_mem_bench.gpu_validate.nccl import measure_nccl, measure_teardown

__all__ = ["SLEEP_SHARE", "collect", "command", "lines", "main", "measure_device_report", "outputs", "sleep_target"]

SLEEP_SHARE = 0.01
"""Target: after a full offload the trainer process holds no more than its CUDA context plus this
share of its awake state, by NVML (issue 52)."""


def command(work: Path) -> list[str]:
    """The step's own process: this package with ``--report-json``."""
    return [sys.executable, "-m", "chatlearn_mem_bench.gpu_validate", "--report-json", str(work / "report.json")]


def outputs(work: Path) -> list[Path]:
    return [work / "report.json"]


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
    default, :func:`~chatlearn_mem_bench.gpu_validate.ppo.policy_config`), by the allocator and by
    NVML, with and without the release of idle memory; what that release costs the next training
    step; and (``nccl``) what a NCCL communicator holds and how fast one comes back
    (:func:`~chatlearn_mem_bench.gpu_validate.nccl.measure_nccl`, in a process of its own). Works on
    CPU too: the walk is then the whole report and the driver's figures say "not measured here: no
    CUDA".

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
        from chatlearn_mem_bench.gpu_validate.ppo import policy_config

        cfg = policy_config()
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


def main(path: Path) -> None:
    """The step's process: the report written to ``path`` after each stage (kept if what follows
    hangs), NCCL's figures in a process of their own, then every process group torn down; the
    process ends at once, whatever the teardown left behind."""
    from chatlearn_mem.models import gpt

    path = Path(path)
    with gpt.owned_process_group():  # destroyed before exit: a NCCL group left to it holds it up
        report = measure_device_report(nccl=False)
        path.write_text(json.dumps(report, indent=1))
        print(report["text"])
        if "target" in report:  # CUDA: what a NCCL communicator holds, in a process of its own
            report["nccl"] = measure_nccl()
            path.write_text(json.dumps(report, indent=1))
            print(f"NCCL: {report['nccl']}")
            report["teardown"] = measure_teardown()  # every group of this process, destroyed
            path.write_text(json.dumps(report, indent=1))
            print(f"teardown: {report['teardown']}")
    gpt.exit_process(0)  # at once when the process group's teardown hung


def collect(results: dict, work: Path, entry: dict) -> None:
    """``report.json`` into ``results["report"]``; the detail says what stayed and the target."""
    if not (work / "report.json").exists():
        return
    results["report"] = json.loads((work / "report.json").read_text())
    entry["detail"] = f"{results['report']['after_offload']['total_bytes'] / 2**20:.0f} MiB still held after offload"
    target = results["report"].get("target")
    if target:
        entry["detail"] += f"; {'PASS' if target['passed'] else 'MISS'}: {target['detail']}"


def _mib(n) -> str:
    return f"{n / 2**20:.0f}" if n is not None else "-"


def lines(results: dict) -> list[str]:
    """The summary's section: the trainer, the process view before and after a full offload, the
    release and its cost, the target, NCCL, and the device report's own text."""
    report = results.get("report")
    if not report:
        return []
    return [
        "",
        "## What stays on the device after a full offload",
        "",
        f"Trainer: {report['parameters'] / 1e6:.0f} M parameters, {report['managed_bytes'] / 2**30:.2f} GiB "
        f"managed; audit after the cycle ok: {report['audit_ok']}.",
        *_process_lines(report),
        *_release_lines(report),
        *_nccl_lines(report),
        "",
        "```",
        report["text"],
        "```",
    ]


def _process_lines(report: dict) -> list[str]:
    """The process view before and after a full offload: held, allocated, reserved, outside."""
    rows = [
        ("awake", report.get("before_offload")),
        ("asleep, idle memory kept", report.get("after_offload_kept")),
        ("asleep, idle memory released", report.get("after_offload_released")),
        ("asleep, the default offload", report.get("after_offload")),
    ]
    if not any(r and r.get("process") for _, r in rows):
        return []
    lines = [
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
    return lines


def _release_lines(report: dict) -> list[str]:
    """The release of idle memory and its cost to the next step, then the target."""
    lines = []
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
    return lines


def _nccl_lines(report: dict) -> list[str]:
    """The teardown of the report's process groups and one NCCL communicator's figures."""
    lines = []
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
