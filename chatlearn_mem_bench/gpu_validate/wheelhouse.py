"""The wheelhouse the GPU machine installs (``.whl/``, filled by ``scripts/gpu_wheelhouse.sh``):
every distribution it lacks, one wheel each, for CPython 3.12 on x86-64 Linux, Ray repacked, the
source revision the project's wheel was built from, all within what one device call carries."""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

from chatlearn_mem_bench.gpu_validate import checkout
from chatlearn_mem_bench.gpu_validate.benches import BENCH_STEPS

__all__ = ["CARRY_LIMIT", "MEGATRON_VERSION", "RAY_ARCHIVE", "WHEELHOUSE_LIMIT", "WHEELS", "check_wheelhouse"]

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
"""Bytes one device call carries, the repository included."""
WHEELHOUSE_LIMIT = 60 * 2**20
"""The wheelhouse's share of :data:`CARRY_LIMIT` (the rest is the repository itself)."""
PRESETS_SHIPPED = (
    *(f"chatlearn_mem_bench/presets/{preset}.yaml" for preset in BENCH_STEPS.values()),
    "chatlearn_mem_ray/presets/gpu.yaml",
)
"""Presets the GPU run reads, which the project's wheel must hold."""


def _dist_name(filename: str) -> str:
    return filename.split("-")[0].lower().replace(".", "_")


def _tag_problems(wheel: str) -> list[str]:
    """A wheel that is not for CPython 3.12 on x86-64 Linux (abi3 wheels of cp39-cp312 serve 3.12 too)."""
    py, abi, plat = wheel[:-4].split("-")[-3:]
    abi3 = abi == "abi3" and py.startswith("cp3") and py[3:].isdigit() and int(py[3:]) <= 12
    problems = []
    if not (py in ("py3", "py2.py3", "cp312") or py.startswith("cp312") or abi3):
        problems.append(f"{wheel} is not for CPython 3.12 (tag {py})")
    if plat != "any" and "x86_64" not in plat:
        problems.append(f"{wheel} is not for x86-64 Linux (platform {plat})")
    return problems


def _own_wheel_problems(path: Path, wheel: str) -> list[str]:
    """The project's wheel: this checkout's version, with the presets the GPU run reads."""
    problems = []
    version = checkout.repo_version()
    if f"-{version}-" not in wheel:
        problems.append(f"{wheel} is not this checkout's version {version}: rebuild it")
    try:
        names = zipfile.ZipFile(path / wheel).namelist()
    except zipfile.BadZipFile:
        names = []
    problems += [f"{wheel} lacks {needed}" for needed in PRESETS_SHIPPED if needed not in names]
    return problems


def _revision_problems(path: Path) -> list[str]:
    """No ``REVISION``, or one of another commit than this checkout's."""
    built_from, here = checkout.wheelhouse_revision(path), checkout.checkout_revision()
    if not built_from:
        return [
            f"no {checkout.REVISION_FILE} file (the source revision the wheel was built from): run "
            "`bash scripts/gpu_wheelhouse.sh` again"
        ]
    if here and here.split("+")[0] != built_from.split("+")[0]:
        return [f"built from {built_from}, but this checkout is at {here}: run `bash scripts/gpu_wheelhouse.sh` again"]
    return []


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
        problems += _tag_problems(w)
    mc = by_dist.get("megatron_core", [])
    if len(mc) == 1 and f"-{MEGATRON_VERSION}-" not in mc[0]:
        problems.append(f"{mc[0]}: the GPU run uses megatron-core {MEGATRON_VERSION}")
    ours = by_dist.get("chatlearn_mem", [])
    if len(ours) == 1:
        problems += _own_wheel_problems(path, ours[0])
    rays = [f for f in files if RAY_ARCHIVE.match(f)]
    if len(rays) != 1:
        problems.append(f"want one ray-<version>-cp312-pruned.tar.xz, found {rays or 'none'}")
    problems += _revision_problems(path)
    unknown = [f for f in files if f not in wheels and f not in rays and f != checkout.REVISION_FILE]
    if unknown:
        problems.append(f"files that are neither wheels nor the Ray archive: {', '.join(unknown)}")
    total = sum((path / f).stat().st_size for f in files)
    if total > WHEELHOUSE_LIMIT:
        problems.append(
            f"{total / 2**20:.1f} MiB: more than {WHEELHOUSE_LIMIT / 2**20:.0f} MiB, which leaves too "
            f"little of the {CARRY_LIMIT / 2**20:.0f} MiB one device call carries for the repository"
        )
    return problems
