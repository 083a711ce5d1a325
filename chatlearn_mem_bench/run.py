"""Run the memory benchmark: build a trainer, time every method on every part, check targets."""

from __future__ import annotations

import datetime as _dt
import logging
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from chatlearn_mem import Part
from chatlearn_mem_bench import tms as tms_mod
from chatlearn_mem_bench.alternatives import ALTERNATIVES
from chatlearn_mem_bench.checkpoint_saves import measure_checkpoint
from chatlearn_mem_bench.config import FULL, PARTS, PRESETS, BenchConfig
from chatlearn_mem_bench.estimate import estimate_seconds
from chatlearn_mem_bench.measure import (
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
    LABELS,
    CeilingMethod,
    ManagerMethod,
    ReleaseBound,
    part_storages,
)
from chatlearn_mem_bench.overlap import measure_overlap
from chatlearn_mem_bench.overlap import plan_args as overlap_plan_args
from chatlearn_mem_bench.plan import (
    HostMemoryPlan,
    estimate_part_sizes,
    format_bytes,
    measured_part_sizes,
    part_bytes,
    plan_host_memory,
    refuse_unless_fits,
)
from chatlearn_mem_bench.planner_speed import measure_planner
from chatlearn_mem_bench.repeated import measure_onload_tail, measure_soak
from chatlearn_mem_bench.targets import check_targets
from chatlearn_mem_bench.timing import peak_rss, time_part, tms_results
from chatlearn_mem_bench.torch_native import measure_torch_native
from chatlearn_mem_bench.trainer import build_trainer, checksum

__all__ = ["PARTS", "check_writable", "run_and_report", "run_benchmark"]


log = logging.getLogger("benchmarks")
TMS = tms_mod.NAME


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
        checkpoint=cfg.checkpoint,
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
    later = [
        *([f"the onload tail ({cfg.tail_onloads} weights onloads)"] if cfg.tail_onloads else []),
        *([f"the checkpoint report ({6 * cfg.checkpoint_repeats} saves)"] if cfg.checkpoint else []),
        *([f"the planner report ({8 * cfg.planner_seeds} plans)"] if cfg.planner else []),
        *(
            [f"the torch-native report (4 ways x 2 parts x {cfg.warmup + cfg.torch_native_repeats} cycles)"]
            if cfg.torch_native
            else []
        ),
        *(
            [
                f"the soak ({cfg.soak_cycles} full cycles with {cfg.soak_cycles // cfg.soak_train_every} train steps, last)"
            ]
            if cfg.soak_cycles
            else []
        ),
    ]
    if later:
        echo(f"then, not in that estimate: {', '.join(later[:-1]) + ' and ' if len(later) > 1 else ''}{later[-1]}")
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
    checksum_before = checksum(mm, trainer)
    changed_by: dict[str, list[str]] = {}  # method -> parts whose bytes differed after its restore
    # One host buffer for every part's copy (the largest: the full cycle), none for grads; one
    # device buffer for the largest part, grads' zero-fill included.
    ceiling.prepare(device_bytes=max(nbytes.values()), host_bytes=nbytes[FULL])
    remote = next((m for m in alternatives if getattr(m, "remote", False)), None)
    try:
        for part in PARTS:
            t_part = time.perf_counter()
            res["timings"] += time_part(
                part, cfg, nbytes, device, manager, ceiling, bound, alternatives, res["memory"], changed_by
            )
            res["part_seconds"][part] = time.perf_counter() - t_part
            res["missing_parts"].remove(part)
            if remote is not None:
                res[TMS] = tms_results(remote, changed_by)
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
            res[TMS] = tms_results(remote, changed_by, bye)
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
    if cfg.checkpoint:  # before the integrity check: the saves' sleeps and wakes are checked too
        t_ck = time.perf_counter()
        res["checkpoint"] = measure_checkpoint(mm, cfg.checkpoint_repeats, cfg.checkpoint_dir)
        ck = res["checkpoint"]
        dp = ck["gb_per_s"].get("save_asleep_dp")
        log.info(
            "checkpoint: %.2f GB saved asleep at %.2f GB/s (resharding=False %s) against a plain write at "
            "%.2f GB/s; done in %.1f s",
            ck["tensor_bytes"] / 1e9,
            ck["gb_per_s"]["save_asleep"],
            f"{dp:.2f} GB/s" if dp is not None else "not measured: " + ck["not_measured"]["resharding=False"],
            ck["gb_per_s"]["plain_write"],
            time.perf_counter() - t_ck,
        )
        publish(res)
    if cfg.planner:
        res["planner"] = measure_planner(cfg.planner_repeats, cfg.planner_seeds)
        pl = res["planner"]
        log.info(
            "residency planner: %d plans, median %.1f ms, slowest median %.1f ms (target < %.0f ms)",
            len(pl["rows"]),
            pl["median_of_medians_ms"],
            pl["slowest_median_ms"],
            pl["target_ms"],
        )
        publish(res)
    if cfg.torch_native:  # the megatron trainer asleep meanwhile: its memory is not the torch trainers'
        t_tn = time.perf_counter()
        mm.offload(force=True)
        try:
            res["torch_native"] = measure_torch_native(
                cfg.trainer, device, cfg.torch_native_repeats, cfg.warmup, cfg.batch_size, cfg.bucket_size_mb, pin, echo
            )
        finally:
            mm.onload()
        tn = res["torch_native"]
        full = {r["method"]: r for r in tn["rows"] if r["part"] == "full" and r["direction"] == "onload"}
        log.info(
            "torch-native: full onload %.2f GB/s (manager) against %.2f (per tensor), %.2f (model.to), "
            "%.2f (ceiling); done in %.1f s",
            *(full[m]["gb_per_s"] for m in ("manager", "per_tensor_to_cpu", "model_to", "ceiling")),
            time.perf_counter() - t_tn,
        )
        publish(res)
    checksum_after = checksum(mm, trainer)
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
    res["host_memory_plan"]["rss_bytes_peak"] = peak_rss()
    res["elapsed_seconds"] = time.perf_counter() - t_start
    res["complete"] = True
    res["targets"] = check_targets(res)
    publish(res)
    return res


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
