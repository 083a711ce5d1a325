#!/usr/bin/env python3
"""The host's work per call of a trainer's transitions, against the number of parameters.

Builds megatron-core GPTs of ``--layers`` layers each (tiny tensors: hidden 64, so that the copies
take next to nothing and what is left is the host's work), one at a time, and times
``--repeats`` calls of each kind after two full offload/onload cycles:

* ``weights offload`` / ``weights onload``: blocking, the weights part alone (one buffer);
* ``weights onload, non-blocking``: ``onload(weights, blocking=False)`` until it returns (the time
  before a forward can start) and until ``wait()`` returns;
* ``full offload`` / ``full onload``: every part.

For each it prints the median wall time of the call, the lanes' steps and actions and the host time
the lanes spent running them (:class:`chatlearn_mem.TransferStats`; on CUDA the time to issue the
copies, on a CPU device the copies too), and, between the smallest and the largest model, the extra
microseconds per extra parameter (the per-call O(parameters) work: chiefly the manager's check of
every tensor against where it left them, before each call). On a GPU it runs with NCCL; on a
machine without one, through the CPU backend. Run::

    python scripts/measure_host_overhead.py [--layers 4,16,64] [--repeats 15] [--out FILE.json]

``--profile`` also runs each kind of call ``--repeats`` more times, on the largest model, under
cProfile (apart from the timed calls, which it would slow), and keeps the functions that took the
most time of their own: per call, how often each ran and its microseconds (``profile`` in the JSON,
the full transitions' leaders printed). On a GPU it says which torch calls the per-storage work is
made of (an allocation, a stream record, a copy launch) and how much is Python.

``--device-slab on`` lays the main weights and optimizer states out in a
:class:`~chatlearn_mem.device_memory.DeviceSlab` (on a GPU ``MemoryConfig.cuda_contiguous``; on a
CPU device in place of its mmap slab, so that the same code is timed); ``both`` measures each
model without and then with it, in the same process, and prints a table for each.

Results of a run are in ``docs/transitions.md`` (host work per call and per step).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import platform
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

CALLS = ("weights offload", "weights onload", "weights onload, non-blocking", "full offload", "full onload")
PROFILE_TOP = 25  # functions kept per kind of call


def _leaders(profile: cProfile.Profile, calls: int, top: int = PROFILE_TOP) -> list[dict]:
    """The ``top`` functions of ``profile`` by time of their own, per call of the ``calls`` it
    covered: ``function`` (file:line(name), or the C method), ``ncalls``, ``tottime_us`` (own time),
    ``cumtime_us`` (with what it called)."""
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (prim calls, calls, tottime, cumtime, callers)
    rows = []
    for (file, line, name), (_, ncalls, tottime, cumtime, _) in stats.items():
        where = name if file == "~" else f"{Path(file).name}:{line}({name})"
        rows.append(
            {
                "function": where,
                "ncalls": ncalls / calls,
                "tottime_us": tottime / calls * 1e6,
                "cumtime_us": cumtime / calls * 1e6,
            }
        )
    rows.sort(key=lambda r: -r["tottime_us"])
    return rows[:top]


@contextlib.contextmanager
def _device_slab(on: bool):
    """``cuda_contiguous`` for the manager's config; on a CPU device also a DeviceSlab in place of
    the mmap Slab (what ``cuda_contiguous`` lays out on CUDA), for the duration."""
    from chatlearn_mem.device_memory import DeviceSlab, Slab
    from chatlearn_mem.storage import StorageGroup

    real = StorageGroup._slab_kind
    if on:
        StorageGroup._slab_kind = lambda g, s: DeviceSlab if real(g, s) is Slab else real(g, s)
    try:
        yield {"cuda_contiguous": on}
    finally:
        StorageGroup._slab_kind = real


def measure(layers: int, repeats: int, profile: bool = False, device_slab: bool = False) -> dict:
    """One model of ``layers`` layers: per kind of call, the median wall time and the lanes' counts;
    with ``profile``, each kind's leading functions under cProfile (:func:`_leaders`);
    ``device_slab``: see :func:`_device_slab`."""
    with _device_slab(device_slab) as extra:
        return _measure(layers, repeats, profile, extra)


def _measure(layers: int, repeats: int, profile: bool, extra: dict) -> dict:
    import torch

    from chatlearn_mem import MemoryConfig, Part, TrainerMemoryManager
    from chatlearn_mem.models import gpt

    cfg = gpt.GPTTrainerConfig(
        num_layers=layers, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=16, precision="bf16"
    )
    trainer = gpt.build_gpt_trainer(cfg)
    trainer.train_step(gpt.synthetic_batch(cfg, 0, batch_size=2))  # the optimizer states exist
    mm = TrainerMemoryManager(trainer.model, trainer.optimizer, MemoryConfig(skip_unchanged_weights=False, **extra))
    device = mm.state.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(2):
        mm.offload()
        mm.onload()
    row: dict = {
        "layers": layers,
        "device_slab": extra["cuda_contiguous"],
        "parameters": sum(1 for _ in trainer.model.parameters()),
        "storages": {p.value: len(mm.state.storages(p)) for p in mm.parts},
    }

    def timed(call, before=None, profiler: Optional[cProfile.Profile] = None) -> dict:
        walls, returns, stats = [], [], []
        for _ in range(repeats):
            if before is not None:
                before()
            sync()
            if profiler is not None:
                profiler.enable()
            t0 = time.perf_counter()
            result = call()
            t1 = time.perf_counter()
            if hasattr(result, "wait"):  # a non-blocking handle: returned at t1, done at wait()
                result = result.wait()
                sync()
                returns.append(t1 - t0)
                t1 = time.perf_counter()
            if profiler is not None:
                profiler.disable()
            walls.append(t1 - t0)
            stats.append(result)
        last = [s for s in stats[-1] if s is not None]
        out = {
            "wall_ms": statistics.median(walls) * 1e3,
            "steps": sum(s.steps for s in last),
            "actions": sum(s.actions for s in last),
            "lane_host_ms": statistics.median(sum(s.host_seconds for s in r if s is not None) for r in stats) * 1e3,
        }
        if returns:
            out["returns_ms"] = statistics.median(returns) * 1e3
        return out

    def resident(*parts) -> None:  # untimed, before a timed offload
        todo = [p for p in parts or mm.parts if mm.is_offloaded(p)]
        if todo:
            mm.onload(todo)

    def offloaded(*parts) -> None:  # untimed, before a timed onload
        todo = [p for p in parts or mm.parts if not mm.is_offloaded(p)]
        if todo:
            mm.offload(todo)

    w = Part.WEIGHTS
    kinds = {  # (the call, what makes it possible, untimed)
        "weights offload": (lambda: mm.offload(w), lambda: resident(w)),
        "weights onload": (lambda: mm.onload(w), lambda: offloaded(w)),
        "weights onload, non-blocking": (lambda: mm.onload(w, blocking=False), lambda: offloaded(w)),
        "full offload": (mm.offload, resident),
        "full onload": (mm.onload, offloaded),
    }
    assert tuple(kinds) == CALLS
    row["calls"] = {name: timed(call, before) for name, (call, before) in kinds.items()}
    if profile:  # apart from the timed calls: cProfile slows every Python call
        row["profile"] = {}
        for name, (call, before) in kinds.items():
            profiler = cProfile.Profile()
            out = timed(call, before, profiler)
            row["profile"][name] = {"profiled_wall_ms": out["wall_ms"], "functions": _leaders(profiler, repeats)}
    assert mm.audit().ok
    mm.close()
    return row


def _print_leaders(row: dict, call: str, top: int = 10) -> None:
    """The ``top`` functions of ``call``'s profile in ``row``, per call and per storage moved."""
    prof = row["profile"][call]
    storages = sum(row["storages"].values())
    print(
        f"\n{call}, {row['parameters']} params, {storages} storages: under cProfile {prof['profiled_wall_ms']:.2f} ms "
        f"a call (timed: {row['calls'][call]['wall_ms']:.2f} ms); the functions with the most time of their own"
    )
    print("| function | calls per call | own us per call | own us per storage | with callees us per call |")
    print("|---|---:|---:|---:|---:|")
    for f in prof["functions"][:top]:
        print(
            f"| `{f['function']}` | {f['ncalls']:.0f} | {f['tottime_us']:.0f} | {f['tottime_us'] / storages:.2f} "
            f"| {f['cumtime_us']:.0f} |"
        )


def _print_table(rows: list[dict], title: str) -> dict:
    """The calls of ``rows`` (one model each, in order of size) as a markdown table; returns the
    microseconds per extra parameter of each kind of call (None each with one model alone)."""
    if title:
        print(f"\n{title}:")
    print("| call | " + " | ".join(f"{r['parameters']} params" for r in rows) + " | us per extra param |")
    print("|---|" + "---:|" * (len(rows) + 1))
    first, last = rows[0], rows[-1]
    slopes = {}
    for call in CALLS:
        cells = []
        for r in rows:
            c = r["calls"][call]
            extra = f", returns {c['returns_ms']:.2f}" if "returns_ms" in c else ""
            cells.append(
                f"{c['wall_ms']:.2f} ms{extra} ({c['steps']} steps, {c['actions']} actions, lanes {c['lane_host_ms']:.2f} ms)"
            )
        dp = last["parameters"] - first["parameters"]
        slopes[call] = (last["calls"][call]["wall_ms"] - first["calls"][call]["wall_ms"]) * 1e3 / dp if dp else None
        print(f"| {call} | " + " | ".join(cells) + f" | {'-' if slopes[call] is None else f'{slopes[call]:.1f}'} |")
    return slopes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--layers",
        default="4,16,64",
        help="comma-separated layer counts, one model each (two at least for the cost per extra parameter)",
    )
    p.add_argument("--repeats", type=int, default=15, help="timed calls of each kind per model")
    p.add_argument("--out", help="write every figure here as JSON")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also profile each kind of call on the largest model (cProfile, apart from the timed calls)",
    )
    p.add_argument(
        "--device-slab",
        choices=("off", "on", "both"),
        default="off",
        help="main weights and optimizer states in a DeviceSlab (cuda_contiguous); both: each model without, then with",
    )
    args = p.parse_args(argv)
    settings = {"off": [False], "on": [True], "both": [False, True]}[args.device_slab]
    try:
        layers = [int(x) for x in args.layers.split(",")]
    except ValueError:
        p.error(f"--layers takes comma-separated layer counts such as 4,16,64, got {args.layers!r}")
    import torch

    if args.device_slab != "off" and torch.cuda.is_available():
        from chatlearn_mem import device_memory

        try:  # before any model is measured (a build before the check has none: it fails later)
            getattr(device_memory, "check_device_slab", lambda *a: None)(True, torch.device("cuda"))
        except ValueError as e:
            p.error(f"--device-slab {args.device_slab}: {e}")

    from chatlearn_mem.models import gpt

    # the group destroyed before exit: a NCCL group left to it holds it up (an older build, the base
    # of scripts/gpu_ab_host.sh, lacks owned_process_group: that script destroys the group at exit)
    owned = getattr(gpt, "owned_process_group", contextlib.nullcontext)
    with tempfile.TemporaryDirectory() as d, owned():
        gpt.init_distributed(init_method=f"file://{d}/init", cpu_backend=True)
        device = (
            torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({platform.processor() or 'x86'})"
        )
        rows = []
        for n in layers:
            for on in settings:
                print(f"[host-overhead] {n} layers{', device slab' if on else ''} ...", file=sys.stderr, flush=True)
                rows.append(measure(n, args.repeats, profile=args.profile and n == max(layers), device_slab=on))
    print(f"device: {device}; medians of {args.repeats} calls; hidden 64 (the copies take next to nothing)")
    slopes = {}
    for on in settings:
        table = [r for r in rows if r["device_slab"] == on]
        slopes[on] = _print_table(table, "main weights and optimizer states in a DeviceSlab" if on else "")
    for r in rows:
        for call in ("full offload", "full onload") if "profile" in r else ():
            _print_leaders(r, call)
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "device": device,
                    "torch": torch.__version__,
                    "repeats": args.repeats,
                    "rows": rows,
                    "us_per_param": slopes[settings[0]],
                    **({"us_per_param_device_slab": slopes[True]} if True in slopes else {}),
                },
                indent=1,
            )
        )
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    code = main()
    from chatlearn_mem.models import gpt

    getattr(gpt, "exit_process", sys.exit)(code)  # at once when the process group's teardown hung
