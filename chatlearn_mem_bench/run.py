"""Run the memory benchmark: build a trainer, time every method on every part, check targets."""

from __future__ import annotations

import datetime as _dt
import logging
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch

from chatlearn_mem import Part
from chatlearn_mem.device_memory import trim_host_heap
from chatlearn_mem_bench import tms as tms_mod
from chatlearn_mem_bench.config import COPY_PARTS, FULL, PARTS, PRESETS, BenchConfig
from chatlearn_mem_bench.measure import (
    compare,
    git_revision,
    hardware,
    hardware_slug,
    host_bandwidths,
    memory_snapshot,
    stats,
    timed,
    versions,
)
from chatlearn_mem_bench.methods import (
    ALTERNATIVES,
    LABELS,
    CeilingMethod,
    ManagerMethod,
    ReleaseBound,
    logical_tensors,
    part_storages,
)
from chatlearn_mem_bench.overlap import measure_overlap, overlap_targets
from chatlearn_mem_bench.overlap import plan_args as overlap_plan_args
from chatlearn_mem_bench.plan import (
    HostMemoryPlan,
    estimate_part_sizes,
    estimate_seconds,
    format_bytes,
    measured_part_sizes,
    part_bytes,
    plan_host_memory,
    refuse_unless_fits,
)
from chatlearn_mem_bench.repeated import measure_onload_tail, measure_soak, repeated_targets

__all__ = ["PARTS", "check_writable", "run_and_report", "run_benchmark"]


log = logging.getLogger("benchmarks")
TMS = tms_mod.NAME
TMS_SPEEDUP = 5.0
"""The manager must be at least this many times faster than torch_memory_saver, per part and
direction, on the same GPU (issue 52's target)."""


def _checksum(mm, trainer, parts=COPY_PARTS) -> list[int]:
    """Integer checksum of every tensor ``parts`` hold (bit-exactness after all methods)."""
    out = []
    with torch.no_grad():
        for part in parts:
            for t in logical_tensors(mm, trainer, part):
                flat = t.detach().reshape(-1)
                iview = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
                out.append(int(flat.view(iview).sum(dtype=torch.int64)))
    return out


def build_trainer(cfg):
    """The benchmark's trainer for ``cfg`` (a :class:`~chatlearn_mem_bench.config.BenchConfig`),
    after one training step, so that its optimizer states exist; the process group is initialised
    first when there is none."""
    from chatlearn_mem.models import gpt

    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron-core's notices about apex / TE / deprecations
        _init_distributed(tmp)
        trainer = gpt.build_gpt_trainer(cfg.trainer)
        trainer.train_step(gpt.synthetic_batch(cfg.trainer, 0, batch_size=cfg.batch_size))
    return trainer


def _init_distributed(tmp: str) -> None:
    from chatlearn_mem.models import gpt

    if not torch.distributed.is_initialized():
        # A file init method: no TCP port to collide with other jobs on the machine.
        gpt.init_distributed(init_method=f"file://{tmp}/dist_init", cpu_backend=True)
    else:
        gpt.init_distributed(cpu_backend=True)


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


def _instead(plan: HostMemoryPlan, room: int, **plan_args) -> str:
    """What to run instead of a plan that does not fit in ``room`` bytes: the largest shipped
    preset whose plan (estimated from its config) fits, for the refusal's message."""
    from chatlearn_mem_bench.config import load_config
    from chatlearn_mem_config_files import preset_names

    fits = []
    for name in preset_names(PRESETS):
        other = load_config(name)
        try:
            peak = plan_host_memory(
                estimate_part_sizes(other.trainer),
                methods=other.methods,
                overlap_bytes=overlap_plan_args(other).get("overlap_bytes"),
                **plan_args,
            ).peak_bytes
        except ValueError:
            continue
        if peak <= room and peak < plan.peak_bytes:
            fits.append((peak, name))
    if not fits:
        return (
            "No shipped preset fits either: free host memory, or run a smaller trainer "
            "(e.g. trainer.num_layers=2) with fewer alternatives (methods=[])."
        )
    peak, name = max(fits)
    return f"Use a smaller preset: --config {name} (plans {format_bytes(peak)}), or fewer alternatives (methods=[])."


def run_benchmark(
    cfg: BenchConfig,
    command: str = "",
    sink: Optional[Callable[[dict], None]] = None,
    echo: Callable[[str], None] = log.info,
) -> dict:
    """Run everything ``cfg`` asks for and return the results dict (what the JSON holds).

    Before the first timing it prints (``echo``) the host memory plan and the time estimate and
    refuses a plan that does not fit in the host memory the process can use.

    Args:
        sink: Receives the results so far once the plan is made and again after every part, the
            cycles and the end; until the end they say ``complete: false`` and list
            ``missing_parts``, so whatever is written from them survives a killed run.
        echo: Receives the plan and estimate lines.

    Raises:
        HostMemoryPlanError: The plan does not fit; nothing was timed and ``sink`` never called.
    """
    from chatlearn_mem import MemoryConfig, TrainerMemoryManager, host_memory
    from chatlearn_mem.models import gpt

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    started = _dt.datetime.now(_dt.timezone.utc)
    t_start = time.perf_counter()
    cuda = torch.cuda.is_available()
    skipped: dict[str, str] = {}  # alternative -> why it did not run
    tms_pending = None
    if TMS in cfg.methods:
        reason = tms_mod.skip_reason(cuda)
        if reason:
            skipped[TMS] = reason
        else:  # its worker builds its trainer while this process builds its own
            try:
                tms_pending = tms_mod.TorchMemorySaverMethod.spawn(cfg)
            except (OSError, tms_mod.TmsWorkerError) as e:
                skipped[TMS] = f"its worker did not start: {e}"
    trainer = build_trainer(cfg)
    pin = bool(cuda and (cfg.pin_memory is None or cfg.pin_memory))
    mm = TrainerMemoryManager(
        trainer.model,
        trainer.optimizer,
        MemoryConfig(
            bucket_size_mb=cfg.bucket_size_mb,
            pin_memory=pin if cuda else None,
            cpu_huge_pages=cfg.cpu_huge_pages,
            cuda_contiguous=cfg.cuda_contiguous,
            skip_unchanged_weights=False,
        ),
    )  # always copy: the benchmark times copies
    device = mm.device
    hw = hardware(device)
    sizes = measured_part_sizes({p: part_storages(mm, p) for p in Part})
    nbytes = part_bytes(sizes)
    n_params = sum(p.numel() for p in trainer.model.parameters())
    log.info(
        "trainer: %.1f M parameters on %s; bytes per part: %s",
        n_params / 1e6,
        device,
        {k: f"{v / 2**20:.1f} MiB" for k, v in nbytes.items()},
    )

    manager = ManagerMethod(mm, trainer, pin)
    ceiling = CeilingMethod(mm, trainer, pin)
    bound = ReleaseBound(mm, trainer, pin, ceiling) if cfg.release_bound else None
    alternatives = [ALTERNATIVES[name](mm, trainer, pin) for name in cfg.methods if name in ALTERNATIVES]
    if tms_pending is not None:
        try:  # it started with this process's build and does the same: wait for it a while, not forever
            wait_s = max(tms_mod.READY_MIN_S, tms_mod.READY_FACTOR * (time.perf_counter() - t_start))
            alternatives.append(tms_pending.ready(mm, trainer, pin, timeout_s=wait_s))
        except tms_mod.TmsWorkerError as e:
            skipped[TMS] = str(e)
    for name, reason in skipped.items():
        log.warning("%s skipped: %s", name, reason)
    methods = [m.name for m in alternatives]
    builtin = all(getattr(a, "available", True) for a in alternatives)
    plan_args = dict(
        cuda=device.type == "cuda", pin=pin, bucket_size=mm.config.bucket_size_bytes, builtin_available=builtin
    )
    overlap = overlap_plan_args(cfg)
    plan = plan_host_memory(
        sizes,
        methods=methods,
        overlap_bytes=overlap.get("overlap_bytes"),
        release_bound=cfg.release_bound,
        tms_retain_cpu_backup=cfg.tms_retain_cpu_backup,
        **plan_args,
    )
    host_gbps = host_bandwidths()
    estimate = estimate_seconds(
        sizes,
        methods=methods,
        release_bound=cfg.release_bound,
        repeats=cfg.repeats,
        warmup=cfg.warmup,
        cycles=cfg.cycles,
        cuda=plan_args["cuda"],
        pin=pin,
        builtin_available=builtin,
        copy_gbps=host_gbps["copy"],
        fresh_gbps=host_gbps["fresh"],
        **overlap,
    )
    echo(plan.summary())
    echo(estimate.summary())
    if cfg.tail_onloads or cfg.soak_cycles:
        echo(
            f"then, not in that estimate: the onload tail ({cfg.tail_onloads} weights onloads) and the soak "
            f"({cfg.soak_cycles} full cycles with {cfg.soak_cycles // cfg.soak_train_every} train steps, last)"
        )
    usable = host_memory.usable_host_memory()
    margin = mm.config.host_memory_margin_bytes
    try:
        refuse_unless_fits(plan, usable, margin, lambda room: _instead(plan, room, **plan_args))
    except BaseException:
        for m in alternatives:
            if getattr(m, "remote", False):
                m.close()
        raise

    res = {
        "command": command,
        "git_revision": cfg.revision or git_revision(),
        "started_utc": started.isoformat(timespec="seconds"),
        "date": started.date().isoformat(),
        "complete": False,
        "missing_parts": [str(p) for p in PARTS],
        "config": cfg.model_dump(mode="json"),
        "versions": versions(),
        "hardware": hw,
        "model": {"parameters": n_params, "bytes_per_part": nbytes, "pinned_host": pin},
        "host_memory_plan": {
            **plan.to_dict(),
            "usable_bytes_at_start": usable.nbytes,
            "usable_sources": usable.describe(),
            "rss_bytes_at_start": memory_snapshot(device)["rss_bytes"],
        },
        "time_estimate": estimate.to_dict(),
        "setup_seconds": time.perf_counter() - t_start,
        "part_seconds": {},
        "methods": {k: LABELS[k] for k in ["manager", "ceiling", *(["release_bound"] if bound else []), *methods]},
        "skipped_methods": skipped,
        "method_parts": {m.name: [str(p) for p in m.parts()] for m in alternatives},
        "pays_empty_cache": {m.name: m.pays_empty_cache for m in [manager, ceiling, bound, *alternatives] if m},
        "timings": [],
        "memory": [],
    }
    publish = sink or (lambda r: None)
    publish(res)
    checksum_before = _checksum(mm, trainer)
    changed_by: dict[str, list[str]] = {}  # method -> parts whose bytes differed after its restore
    # One host buffer for every part's copy (the largest: the full cycle), none for grads; one
    # device buffer for the largest part, grads' zero-fill included.
    ceiling.prepare(device_bytes=max(nbytes.values()), host_bytes=nbytes[FULL])
    remote = next((m for m in alternatives if getattr(m, "remote", False)), None)
    try:
        for part in PARTS:
            t_part = time.perf_counter()
            res["timings"] += _time_part(
                part, cfg, nbytes, device, manager, ceiling, bound, alternatives, res["memory"], changed_by
            )
            res["part_seconds"][part] = time.perf_counter() - t_part
            res["missing_parts"].remove(part)
            if remote is not None:
                res[TMS] = _tms_results(remote, changed_by)
            res["targets"] = check_targets(res)
            publish(res)
            log.info("%s done in %.1f s", part, res["part_seconds"][part])
    finally:
        ceiling.release()
        if bound is not None:
            bound.release()
        res["detached_grad_hooks"] = {m.name: m.detached_grad_hooks for m in alternatives if m.detached_grad_hooks}
        if remote is not None:
            # the worker's trainer computes the same forward loss as this one, when both got the
            # same first step (a check of the worker's build, not of a method)
            bye = remote.close()
            res[TMS] = _tms_results(remote, changed_by, bye)
            if bye and "forward_loss_batch1" in bye:
                from chatlearn_mem_bench.tms_worker import forward_loss

                try:
                    res[TMS]["forward_loss_here"] = forward_loss(trainer, cfg)
                    res[TMS]["same_forward_loss"] = res[TMS]["forward_loss_here"] == bye["forward_loss_batch1"]
                except Exception as e:  # noqa: BLE001 - a comparison, not a result: say why it is missing
                    res[TMS]["forward_loss_error"] = repr(e)

    res["cycles"] = _cycles(mm, trainer, cfg, device)
    publish(res)
    if cfg.tail_onloads:
        t_tail = time.perf_counter()
        res["onload_tail"] = measure_onload_tail(mm, ceiling, device, cfg.tail_onloads)
        publish(res)
        log.info("onload tail (%d weights onloads) done in %.1f s", cfg.tail_onloads, time.perf_counter() - t_tail)
    if cfg.overlap:
        t_overlap = time.perf_counter()
        res["overlap"] = measure_overlap(cfg, trainer, mm, device, threads=cfg.overlap_threads, pin=pin)
        res["overlap_seconds"] = time.perf_counter() - t_overlap
        publish(res)
    checksum_after = _checksum(mm, trainer)
    audit = mm.audit()
    res["integrity"] = {
        "tensors_bit_identical_after_all_methods": checksum_before == checksum_after,
        "changed_by": changed_by,
        "audit_ok": audit.ok,
        "audit_problems": list(audit.problems),
    }
    if cfg.soak_cycles:  # last: its train steps change the weights the checksums above compare
        t_soak = time.perf_counter()
        log.info("soak: %d full cycles, a train step every %d (the last row)", cfg.soak_cycles, cfg.soak_train_every)
        batch = gpt.synthetic_batch(cfg.trainer, 1, batch_size=cfg.batch_size)
        res["soak"] = measure_soak(
            mm, trainer, batch, device, cfg.soak_cycles, cfg.soak_train_every, cfg.soak_sample_every
        )
        log.info("soak done in %.1f s", time.perf_counter() - t_soak)
    res["host_memory_plan"]["rss_bytes_peak"] = _peak_rss()
    res["elapsed_seconds"] = time.perf_counter() - t_start
    res["complete"] = True
    res["targets"] = check_targets(res)
    publish(res)
    return res


def _peak_rss() -> Optional[int]:
    """The process's peak resident set so far (``ru_maxrss``), bytes; None where not reported."""
    try:
        import resource
    except ImportError:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _time_part(
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
    reference = _checksum(manager.mm, manager.trainer, checked)
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
                host["offload"].append(_host_work(manager.last_stats))
            snap("after_offload")
            t_on, c_on = timed(lambda: m.onload(part), device)
            if m is manager and r >= cfg.warmup:
                host["onload"].append(_host_work(manager.last_stats))
            snap("after_onload")
            m.restore(part)
            trim_host_heap()  # untimed: the next method must not count this one's copies
            if r == 0:
                now = _checksum(manager.mm, manager.trainer, checked)
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


def _tms_results(method, changed_by: dict, bye: Optional[dict] = None) -> dict:
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


def _host_work(stats: list) -> tuple[float, int, int]:
    """``(host seconds, steps, actions)`` of one manager call, summed over its groups."""
    return (
        sum(s.host_seconds for s in stats),
        sum(s.steps for s in stats),
        sum(s.actions for s in stats),
    )


def _cycles(mm, trainer, cfg: BenchConfig, device: torch.device) -> dict:
    """``cfg.cycles`` full manager cycles: time per cycle and bytes after each stage."""
    rows = []
    for i in range(cfg.cycles):
        t_off, _ = timed(lambda: mm.offload(force=True), device)
        r_off = mm.residency()
        s_off = memory_snapshot(device)
        t_on, _ = timed(lambda: mm.onload(), device)
        r_on = mm.residency()
        s_on = memory_snapshot(device)
        rows.append(
            {
                "cycle": i,
                "offload_s": t_off,
                "onload_s": t_on,
                "device_bytes_after_offload": r_off.device_bytes,
                "host_bytes_after_offload": r_off.host_bytes,
                "device_bytes_after_onload": r_on.device_bytes,
                "host_bytes_after_onload": r_on.host_bytes,
                "rss_after_offload": s_off["rss_bytes"],
                "rss_after_onload": s_on["rss_bytes"],
                **{f"{k}_after_offload": v for k, v in s_off.items() if k.startswith("cuda")},
                **{f"{k}_after_onload": v for k, v in s_on.items() if k.startswith("cuda")},
            }
        )
    half = len(rows) // 2
    totals = [r["offload_s"] + r["onload_s"] for r in rows]
    return {
        "rows": rows,
        "cycle_s_all": stats(totals),
        "cycle_s_first_half": stats(totals[:half]),
        "cycle_s_second_half": stats(totals[half:]),
    }


def check_targets(res: dict) -> list[dict]:
    """The issue's targets, each ``{"name", "passed", "detail"}`` (CPU targets; GPU ones on CUDA).
    On the results of an incomplete run, the targets of what it measured."""
    gpu = res["hardware"]["device"].startswith("cuda")
    threshold = 0.9 if gpu else 0.8
    out = []
    rows = res["timings"]
    # On GPU also the full cycle: "offload() and onload() each >= 0.9 of a pinned preallocated copy".
    ceiling_parts = (*COPY_PARTS, FULL) if gpu else (Part.WEIGHTS, Part.OPTIMIZER_STATES)
    by = {(r["part"], r["method"], r["direction"]): r for r in rows}
    for part in ceiling_parts:
        for d in ("offload", "onload"):
            if (part, "manager", d) not in by:
                continue  # not measured (an incomplete run)
            row, ceil = by[(part, "manager", d)], by[(part, "ceiling", d)]
            ratio = row["vs_ceiling"]
            bound = row.get("vs_release_bound")
            out.append(
                {
                    "name": f"{part} {d}: manager >= {threshold} of ceiling",
                    "passed": ratio >= threshold,
                    "detail": f"{ratio:.2f} of ceiling ({row['gb_per_s']:.2f} GB/s vs {ceil['gb_per_s']:.2f} GB/s; "
                    + (f"{bound:.2f} of the release bound)" if bound is not None else "release bound not timed)"),
                }
            )
    if not gpu:  # what any method that frees the memory must pay on a CPU "device" (see methods.py)
        for part in (*COPY_PARTS, FULL):
            for d in ("offload", "onload"):
                row = by.get((part, "manager", d))
                if row is None or row.get("vs_release_bound") is None:
                    continue
                out.append(
                    {
                        "name": f"{part} {d}: manager >= 0.9 of the release bound",
                        "passed": row["vs_release_bound"] >= 0.9,
                        "detail": f"{row['vs_release_bound']:.2f} of the release bound "
                        f"({row['vs_ceiling']:.2f} of the ceiling)",
                    }
                )
    for r in rows:
        if "manager_is" not in r:
            continue
        ok = r["manager_is"] == "faster" if gpu else r["manager_is"] != "slower"
        want = "faster than" if gpu else "no slower (beyond spread) than"
        out.append(
            {
                "name": f"{r['part']} {r['direction']}: manager {want} {r['method']}",
                "passed": ok,
                "detail": f"{r['method']} takes {r['time_vs_manager']:.2f}x the manager's time "
                f"({r['manager_is']}{' - within spread' if r['manager_is'] == 'noise' else ''})",
            }
        )
        if r["method"] == TMS:
            released = r.get("tms_released_bytes")
            out.append(
                {
                    "name": f"{r['part']} {r['direction']}: manager >= {TMS_SPEEDUP:g}x faster than {TMS}",
                    "passed": r["time_vs_manager"] >= TMS_SPEEDUP,
                    "detail": f"{TMS} takes {r['time_vs_manager']:.2f}x the manager's time (tag "
                    f"{r.get('tms_tag')}"
                    + (f", {released / 2**30:.2f} GiB given back per pause" if released else "")
                    + f", {r['bytes_part'] / 2**30:.2f} GiB in the part)",
                }
            )
    if "cycles" in res:
        out += _cycle_targets(res, gpu)
    if res.get("overlap"):
        out += overlap_targets(res["overlap"], gpu)
    out += repeated_targets(res, gpu, res["config"]["rss_tolerance_mb"] * 2**20)
    tms = res.get(TMS)
    if tms and "bye" in tms:
        changed = tms["parts_changed"]
        out.append(
            {
                "name": f"integrity: {TMS}'s trainer bit-identical after every resume (checked in its worker)",
                "passed": not changed and not tms["failed"],
                "detail": (f"bytes changed in {', '.join(changed)}" if changed else "checksums equal")
                + (f"; failed: {tms['failed']}" if tms["failed"] else ""),
            }
        )
    integ = res.get("integrity")
    if integ:
        out.append(
            {
                "name": "integrity: tensors bit-identical after every method, audit ok",
                "passed": integ["tensors_bit_identical_after_all_methods"] and integ["audit_ok"],
                "detail": _integrity_detail(integ),
            }
        )
    return out


def _integrity_detail(integ: dict) -> str:
    """What the integrity target says: which method changed which parts' bytes (else whether the
    checksums agree), then the audit's first problems or that it is clean."""
    changed = integ.get("changed_by") or {}
    if changed:
        bytes_ = "bytes changed by " + ", ".join(f"{m} ({', '.join(ps)})" for m, ps in changed.items())
    elif integ["tensors_bit_identical_after_all_methods"]:
        bytes_ = "checksums equal"
    else:
        bytes_ = "checksums differ after all methods"
    return "; ".join([bytes_, *(integ["audit_problems"][:3] or ["audit ok"])])


def _cycle_targets(res: dict, gpu: bool) -> list[dict]:
    out = []
    cyc = res["cycles"]["rows"][1:]  # the first cycle may still settle allocator state
    for key in (
        "device_bytes_after_offload",
        "device_bytes_after_onload",
        "host_bytes_after_offload",
        "host_bytes_after_onload",
    ):
        vals = [r[key] for r in cyc]
        out.append(
            {
                "name": f"no growth: {key.replace('_', ' ')}",
                "passed": max(vals) <= vals[0],
                "detail": f"first {vals[0]}, max {max(vals)}, last {vals[-1]} bytes over cycles 2..{len(cyc) + 1}",
            }
        )
    tol = res["config"]["rss_tolerance_mb"] * 2**20
    for key in ("rss_after_offload", "rss_after_onload"):
        vals = [r[key] for r in cyc]
        out.append(
            {
                "name": f"no growth: process {key.replace('_', ' ')}",
                "passed": vals[-1] - vals[0] <= tol,
                "detail": f"{(vals[-1] - vals[0]) / 2**20:+.1f} MiB from cycle 2 to {len(cyc) + 1} "
                f"(tolerance {tol / 2**20:.0f} MiB)",
            }
        )
    if gpu:  # from the cycles, where the benchmark holds no ceiling buffers of its own
        last = res["cycles"]["rows"][-1]
        for key in ("cuda_allocated_bytes", "cuda_reserved_bytes"):
            before, after = last[f"{key}_after_onload"], last[f"{key}_after_offload"]
            out.append(
                {
                    "name": f"{key} after full offload < 1% of onloaded",
                    "passed": after < 0.01 * before,
                    "detail": f"{after} of {before} bytes (last cycle)",
                }
            )
    first, second = res["cycles"]["cycle_s_first_half"], res["cycles"]["cycle_s_second_half"]
    allc = res["cycles"]["cycle_s_all"]
    slack = max(allc["q75"] - allc["q25"], 0.05 * allc["median"])
    flat = second["median"] - first["median"] <= slack
    out.append(
        {
            "name": "time per cycle flat (second-half median within max(IQR, 5%) of the first)",
            "passed": flat,
            "detail": f"median {first['median']:.3f} s then {second['median']:.3f} s (allowed +{slack:.3f} s)",
        }
    )
    return out


def check_writable(out_dir: Path) -> None:
    """Create ``out_dir`` and write (then remove) a file in it.

    Raises:
        OSError: Saying which directory and why (the command prints it as one ``error:`` line).
    """
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".write-check-"):
            pass
    except OSError as e:
        raise OSError(
            e.errno, f"output_dir {out_dir} is not writable ({e.strerror or e}); choose another output_dir"
        ) from None


def run_and_report(
    cfg: BenchConfig, command: str = "", quiet: bool = False, echo: Callable[[str], None] = print
) -> list[Path]:
    """Run the benchmark ``cfg`` describes, write its JSON, markdown and PNG, print the targets last.

    The JSON and the markdown are written once the plan is made and rewritten after every part,
    so a run that is killed leaves every part it finished (``chatlearn-mem bench-report`` rebuilds
    the markdown and the PNG from them); the PNG is drawn at the end.

    Args:
        command: The command line that produced the run (printed first and stored in the results).
        quiet: Log only warnings while running; print only what was written and the targets.
        echo: Receives the printed lines.

    Returns:
        The paths written (under ``cfg.output_dir``).
    """
    from chatlearn_mem_bench.report import free_stem, print_targets, write_outputs

    logging.basicConfig(level=logging.WARNING, format="[bench] %(message)s")  # megatron's INFO is long
    log.setLevel(logging.WARNING if quiet else logging.INFO)
    echo(f"command: {command}")
    out_dir = Path(cfg.output_dir)
    check_writable(out_dir)  # fail before minutes of measuring, not after
    stems: list[str] = []

    def sink(res: dict) -> None:
        if not stems:  # the first results: the plan is made, nothing timed yet
            wanted = cfg.name or f"{res['date']}_{hardware_slug(res['hardware'])}"
            stems.append(free_stem(out_dir, wanted, cfg.overwrite))
            if stems[0] != wanted:
                echo(f"{out_dir / wanted}.* exist (set overwrite=true to replace them); writing {stems[0]}.* instead")
            echo(f"results so far in {out_dir / stems[0]}.json (rewritten after every part)")
        if not res["complete"]:
            write_outputs(res, out_dir, stems[0], plot=False, quiet=True)

    res = run_benchmark(cfg, command, sink=sink, echo=echo)
    paths = write_outputs(res, out_dir, stems[0], plot=cfg.plot, quiet=quiet)
    for p in paths:
        echo(f"wrote {p}")
    print_targets(res, echo=echo)
    return paths
