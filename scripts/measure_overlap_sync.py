#!/usr/bin/env python3
"""Take the CPU ``onload_then_forward`` row apart: what its fences cost, and what the manager adds.

On a CPU device the bench judges ``onload(weights, blocking=False)`` beside a forward against the
same schedule with plain copies (``plain``: the first module's bytes copied, then the forward
while a thread copies the rest). That forward never waits for a byte; a real onload's does, module
by module. This script times, in one process, interleaved round by round, on a bench preset's
trainer (``cpu`` by default; one compute thread, as the bench's ``overlap_threads``):

* ``alone``: the forward alone;
* ``plain``: the bench's bound, above;
* ``fenced``: a minimal lane in plain Python: a thread copies the weights' bytes in the steps of
  the manager's own plan for a non-blocking weights onload, setting a counter under one
  ``threading.Condition`` after each, while each module's forward pre-hook waits for the step that
  carries its last byte. What any onload with per-module fences on a Python thread pays, without
  the manager's bookkeeping;
* ``manager``: ``onload(weights, blocking=False)`` and the forward, then ``wait()``.

Per kind: the median wall time and the median over rounds of its ratio to ``plain``; the forward
thread's CPU time, run-queue wait (runnable, not running) and context switches, and the copy
thread's (from ``/proc/self/task/TID/schedstat``; None where the kernel has none); the machine's
idle and steal time over the round (``/proc/stat``).

Run::

    python scripts/measure_overlap_sync.py [--preset cpu] [--rounds 30] [--out FILE.json] [overrides ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from typing import Callable, Optional

KINDS = ("alone", "plain", "fenced", "manager")


def _schedstat(tid: int, pid: str = "self") -> Optional[tuple[int, int, int]]:
    """``(ns on a CPU, ns runnable in a run queue, time slices)`` of thread ``tid`` (of process
    ``pid``), or None."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            run, wait, slices = f.read().split()
        return int(run), int(wait), int(slices)
    except (OSError, ValueError):
        return None


def _machine() -> Optional[list[int]]:
    """The machine's CPU time so far, in jiffies: ``[idle, steal]``, or None."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return [int(fields[4]), int(fields[8])]
    except (OSError, ValueError, IndexError):
        return None


def _thread_name(tid: int, pid: str = "self") -> Optional[str]:
    try:
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def _all_threads() -> dict[tuple[int, int], tuple[int, str]]:
    """Every thread on the machine (kernel threads too): ``(pid, tid) -> (ns on a CPU so far, name)``;
    empty where ``/proc`` has no schedstat."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            stat, name = _schedstat(tid, pid), _thread_name(tid, pid)
            if stat is not None and name is not None:
                out[(int(pid), int(tid))] = (stat[0], name)
    return out


def _others(before: dict, after: dict, mine: set[int], top: int = 4) -> dict:
    """CPU ms that threads other than ``mine`` (tids) ran between two :func:`_all_threads`: their
    total, this process's other threads' share, and the ``top`` largest as ``[name, ms]``."""
    me = os.getpid()
    ran = []
    for key, (run, name) in after.items():
        if key[1] in mine:
            continue
        ms = (run - before.get(key, (0, name))[0]) / 1e6
        if ms > 0:
            ran.append((ms, key[0] == me, name + (" (this process)" if key[0] == me else "")))
    ran.sort(reverse=True)
    return {
        "cpu_ms": sum(r[0] for r in ran),
        "this_process_ms": sum(r[0] for r in ran if r[1]),
        "top": [[n, round(ms, 2)] for ms, _, n in ran[:top]],
    }


class _Thread:
    """Scheduler figures of one thread between :meth:`start` and :meth:`stop` (CPU ms, run-queue
    ms, slices), read from its own schedstat."""

    def __init__(self):
        self.tid: Optional[int] = None
        self.before = None
        self.figures: Optional[dict] = None

    def start(self, tid: Optional[int] = None) -> None:
        self.tid = tid if tid is not None else threading.get_native_id()
        self.before = _schedstat(self.tid)

    def stop(self) -> None:
        after = _schedstat(self.tid) if self.tid is not None else None
        if self.before is None or after is None:
            self.figures = None
            return
        self.figures = {
            "cpu_ms": (after[0] - self.before[0]) / 1e6,
            "runq_ms": (after[1] - self.before[1]) / 1e6,
            "slices": after[2] - self.before[2],
        }


def measure(trainer, cfg, rounds: int, warmup: int = 2) -> dict:
    """The four kinds on ``trainer`` (built from the bench config ``cfg``), ``rounds`` timed rounds
    after ``warmup`` untimed ones; returns the samples per kind and their summary."""
    import torch

    from chatlearn_mem import MemoryConfig, Part, TrainerMemoryManager
    from chatlearn_mem.group_transfer import COPY_IN
    from chatlearn_mem_bench.overlap import (
        _copy_with_threads,
        _plain_onload_beside_forward,
        first_module_bytes,
        forward_batch,
    )

    mm = TrainerMemoryManager(
        trainer.model,
        trainer.optimizer,
        MemoryConfig(
            bucket_size_mb=cfg.bucket_size_mb, cpu_huge_pages=cfg.cpu_huge_pages, skip_unchanged_weights=False
        ),
    )
    threads_before = torch.get_num_threads()
    hooks = []
    try:
        for _ in range(2):
            mm.offload()
            mm.onload()
        torch.set_num_threads(cfg.overlap_threads or 1)  # as the bench's overlap rows
        batch = forward_batch(cfg, trainer, mm, mm.device)

        def forward():
            with torch.no_grad():
                trainer.loss(batch)

        # the manager's plan for a non-blocking weights onload: its steps' bytes, each module's step
        mm.offload(Part.WEIGHTS)
        handle = mm.onload(Part.WEIGHTS, blocking=False)
        gt = mm.state.in_flight(Part.WEIGHTS)
        step_bytes = [sum(a[-1] for a in step if a[0] == COPY_IN) for step in gt.plan.steps]
        user_step = list(gt.plan.user_steps)
        handle.wait()
        weights_bytes = sum(s.nbytes() for s in mm.state.storages(Part.WEIGHTS))
        first = first_module_bytes(mm)
        threads = cfg.overlap_threads or 1
        copier = _Thread()
        fence = {"on": False, "done": -1, "end": None}
        cv = threading.Condition()

        def waits_for(u: int):
            def hook(module, args):
                if not fence["on"] or user_step[u] is None:
                    return
                with cv:
                    while fence["done"] < user_step[u]:
                        cv.wait(0.1)

            return hook

        hooks.extend(
            m.register_forward_pre_hook(waits_for(u), prepend=True) for u, m in enumerate(mm.state.weight_users)
        )

        def timed_copy(threads: int, dst, src):  # the bench's copy thread, its end and schedstat taken
            copier.start()
            _copy_with_threads(threads, dst, src)
            fence["end"] = time.perf_counter()
            copier.stop()

        src = torch.ones(weights_bytes, dtype=torch.uint8)
        dst = torch.zeros(weights_bytes, dtype=torch.uint8)

        def copy_in_steps():
            torch.set_num_threads(threads)
            copier.start()
            offset = 0
            for k, n in enumerate(step_bytes):
                dst[offset : offset + n].copy_(src[offset : offset + n])
                offset += n
                with cv:
                    fence["done"] = k
                    cv.notify_all()
            fence["end"] = time.perf_counter()
            copier.stop()

        def fenced():
            fence["on"], fence["done"] = True, -1
            other = threading.Thread(target=copy_in_steps)
            other.start()
            try:
                forward()
            finally:
                other.join()
                fence["on"] = False

        lane_ids: list[int] = []

        def manager():
            h = mm.onload(Part.WEIGHTS, blocking=False)
            t = mm.state.in_flight(Part.WEIGHTS)
            forward()
            h.wait()
            fence["end"] = t.batch.fence().finished_at if t is not None else None

        kinds: dict[str, Callable[[], None]] = {
            "alone": forward,
            "plain": _plain_onload_beside_forward(weights_bytes, first, threads, forward, copy=timed_copy),
            "fenced": fenced,
            "manager": manager,
        }
        tick = 1e3 / os.sysconf("SC_CLK_TCK")  # ms per jiffy of /proc/stat
        forward()  # warm
        samples: dict[str, list[dict]] = {k: [] for k in KINDS}
        for r in range(warmup + rounds):
            for name in KINDS:
                if name == "manager":
                    mm.offload(Part.WEIGHTS)
                    if not lane_ids:  # the lanes' threads exist after the first call
                        lane_ids = [t.native_id for t in threading.enumerate() if t.name.startswith("chatlearn-mem")]
                    lanes = [_Thread() for _ in lane_ids]
                    for lt, tid in zip(lanes, lane_ids):
                        lt.start(tid)
                time.sleep(0.01)
                fence["end"], copier.figures = None, None
                me = _Thread()
                everyone0 = _all_threads()
                machine0 = _machine()
                me.start()
                t0 = time.perf_counter()
                kinds[name]()
                t1 = time.perf_counter()
                me.stop()
                machine1 = _machine()
                everyone1 = _all_threads()
                mine = {me.tid}
                if copier.tid is not None and name in ("plain", "fenced"):
                    mine.add(copier.tid)
                if name == "manager":
                    mine.update(lane_ids)
                    for lt in lanes:
                        lt.stop()
                    busy = [lt.figures for lt in lanes if lt.figures is not None]
                    copier.figures = max(busy, key=lambda f: f["cpu_ms"]) if busy else None
                if r < warmup:
                    continue
                samples[name].append(
                    {
                        "wall_ms": (t1 - t0) * 1e3,
                        "copy_end_ms": None if fence["end"] is None else (fence["end"] - t0) * 1e3,
                        "forward_thread": me.figures,
                        "copy_thread": copier.figures if name != "alone" else None,
                        "machine_idle_ms": None if machine0 is None else (machine1[0] - machine0[0]) * tick,
                        "machine_steal_ms": None if machine0 is None else (machine1[1] - machine0[1]) * tick,
                        "others": _others(everyone0, everyone1, mine) if everyone0 else None,
                    }
                )
        assert mm.audit().ok
        tids = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []
        names = [n for n in map(_thread_name, tids) if n is not None]
        return {
            "threads": {n: names.count(n) for n in sorted(set(names))},
            "steps": len(step_bytes),
            "step_bytes": step_bytes,
            "weights_bytes": weights_bytes,
            "step_mib": [round(b / 2**20, 2) for b in step_bytes],
            "first_module_mib": first / 2**20,
            "weights_mib": weights_bytes / 2**20,
            "forward_shape": list(batch.shape),
            "rounds": rounds,
            "summary": summarize(samples),
            "samples": samples,
        }
    finally:
        for h in hooks:
            h.remove()
        torch.set_num_threads(threads_before)
        mm.close()


def summarize(samples: dict[str, list[dict]]) -> dict[str, dict]:
    """Per kind: medians of the wall time, of the per-round ratio to ``plain`` and of the threads'
    scheduler figures (None where there are none)."""
    med = statistics.median

    def of(rows: list[dict], thread: str, key: str) -> Optional[float]:
        xs = [r[thread][key] for r in rows if r[thread] is not None]
        return med(xs) if xs else None

    out = {}
    for name, rows in samples.items():
        out[name] = {
            "wall_ms": med(r["wall_ms"] for r in rows),
            "ratio_to_plain": med(r["wall_ms"] / p["wall_ms"] for r, p in zip(rows, samples["plain"])),
            "forward_cpu_ms": of(rows, "forward_thread", "cpu_ms"),
            "forward_runq_ms": of(rows, "forward_thread", "runq_ms"),
            "forward_slices": of(rows, "forward_thread", "slices"),
            "copy_cpu_ms": of(rows, "copy_thread", "cpu_ms"),
            "copy_runq_ms": of(rows, "copy_thread", "runq_ms"),
            "copy_slices": of(rows, "copy_thread", "slices"),
            "others_cpu_ms": of(rows, "others", "cpu_ms"),
            "others_this_process_ms": of(rows, "others", "this_process_ms"),
        }
    return out


def _fmt(x: Optional[float], spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="cpu", help="the bench preset whose trainer to build (default cpu)")
    p.add_argument("--rounds", type=int, default=30, help="timed rounds, each kind once per round (default 30)")
    p.add_argument("--out", help="write the summary and every sample here as JSON")
    p.add_argument("overrides", nargs="*", help="bench config overrides, key=value")
    args = p.parse_args(argv)

    from chatlearn_mem.errors import ConfigError
    from chatlearn_mem.models import gpt
    from chatlearn_mem_bench.config import load_config
    from chatlearn_mem_bench.run import build_trainer

    try:
        cfg = load_config(args.preset, args.overrides)
    except ConfigError as e:
        p.error(str(e))
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    with gpt.owned_process_group():
        trainer = build_trainer(cfg)
        print(f"{args.rounds} rounds of {', '.join(KINDS)} on the {args.preset} preset's trainer ...", flush=True)
        result = measure(trainer, cfg, args.rounds)
    print(f"this process's threads: {result['threads']}")
    print(
        f"weights {result['weights_mib']:.0f} MiB in {result['steps']} steps (first module "
        f"{result['first_module_mib']:.0f} MiB), forward of {result['forward_shape']} tokens; medians:"
    )
    print(
        f"{'kind':8s} {'wall ms':>8s} {'/plain':>7s} {'fwd cpu':>8s} {'fwd runq':>9s} {'fwd sw':>7s} {'copy cpu':>9s} {'copy runq':>10s}"
    )
    for name, s in result["summary"].items():
        print(
            f"{name:8s} {s['wall_ms']:8.1f} {s['ratio_to_plain']:7.3f} {_fmt(s['forward_cpu_ms']):>8s} "
            f"{_fmt(s['forward_runq_ms'], '.2f'):>9s} {_fmt(s['forward_slices'], '.0f'):>7s} "
            f"{_fmt(s['copy_cpu_ms']):>9s} {_fmt(s['copy_runq_ms'], '.2f'):>10s}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    code = main()
    from chatlearn_mem.models import gpt

    gpt.exit_process(code)  # at once when the process group's teardown hung
