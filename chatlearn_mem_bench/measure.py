"""Timing statistics, memory snapshots, library versions and hardware of a run."""

from __future__ import annotations

import os
import platform
import re
import time
from importlib import metadata
from typing import Callable

import psutil
import torch

__all__ = [
    "host_bandwidths",
    "percentile",
    "git_revision",
    "stats",
    "timed",
    "compare",
    "memory_snapshot",
    "versions",
    "hardware",
    "hardware_slug",
]


def percentile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (0 <= q <= 1), linear between the nearest two samples."""
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def stats(xs: list[float]) -> dict:
    """Median, quartiles (IQR = the spread used for noise calls), min, max, n."""
    return {
        "median": percentile(xs, 0.5),
        "q25": percentile(xs, 0.25),
        "q75": percentile(xs, 0.75),
        "min": min(xs),
        "max": max(xs),
        "n": len(xs),
    }


def timed(fn: Callable[[], int], device: torch.device) -> tuple[float, int]:
    """Wall time of ``fn()`` (device synchronised before and after) and what it returned."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, out


def host_bandwidths(nbytes: int = 256 * 2**20, repeats: int = 5) -> dict:
    """Two host bandwidths the time estimate scales by, GB/s (medians of ``repeats``): ``copy``, one
    copy between touched buffers (the CPU's ceiling), and ``fresh``, touching fresh pages (page
    faults, the kernel zeroing each page): a copy into a buffer allocated just before, less the
    plain copy. What every allocation a method makes anew, and on CPU every regrow, costs."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    warm = torch.zeros(nbytes, dtype=torch.uint8)
    fresh, reused = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.empty(nbytes, dtype=torch.uint8).copy_(src)
        fresh.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        warm.copy_(src)
        reused.append(time.perf_counter() - t0)
    copy_s = stats(reused)["median"]
    return {"copy": nbytes / copy_s / 1e9, "fresh": nbytes / max(stats(fresh)["median"] - copy_s, 1e-9) / 1e9}


def compare(manager: dict, other: dict) -> str:
    """``faster`` / ``slower`` when the manager's interquartile range lies wholly below / above
    the other's; otherwise ``noise`` (the difference is within the measured spread)."""
    if manager["q75"] < other["q25"]:
        return "faster"
    if manager["q25"] > other["q75"]:
        return "slower"
    return "noise"


def memory_snapshot(device: torch.device) -> dict:
    """Process RSS, and on CUDA allocated/reserved device bytes and the caching host allocator's
    pinned bytes when torch reports them."""
    snap = {"rss_bytes": psutil.Process().memory_info().rss}
    if device.type == "cuda":
        snap["cuda_allocated_bytes"] = torch.cuda.memory_allocated(device)
        snap["cuda_reserved_bytes"] = torch.cuda.memory_reserved(device)
        host_stats = getattr(torch.cuda.memory, "host_memory_stats", None)
        if host_stats is not None:
            try:
                snap["cuda_host_allocator_bytes"] = int(host_stats().get("allocated_bytes.current", 0))
            except Exception:  # noqa: BLE001 - optional statistic
                pass
    return snap


def git_revision(path: str | os.PathLike | None = None) -> str | None:
    """``HEAD`` of the git checkout at ``path`` (default: the one this package runs from), with
    ``+dirty`` for uncommitted changes; None outside a checkout (an installed wheel, a copy of the
    tree without ``.git``): pass the revision in then (``BenchConfig.revision``)."""
    import subprocess

    here = os.fspath(path) if path is not None else os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("+dirty" if dirty else "")


def versions() -> dict:
    out = {"python": platform.python_version()}
    for dist in ("torch", "megatron-core", "chatlearn-mem", "pydantic", "numpy", "matplotlib", "psutil", "PyYAML"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    out["torch_cuda"] = torch.version.cuda
    return out


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def hardware(device: torch.device) -> dict:
    hw = {
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_total_bytes": psutil.virtual_memory().total,
        "torch_num_threads": torch.get_num_threads(),
        "transparent_hugepage": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE"),
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "device": str(device),
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        hw.update(gpu_name=p.name, gpu_memory_bytes=p.total_memory, gpu_count=torch.cuda.device_count())
    return hw


def hardware_slug(hw: dict) -> str:
    """Short file-name tag, e.g. ``cpu-2core-xeon-2.50ghz-24gib`` or ``gpu-nvidia-h100-80gb-hbm3``."""
    if hw["device"].startswith("cuda"):
        return "gpu-" + re.sub(r"[^a-z0-9.]+", "-", hw["gpu_name"].lower()).strip("-")
    model = hw["cpu_model"].lower()
    words = [
        w
        for w in re.split(r"[^a-z0-9.]+", model)
        if w and w not in ("intel", "r", "tm", "processor", "cpu", "amd", "core", "with", "graphics")
    ]
    name = "-".join(words[:3]) or "cpu"
    gib = round(hw["memory_total_bytes"] / 2**30)
    return f"cpu-{hw['cpu_count']}core-{name}-{gib}gib"
