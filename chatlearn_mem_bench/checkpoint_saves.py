"""The ``checkpoint`` report (``checkpoint: true``, off by default): checkpoint saves of the
benchmark's trainer against a plain sequential write of the same bytes, and the manifest's share.

In one directory (``checkpoint_dir``, default a temporary one removed after), for each optimizer
format (``resharding=True``: megatron's ``fully_reshardable``, which copies the optimizer state
into model-space tensors while the call runs; ``resharding=False``, suffix ``_dp``:
``dp_reshardable``, written from the optimizer's or the host store's own memory), ``checkpoint_repeats``
times:

* ``save_awake``: ``save_checkpoint`` of the resident trainer (synchronous);
* ``save_asleep``: the same after ``offload()``: every tensor read from the host store;
* ``save_async_return`` / ``save_async_total``: an asynchronous save of the sleeping trainer, until
  the call returns and until ``wait()`` has committed it;
* ``plain_write``: the ceiling: the same number of bytes written with one sequential ``f.write``
  from a preallocated host buffer, then ``fsync`` (megatron's writer fsyncs too), before and after
  the saves of each repeat.

Throughputs are tensor bytes (``SaveHandle.nbytes``) per second of wall time, medians. The seconds
each save spent checksumming its files for the manifest (in its writing thread) are reported beside
it. The sleeping trainer must hold 0 device bytes through every save (the report's one target).
This was ``scripts/measure_checkpoint.py`` (``git show 8006b4f:scripts/measure_checkpoint.py``);
its committed run is ``benchmarks/results/2026-11-23_checkpoint_cpu-2core-24gib.json``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from typing import Optional

import torch

__all__ = ["KINDS", "checkpoint_lines", "checkpoint_targets", "measure_checkpoint", "plain_write_seconds"]

KINDS = (
    "save_awake",
    "save_asleep",
    "save_async_return",
    "save_async_total",
    "save_awake_dp",
    "save_asleep_dp",
    "save_async_return_dp",
    "save_async_total_dp",
    "plain_write",
)
"""Every timed kind, as the JSON names them (``_dp``: ``resharding=False``)."""


def plain_write_seconds(directory: str | os.PathLike, nbytes: int) -> float:
    """One sequential write of ``nbytes`` from a preallocated host buffer, then ``fsync``: the
    disk's ceiling for a checkpoint of that many bytes (the file is removed after)."""
    buf = torch.ones(nbytes, dtype=torch.uint8).numpy()
    path = os.path.join(directory, "plain-write.bin")
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(memoryview(buf))
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    os.remove(path)
    return seconds


def measure_checkpoint(mm, repeats: int, directory: Optional[str] = None) -> dict:
    """Time the saves of the trainer ``mm`` manages (awake on entry; awake again on return) against
    plain writes of the same bytes (see the module). ``directory``: where to write (created if
    missing, the checkpoints left there); None: a temporary directory, removed after."""
    from chatlearn_mem.checkpoint import estimate_checkpoint_nbytes, save_checkpoint
    from chatlearn_mem.errors import UnsupportedLayoutError

    formats, skipped = [("", True)], None
    try:  # refuses a format this megatron-core cannot save (resharding=False before 0.14), before any save
        estimate_checkpoint_nbytes(mm, resharding=False)
        formats.append(("_dp", False))
    except UnsupportedLayoutError as e:
        skipped = str(e)
    root = directory or tempfile.mkdtemp(prefix="bench-checkpoint-")
    os.makedirs(root, exist_ok=True)
    times: dict[str, list[float]] = {k: [] for k in KINDS if not k.endswith("_dp") or skipped is None}
    # seconds of each save spent checksumming its files for the manifest (in the writing thread)
    manifest: dict[str, list[float]] = {k: [] for k in times if k.startswith("save") and "return" not in k}
    nbytes, step, asleep_device_bytes = 0, 0, []
    try:
        for _ in range(repeats):
            if nbytes:  # before and after the saves: the disk's state affects both the same way
                times["plain_write"].append(plain_write_seconds(root, nbytes))
            for suffix, resharding in formats:
                step += 1
                t0 = time.perf_counter()
                handle = save_checkpoint(mm, root, step=step, keep_last=1, resharding=resharding)
                nbytes = handle.nbytes
                times["save_awake" + suffix].append(time.perf_counter() - t0)
                manifest["save_awake" + suffix].append(handle.manifest_seconds)
                mm.offload()
                step += 1
                t0 = time.perf_counter()
                handle = save_checkpoint(mm, root, step=step, keep_last=1, resharding=resharding)
                times["save_asleep" + suffix].append(time.perf_counter() - t0)
                manifest["save_asleep" + suffix].append(handle.manifest_seconds)
                asleep_device_bytes.append(mm.residency().device_bytes)
                step += 1
                t0 = time.perf_counter()
                handle = save_checkpoint(mm, root, step=step, async_=True, keep_last=1, resharding=resharding)
                times["save_async_return" + suffix].append(time.perf_counter() - t0)
                handle.wait()
                times["save_async_total" + suffix].append(time.perf_counter() - t0)
                manifest["save_async_total" + suffix].append(handle.manifest_seconds)
                asleep_device_bytes.append(mm.residency().device_bytes)
                mm.onload()
            times["plain_write"].append(plain_write_seconds(root, nbytes))
    finally:
        if directory is None:
            shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "tensor_bytes": nbytes,
        "repeats": repeats,
        "seconds": med,
        "samples_s": times,
        "gb_per_s": {k: nbytes / v / 1e9 for k, v in med.items() if "return" not in k},
        "save_vs_plain_write": {k: med["plain_write"] / v for k, v in med.items() if "return" not in k},
        "asleep_device_bytes_max": max(asleep_device_bytes),
        "manifest_seconds": {k: statistics.median(v) for k, v in manifest.items()},
        "manifest_share_of_save": {k: statistics.median(v) / med[k] for k, v in manifest.items()},
        "dir": root if directory is not None else None,
        "saves_asleep": len(asleep_device_bytes),
        "not_measured": {"resharding=False": skipped} if skipped else {},
    }


_ROWS = (  # (label, the kind timed to the commit, the kind until the call returned)
    ("plain sequential `f.write` + `fsync` of the same bytes (ceiling)", "plain_write", None),
    ("save, `resharding=False` (`dp_reshardable`), trainer awake", "save_awake_dp", None),
    ("save, `resharding=False`, trainer asleep (from the host store)", "save_asleep_dp", None),
    ("async save, `resharding=False`, asleep: call returns / committed", "save_async_total_dp", "save_async_return_dp"),
    ("save, default (`fully_reshardable`), trainer awake", "save_awake", None),
    ("save, default, trainer asleep", "save_asleep", None),
    ("async save, default, asleep: call returns / committed", "save_async_total", "save_async_return"),
)


def checkpoint_lines(ck: Optional[dict]) -> list[str]:
    """The report's section of the markdown: one row per kind, medians, against the plain write."""
    if not ck:
        return []
    from chatlearn_mem_bench.plan import format_bytes

    size = format_bytes(ck["tensor_bytes"])
    lines = [
        "",
        f"## Checkpoint saves against a plain write ({size} of tensors, {ck['repeats']} repeat(s), medians)",
        "",
        f"| what ({size} of tensors) | seconds | GB/s | vs plain write | manifest share |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, kind, returned in _ROWS:
        if kind not in ck["seconds"]:
            continue
        s = ck["seconds"][kind]
        secs = f"{ck['seconds'][returned]:.2f} / {s:.2f}" if returned else f"{s:.2f}"
        share = ck["manifest_share_of_save"].get(kind)
        lines.append(
            f"| {label} | {secs} | {ck['gb_per_s'][kind]:.2f} | {ck['save_vs_plain_write'][kind]:.2f} | "
            + (f"{share:.0%} |" if share is not None else "- |")
        )
    lines += [
        "",
        f"The sleeping trainer held at most {ck['asleep_device_bytes_max']} device bytes through its saves. "
        "The manifest share is the save's time spent checksumming its files (in its writing thread).",
    ]
    lines += [f"Not measured, `{what}`: {why}." for what, why in ck.get("not_measured", {}).items()]
    return lines


def checkpoint_targets(ck: Optional[dict]) -> list[dict]:
    """A sleeping trainer's saves read the host store alone: 0 device bytes throughout."""
    if not ck:
        return []
    held = ck["asleep_device_bytes_max"]
    return [
        {
            "name": "checkpoint: a sleeping trainer is saved holding 0 device bytes",
            "passed": held == 0,
            "detail": f"at most {held} device bytes through {ck.get('saves_asleep', 4 * ck['repeats'])} saves of the "
            "sleeping trainer",
        }
    ]
