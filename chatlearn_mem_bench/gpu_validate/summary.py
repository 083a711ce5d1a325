"""The validation's own results, ``<stem>_validation.{json,md,png}``: every step's status and
detail, then each step's section (from the step's module), and a plot of what stays on the device
beside the benchmark's throughput. Rewritten after every step."""

from __future__ import annotations

from pathlib import Path

from chatlearn_mem_bench.gpu_validate import benches, device_report, gpu_tests, ppo
from chatlearn_mem_bench.gpu_validate.steps import TOTAL_BUDGET_S

__all__ = ["plot_summary", "summarise", "write_results"]


def _header(results: dict) -> list[str]:
    env = results.get("environment", {})
    return [
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
    ]


def _steps_lines(results: dict) -> list[str]:
    lines = [
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
    return lines


def summarise(results: dict) -> str:
    """The markdown of a validation run."""
    benched = results.get("benches", {})
    lines = [
        *_header(results),
        *_steps_lines(results),
        *gpu_tests.tests_lines(results),
        *benches.versus_lines(benched.get("tms")),
        *device_report.lines(results),
        *gpu_tests.handoff_lines(results),
        *benches.large_lines(benched.get("large")),
        *benches.targets_lines(results),
        *ppo.lines(results),
    ]
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
