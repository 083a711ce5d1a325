"""The steps that run ``chatlearn-mem bench`` (``tms``, ``large``, ``bench``): each one's command and
files, how its results are read into the summary (a run cut off by its budget included), and its
sections of the summary: the manager against its peers, the largest trainer's full cycle, targets."""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = [
    "BENCH_STEPS",
    "bench_stem",
    "collect",
    "command",
    "large_lines",
    "outputs",
    "targets_lines",
    "versus_lines",
]

BENCH_STEPS = {"tms": "gpu_tms", "large": "gpu_large", "bench": "gpu"}
"""Steps that run ``chatlearn-mem bench``, and their presets (configs/bench/)."""


def bench_stem(stem: str, step: str) -> str:
    """The file stem of a bench step's results: ``<stem>`` for ``bench`` (as every earlier run),
    ``<stem>_<step>`` for the others."""
    return stem if step == "bench" else f"{stem}_{step}"


def command(step: str, out: Path, stem: str, revision: str) -> list[str]:
    """``chatlearn-mem bench`` on the step's preset, its results under ``out`` named after the GPU."""
    return [
        sys.executable,
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


def outputs(step: str, out: Path, stem: str) -> list[Path]:
    """The benchmark's JSON (first: what :func:`collect` reads), markdown and plot."""
    return [out / f"{bench_stem(stem, step)}.{x}" for x in ("json", "md", "png")]


def collect(step: str, results: dict, entry: dict) -> None:
    """A bench step's results (its JSON; its markdown and plot rebuilt from it when it was cut off)
    into ``results["benches"][step]``, and the step's detail; a run that wrote everything and was
    stopped while exiting counts as done."""
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


def versus_lines(bench) -> list[str]:
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


def large_lines(bench) -> list[str]:
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


def targets_lines(results: dict) -> list[str]:
    """Each bench step's targets; for ``bench``, its planned host memory and time beside what it took."""
    lines = []
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
    return lines
