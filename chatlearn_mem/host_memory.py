"""How much host memory the process can still use, read the way the kernel will enforce it.

An offload that allocates more host memory than the machine (or the container) can give ends
with the Linux OOM killer, which kills the process without a word. The managers therefore check,
before anything changes, that the host buffers an offload will newly allocate fit in
:func:`usable_host_memory` minus ``MemoryConfig.host_memory_margin_mb``.

Sources, the smallest wins:

* the cgroup memory limit of the process and of each cgroup above it: v2 ``memory.max`` minus
  ``memory.current``, v1 ``memory.limit_in_bytes`` minus ``memory.usage_in_bytes``; the
  reclaimable page cache (``inactive_file`` in ``memory.stat``) counts as free, as it does for
  the kernel and for the kubelet's working set;
* ``MemAvailable`` in ``/proc/meminfo`` (what the kernel estimates it can give without swapping).

No psutil needed; on a system with none of these files the check is skipped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

__all__ = ["HostMemory", "usable_host_memory"]

# Paths read at call time (tests point them at a fake tree).
_CGROUP_ROOT = "/sys/fs/cgroup"
_SELF_CGROUP = "/proc/self/cgroup"
_MEMINFO = "/proc/meminfo"
_UNLIMITED = 2**60  # v1 reports "no limit" as a huge page-rounded number (2**63 - 4096)


@dataclass(frozen=True)
class HostMemory:
    """Host memory the process can still allocate.

    Attributes:
        nbytes: The smallest of the sources below; None when no source could be read.
        sources: ``(description, bytes)`` of each source read, for error messages.
    """

    nbytes: Optional[int]
    sources: tuple[tuple[str, int], ...] = field(default=())

    def describe(self) -> str:
        """The sources as one line: ``cgroup v2 /sys/fs/cgroup: 3.0 GiB free; MemAvailable 12.1 GiB``."""
        return "; ".join(f"{what} {gib(n)}" for what, n in self.sources) or "no source readable"


def gib(nbytes: int) -> str:
    """``nbytes`` as ``"1.23 GiB"``."""
    return f"{nbytes / 2**30:.2f} GiB"


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _inactive_file(directory: str) -> int:
    """Reclaimable page cache of a cgroup (``inactive_file`` / v1 ``total_inactive_file``)."""
    found = {}
    try:
        with open(os.path.join(directory, "memory.stat")) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key in ("inactive_file", "total_inactive_file"):
                    found[key] = int(value)
    except (OSError, ValueError):
        return 0
    return found.get("total_inactive_file", found.get("inactive_file", 0))


def _own_cgroup_paths() -> list[tuple[str, str]]:
    """``(version, path inside the hierarchy)`` of this process's memory cgroups."""
    out = []
    try:
        with open(_SELF_CGROUP) as f:
            for line in f:
                parts = line.strip().split(":", 2)
                if len(parts) != 3:
                    continue
                _, controllers, path = parts
                if controllers == "":
                    out.append(("v2", path))
                elif "memory" in controllers.split(","):
                    out.append(("v1", path))
    except OSError:
        pass
    return out


def _candidate_dirs(version: str, path: str, root: str) -> list[str]:
    """The cgroup's directory and its ancestors (inside a container the hierarchy is often
    mounted at the cgroup itself, so the root directory is a candidate too)."""
    base = root if version == "v2" else os.path.join(root, "memory")
    dirs, rel = [], path.strip("/")
    while rel:
        dirs.append(os.path.join(base, rel))
        rel = os.path.dirname(rel)
    dirs.append(base)
    return [d for d in dirs if os.path.isdir(d)]


def _cgroup_room() -> list[tuple[str, int]]:
    root = _CGROUP_ROOT
    out = []
    seen = set()
    for version, path in _own_cgroup_paths() or [("v2", "/"), ("v1", "/")]:
        limit_file, usage_file = (
            ("memory.max", "memory.current") if version == "v2" else ("memory.limit_in_bytes", "memory.usage_in_bytes")
        )
        for d in _candidate_dirs(version, path, root):
            if d in seen:
                continue
            seen.add(d)
            limit, usage = _read_int(os.path.join(d, limit_file)), _read_int(os.path.join(d, usage_file))
            if limit is None or usage is None or limit >= _UNLIMITED:
                continue
            free = max(0, limit - max(0, usage - _inactive_file(d)))
            out.append((f"cgroup {version} {d}: limit {gib(limit)}, free", free))
    return out


def _mem_available() -> Optional[int]:
    try:
        with open(_MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def usable_host_memory() -> HostMemory:
    """Host memory the process can allocate now: the smallest of its cgroups' free room and
    ``MemAvailable``. Module-level so tests (and users with their own accounting) can replace it."""
    sources = _cgroup_room()
    available = _mem_available()
    if available is not None:
        sources.append(("MemAvailable", available))
    return HostMemory(min((n for _, n in sources), default=None), tuple(sources))
