"""Timing one method on one part: offload and onload, with what each leaves on the device and the
host, interleaved with the other methods repeat by repeat."""

from __future__ import annotations

import logging
from typing import Optional

import torch

from chatlearn_mem import Part
from chatlearn_mem.device_memory import trim_host_heap
from chatlearn_mem_bench import tms as tms_mod
from chatlearn_mem_bench.config import COPY_PARTS, FULL, BenchConfig
from chatlearn_mem_bench.measure import compare, memory_snapshot, stats, timed
from chatlearn_mem_bench.methods import LABELS
from chatlearn_mem_bench.trainer import checksum

__all__ = ["host_work", "peak_rss", "time_part", "tms_results"]

log = logging.getLogger("benchmarks")


def _snap(method, part: str, device: torch.device, reference: list) -> dict:
    host, pinned = method.host_bytes()
    # The ceiling and bound buffers are in CUDA allocated/reserved and RSS too: say how much.
    own = sum(r.device_bytes(part) for r in reference)
    return {
        "device_bytes": method.device_bytes(part),
        "host_bytes": host,
        "pinned_bytes": pinned,
        "benchmark_device_buffers_bytes": own,
        **memory_snapshot(device),
    }


def peak_rss() -> Optional[int]:
    """The process's peak resident set so far (``ru_maxrss``), bytes; None where not reported."""
    try:
        import resource
    except ImportError:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def time_part(
    part: str,
    cfg: BenchConfig,
    nbytes: dict,
    device: torch.device,
    manager,
    ceiling,
    bound,
    alternatives: list,
    memory: list,
    changed_by: dict,
) -> list[dict]:
    """``warmup + repeats`` interleaved rounds of every method on ``part``; its timing rows. In the
    first round the part's bytes are checked after each method against those before it: a method
    that changed them is added to ``changed_by`` (method -> parts). A method timed in a worker of
    its own (``remote``: torch_memory_saver) checks its own trainer's bytes and returns its own
    times; one that fails is left out from then on (``failed`` says why)."""
    methods = [manager, ceiling, *([bound] if bound else [])]
    methods += [a for a in alternatives if part in a.parts() and not getattr(a, "failed", None)]
    checked = COPY_PARTS if part == FULL else [part] if part in COPY_PARTS else []
    reference = checksum(manager.mm, manager.trainer, checked)
    buffers = [b for b in (ceiling, bound) if b is not None]
    ceiling.use(nbytes[part])
    if bound is not None:
        bound.prepare(nbytes[part])
    samples = {(m.name, d): [] for m in methods for d in ("offload", "onload")}
    # the manager's own count of its host work: (host seconds, steps, actions) per timed call
    host = {"offload": [], "onload": []}
    copied = {}
    for r in range(cfg.warmup + cfg.repeats):
        # Untimed: one manager cycle first, so the manager's timed offload starts from the state
        # its own onload leaves (in real use nothing else regrows its storages; an alternative's
        # regrow would leave 4 KiB pages on CPU, whose release costs more).
        manager.offload(part)
        manager.onload(part)
        # untimed: that onload moved storages an alternative had taken out of the manager's CPU
        # slab back in and freed the memory they had; the manager's timed offload would otherwise
        # pay for trimming it from the C heap (15-45 ms for the main weights), a cost of the
        # alternatives' rounds that a manager running alone pays once
        trim_host_heap()
        for m in methods:  # interleaved, so drifting load hits every method alike
            record = r == cfg.warmup
            if getattr(m, "remote", False):
                if getattr(m, "failed", None):
                    continue
                try:
                    out = m.round(part, check=r == 0, snap=record)
                except tms_mod.TmsWorkerError as e:
                    log.warning("%s failed on %s in round %d and is left out from now on: %s", m.name, part, r, e)
                    continue
                if record:
                    memory += _remote_memory(m.name, part, nbytes[part], out)
                if out["bytes_equal"] is False:
                    changed_by.setdefault(m.name, []).append(part)
                if r >= cfg.warmup:
                    samples[(m.name, "offload")].append(out["offload_s"])
                    samples[(m.name, "onload")].append(out["onload_s"])
                    copied[(m.name, "offload")] = copied[(m.name, "onload")] = nbytes[part] if part != Part.GRADS else 0
                continue

            def snap(stage: str) -> None:
                if record:
                    memory.append({"part": part, "method": m.name, "stage": stage, **_snap(m, part, device, buffers)})

            m.before(part)
            snap("before")
            t_off, c_off = timed(lambda: m.offload(part), device)
            if m is manager and r >= cfg.warmup:
                host["offload"].append(host_work(manager.last_stats))
            snap("after_offload")
            t_on, c_on = timed(lambda: m.onload(part), device)
            if m is manager and r >= cfg.warmup:
                host["onload"].append(host_work(manager.last_stats))
            snap("after_onload")
            m.restore(part)
            trim_host_heap()  # untimed: the next method must not count this one's copies
            if r == 0:
                now = checksum(manager.mm, manager.trainer, checked)
                if now != reference:
                    changed_by.setdefault(m.name, []).append(part)
                reference = now  # the next method's start
            if r >= cfg.warmup:
                samples[(m.name, "offload")].append(t_off)
                samples[(m.name, "onload")].append(t_on)
                copied[(m.name, "offload")], copied[(m.name, "onload")] = c_off, c_on
    if bound is not None:
        bound.release()
    rows = []
    for direction in ("offload", "onload"):
        ms = stats(samples[("manager", direction)])
        cs = stats(samples[("ceiling", direction)])
        bs = stats(samples[("release_bound", direction)]) if bound is not None else None
        for m in methods:
            if len(samples[(m.name, direction)]) < cfg.repeats:
                continue  # a remote method that failed on this part: no row
            s = stats(samples[(m.name, direction)])
            b = copied[(m.name, direction)]
            row = {
                "part": part,
                "method": m.name,
                "label": LABELS[m.name],
                "direction": direction,
                "seconds": s,
                "samples_s": samples[(m.name, direction)],
                "bytes_copied": b,
                "bytes_part": nbytes[part],
                "gb_per_s": b / s["median"] / 1e9 if b and s["median"] else None,
                "gb_per_s_iqr": [b / s["q75"] / 1e9, b / s["q25"] / 1e9] if b and s["q25"] else None,
            }
            if m.name == "manager":
                hs = stats([h[0] for h in host[direction]])
                row["host_seconds"] = hs
                # on CUDA: the share of the call the host spent issuing its steps (at 1 the host,
                # not the copies, bounds it); on a CPU device the host time includes the copies
                row["host_share"] = hs["median"] / s["median"] if s["median"] else None
                row["steps"], row["actions"] = host[direction][-1][1:] if host[direction] else (0, 0)
                ceiling_copies = part != Part.GRADS or direction == "onload"
                row["vs_ceiling"] = cs["median"] / s["median"] if ceiling_copies and s["median"] else None
                row["vs_release_bound"] = (
                    bs["median"] / s["median"] if bs is not None and ceiling_copies and s["median"] else None
                )
                row["vs_ceiling_note"] = (
                    "ceiling/manager time = manager/ceiling throughput"
                    if part != Part.GRADS
                    else "grads: no bytes copied; onload ceiling is a zero-fill"
                )
            elif m.name not in ("ceiling", "release_bound"):
                row["time_vs_manager"] = s["median"] / ms["median"] if ms["median"] else None
                row["manager_is"] = compare(ms, s)
                if getattr(m, "remote", False):
                    row.update(m.row_extra(part))
            rows.append(row)
    return rows


def _remote_memory(name: str, part: str, nbytes: int, out: dict) -> list[dict]:
    """Memory rows of a method timed in its worker, from the worker's snapshots: device bytes are
    the part's less what the pause gave back, host bytes the pinned backup of what it gave back
    (TMS frees it at the resume unless it retains it), the rest the worker's own figures."""
    rows = []
    released = max(0, out["released_bytes"])
    for stage, snap in (out.get("memory") or {}).items():
        host = released if stage == "after_offload" else 0
        rows.append(
            {
                "part": part,
                "method": name,
                "stage": stage,
                "device_bytes": max(0, nbytes - released) if stage == "after_offload" else nbytes,
                "host_bytes": host,
                "pinned_bytes": host,
                "benchmark_device_buffers_bytes": 0,
                "rss_bytes": snap["rss_bytes"],
                **{k: v for k, v in snap.items() if k.startswith("cuda_") or k == "device_used_bytes"},
                "in_worker": True,
            }
        )
    return rows


def tms_results(method, changed_by: dict, bye: Optional[dict] = None) -> dict:
    """What the results keep of the torch_memory_saver worker: its build, its failures, whether
    every resume kept the bytes, the device bytes each part's pauses gave back."""
    out = {
        "worker": method.info,
        "failed": method.failed,
        "parts_changed": changed_by.get(method.name, []),
        "released_bytes": method.released,
    }
    if bye is not None:
        out["bye"] = bye
    return out


def host_work(stats: list) -> tuple[float, int, int]:
    """``(host seconds, steps, actions)`` of one manager call, summed over its groups."""
    return (
        sum(s.host_seconds for s in stats),
        sum(s.steps for s in stats),
        sum(s.actions for s in stats),
    )
