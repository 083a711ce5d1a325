"""What a run writes and says: ``log.json``'s contents, the versions it ran on, and the console's line
per iteration."""

from __future__ import annotations

import json
import os
import platform
from typing import Callable, Optional

import torch

from chatlearn_mem_ray.actors.nodes import software_versions
from chatlearn_mem_ray.config import LoopConfig
from chatlearn_mem_ray.service import weight_sync
from chatlearn_mem_ray.service.loop import Loop
from chatlearn_mem_ray.service.service import Service
from chatlearn_mem_ray.service.timeline import MemoryTimeline

__all__ = ["progress_line", "run_log", "versions", "write_quietly"]


def run_log(
    cfg: LoopConfig,
    run: Optional[Service],
    versions: dict,
    status: str,
    seconds: float,
    error: Optional[str] = None,
    extra: Optional[dict] = None,
) -> dict:
    timeline = run.timeline if run is not None else MemoryTimeline()
    return {
        "status": status,
        "error": error,
        "pid": os.getpid(),
        "config": json.loads(cfg.model_dump_json()),
        "versions": versions,
        "iterations": run.iterations if run is not None else [],
        "memory_timeline": timeline.to_json(),
        "sync_checks": run.sync_checks if run is not None else [],
        "audits": run.audits if run is not None else {"runs": 0, "checks_clean": 0},
        "over_budget": run.over_budget if run is not None else [],
        **({"validations": vals} if (vals := _validations(run)) else {}),
        "summary": {
            "memory_manager_on": timeline.summary(True),
            "memory_manager_off": timeline.summary(False),
            "seconds": seconds,
            **({"weight_sync": sync} if (sync := weight_sync.sync_summary(run.iterations if run else [])) else {}),
        },
        **(extra or {}),
    }


def _validations(run: Optional[Service]) -> list[dict]:
    """Every validation the iterations ran (a loop's ``validations``), in order, without their samples."""
    its = run.iterations if run is not None else []
    return [{k: v for k, v in val.items() if k != "samples"} for m in its for val in m.get("validations", ())]


def write_quietly(write: Callable, progress: Callable[[str], None], status: str, error: str) -> bool:
    """Write the final log of a stopped run; a failure to write must not hide why it stopped."""
    try:
        write(status, error)
        return True
    except Exception as e:  # a full disk, an unserialisable metric
        progress(f"warning: could not write the log ({type(e).__name__}: {e})")
        return False


def versions() -> dict:
    of = software_versions()  # read without importing (megatron takes seconds)
    return {
        "torch": torch.__version__,
        "megatron-core": of["megatron-core"],
        "ray": of["ray"],
        "python": platform.python_version(),
        "machine": platform.machine(),
        "node": platform.node(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def progress_line(loop: Loop, m: dict, of: int, comparison: bool = False) -> str:
    """``iter   3/20 reward ... | generate 0.05s/0.2MiB ...``, or ``iter manager off 1/1 ...`` for a
    comparison iteration: the loop's figures (:meth:`Loop.progress_line`), then each phase's."""
    phases = " ".join(
        f"{name} {m['phase_seconds'][name]:.2f}s/{m['phase_colocated_bytes'][name] / 2**20:.1f}MiB"
        for name in m["phase_seconds"]
    )
    if comparison:
        head = f"iter manager off {m['iteration']}/{of}"
    else:
        head = f"iter {m['iteration']:>3}/{of}{'' if m['manager_on'] else ' [manager off]'}"
    first, newline, rest = loop.progress_line(m).partition("\n")  # more lines (a sample) go under the phases
    return f"{head} {first} | {phases}{newline}{rest}"
