"""What the GPU run may take, checked from the configs before it starts (the dry run prints and
checks it; the run prints it): the chosen steps' budgets fit the time of one device call, and each
bench step's planned host memory, device memory and estimated time fit their bounds."""

from __future__ import annotations

from chatlearn_mem_bench.gpu_validate.benches import BENCH_STEPS
from chatlearn_mem_bench.gpu_validate.steps import BUDGET_S, DEFAULT_STEPS, OPTIONAL, TOTAL_BUDGET_S

__all__ = [
    "DEVICE_SHARE",
    "ESTIMATE_SHARE",
    "GPU_DEVICE_BYTES",
    "GPU_HOST_BYTES",
    "HOST_BOUND_BYTES",
    "bench_outlook",
    "check_bounds",
]

ESTIMATE_SHARE = 0.9
"""The benchmark's estimate may use at most this share of its step's budget."""
GPU_HOST_BYTES = 128 * 2**30
"""Host memory of the GPU machine."""
HOST_BOUND_BYTES = GPU_HOST_BYTES // 2
"""The benchmark's planned host memory peak (pinned + pageable) must stay under this: half the
machine, leaving the rest to the process itself, the CUDA driver, the page cache and the other steps."""
GPU_DEVICE_BYTES = 81559 * 2**20
"""Memory of the smallest GPU the validation is sized for (an H100 80GB HBM3, as CUDA reports it)."""
DEVICE_SHARE = 0.9
"""A benchmark's planned device peak may use at most this share of :data:`GPU_DEVICE_BYTES` (the
rest: CUDA contexts, NCCL, cuBLAS workspaces, the allocator's rounding and fragmentation)."""


def bench_outlook(preset: str = "gpu"):
    """A bench preset's host memory plan, time estimate and device memory plan from its config
    (nothing built), as the GPU machine will run it: pinned buffers, megatron-core 0.19 (its own
    offload calls), torch_memory_saver installed (the wheelhouse carries it)."""
    from chatlearn_mem import MemoryConfig
    from chatlearn_mem_bench.config import load_config
    from chatlearn_mem_bench.estimate import estimate_seconds
    from chatlearn_mem_bench.overlap import plan_args as overlap_plan_args
    from chatlearn_mem_bench.plan import (
        activation_bytes,
        estimate_part_sizes,
        plan_device_memory,
        plan_host_memory,
    )

    cfg = load_config(preset)
    sizes = estimate_part_sizes(cfg.trainer)
    overlap = overlap_plan_args(cfg)
    host = plan_host_memory(
        sizes,
        methods=cfg.methods,
        cuda=True,
        pin=True,
        overlap_bytes=overlap.get("overlap_bytes"),
        bucket_size=MemoryConfig(bucket_size_mb=cfg.bucket_size_mb).bucket_size_bytes,
        release_bound=cfg.release_bound,
        tms_retain_cpu_backup=cfg.tms_retain_cpu_backup,
        checkpoint=cfg.checkpoint,
    )
    time_s = estimate_seconds(
        sizes,
        methods=cfg.methods,
        repeats=cfg.repeats,
        warmup=cfg.warmup,
        cycles=cfg.cycles,
        cuda=True,
        pin=True,
        release_bound=cfg.release_bound,
        **overlap,
    )
    device = plan_device_memory(
        sizes,
        methods=cfg.methods,
        release_bound=cfg.release_bound,
        activations=activation_bytes(cfg.trainer, cfg.batch_size),
    )
    return host, time_s, device


def check_bounds(steps: list[str], budget_s: float = TOTAL_BUDGET_S) -> tuple[list[str], list[str]]:
    """Lines to print and problems: the chosen steps' budgets add up to at most ``budget_s``, and
    for every bench step its estimate fits :data:`ESTIMATE_SHARE` of its budget, its host plan
    :data:`HOST_BOUND_BYTES` and its device plan :data:`DEVICE_SHARE` of :data:`GPU_DEVICE_BYTES`."""
    lines, problems = [], []
    total = sum(BUDGET_S[s] for s in steps)
    lines.append(
        f"time budget: {' + '.join(f'{s} {BUDGET_S[s]}' for s in steps)} = {total} s "
        f"(at most {budget_s:.0f} s); {', '.join(o for o in OPTIONAL if o in steps) or 'no step'} optional"
    )
    if total > budget_s:
        problems.append(f"the steps' budgets add up to {total} s, over {budget_s:.0f} s: run fewer steps per call")
    if sum(BUDGET_S[s] for s in DEFAULT_STEPS) > TOTAL_BUDGET_S:
        problems.append(f"the default steps' budgets add up to over {TOTAL_BUDGET_S} s")
    for step in (s for s in steps if s in BENCH_STEPS):
        preset = BENCH_STEPS[step]
        host, time_s, device = bench_outlook(preset)
        lines += [f"{step} ({preset}) {host.summary()}", f"{step} ({preset}) {time_s.summary()}"]
        lines.append(
            f"{step} ({preset}) device memory plan: peak {device['peak_bytes'] / 2**30:.1f} GiB (setup "
            f"{device['setup_bytes'] / 2**30:.1f} GiB, timing {device['timing_bytes'] / 2**30:.1f} GiB) of "
            f"{GPU_DEVICE_BYTES / 2**30:.1f} GiB: "
            + "; ".join(f"{what} {n / 2**30:.1f} GiB" for what, n in device["items"])
        )
        problems += _bench_problems(step, preset, host.peak_bytes, time_s.total_s, device["peak_bytes"])
    return lines, problems


def _bench_problems(step: str, preset: str, host_bytes: int, seconds: float, device_bytes: int) -> list[str]:
    """A bench step's plan over its bounds, each with what to shrink."""
    problems = []
    if host_bytes > HOST_BOUND_BYTES:
        problems.append(
            f"the {step} step's bench plans {host_bytes / 2**30:.1f} GiB of host memory, over its bound of "
            f"{HOST_BOUND_BYTES / 2**30:.0f} GiB (half the GPU machine's "
            f"{GPU_HOST_BYTES / 2**30:.0f} GiB): shrink configs/bench/{preset}.yaml"
        )
    if seconds > ESTIMATE_SHARE * BUDGET_S[step]:
        problems.append(
            f"the {step} step's bench is estimated at {seconds:.0f} s, over {ESTIMATE_SHARE:.0%} of its "
            f"{BUDGET_S[step]} s budget: shrink configs/bench/{preset}.yaml (trainer, repeats, cycles)"
        )
    if device_bytes > DEVICE_SHARE * GPU_DEVICE_BYTES:
        problems.append(
            f"the {step} step's bench plans {device_bytes / 2**30:.1f} GiB of device memory, over "
            f"{DEVICE_SHARE:.0%} of an H100's {GPU_DEVICE_BYTES / 2**30:.1f} GiB: shrink configs/bench/{preset}.yaml"
        )
    return problems
