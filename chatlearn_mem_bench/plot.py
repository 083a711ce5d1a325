"""The benchmark's picture: throughput of every method per part and direction, against the ceiling."""

from __future__ import annotations

from pathlib import Path

from chatlearn_mem_bench.config import PARTS

__all__ = ["plot"]

MiB = 2**20


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(res["methods"])
    groups = [(p, d) for p in PARTS for d in ("offload", "onload")]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(13, 9))
    width = 0.8 / len(methods)
    for i, meth in enumerate(methods):
        xs, ys, lo, hi = [], [], [], []
        for g, (p, d) in enumerate(groups):
            r = next(
                (r for r in res["timings"] if r["part"] == p and r["direction"] == d and r["method"] == meth), None
            )
            if r is None:
                continue
            s = r["seconds"]
            xs.append(g + (i - (len(methods) - 1) / 2) * width)
            ys.append(s["median"] * 1e3)
            lo.append((s["median"] - s["q25"]) * 1e3)
            hi.append((s["q75"] - s["median"]) * 1e3)
        ax1.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=meth)
    ax1.set_xticks(range(len(groups)), [f"{p}\n{d}" for p, d in groups], fontsize=8)
    ax1.set_ylabel("wall time, ms (median, IQR bars)")
    ax1.set_yscale("log")
    ax1.set_title(
        f"Time per part per method ({res['hardware'].get('gpu_name') or res['hardware']['cpu_model']})"
        + ("" if res.get("complete", True) else f"; missing: {', '.join(res.get('missing_parts', []))}")
    )
    ax1.legend(fontsize=8)

    cuda = any("cuda_allocated_bytes" in x for x in res["memory"])
    stages = ("before", "after_offload", "after_onload")
    parts = [p for p in PARTS if any(x["part"] == p and x["method"] == "manager" for x in res["memory"])]
    key = "cuda_reserved_bytes" if cuda else "device_bytes"
    width = 0.8 / len(stages)
    for i, stage in enumerate(stages):
        ys = [
            next(x for x in res["memory"] if x["part"] == p and x["method"] == "manager" and x["stage"] == stage)[key]
            / MiB
            for p in parts
        ]
        ax2.bar([j + (i - 1) * width for j in range(len(parts))], ys, width, label=f"device, {stage}")
    mem = {(x["part"], x["method"], x["stage"]): x for x in res["memory"]}
    rss = [mem[(p, "manager", "after_offload")]["rss_bytes"] / MiB for p in parts]
    ax2.plot(range(len(parts)), rss, "k.--", label="process RSS after offload")
    ax2.set_xticks(range(len(parts)), parts)
    ax2.set_ylabel("MiB")
    ax2.set_title("Manager: memory per stage (" + ("CUDA reserved" if cuda else "residency() device bytes") + ")")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
