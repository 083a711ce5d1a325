"""The benchmark's host memory plan and time estimate: pure functions of the parts' sizes (no
trainer is built; the smoke run in tests/megatron/test_benchmarks.py checks them against one)."""

import json
from pathlib import Path

import pytest

pytest.importorskip("psutil")

from chatlearn_mem import Part  # noqa: E402
from chatlearn_mem.host_memory import HostMemory  # noqa: E402
from chatlearn_mem_bench import load_config  # noqa: E402
from chatlearn_mem_bench.estimate import estimate_seconds  # noqa: E402
from chatlearn_mem_bench.plan import (  # noqa: E402
    HostMemoryPlanError,
    estimate_part_sizes,
    part_bytes,
    plan_host_memory,
    refuse_unless_fits,
)

CPU_RUN = Path(__file__).parents[2] / "benchmarks" / "results" / "2026-11-23_cpu-2core-xeon-24gib.json"
ALL = ["per_tensor_new_host", "fresh_host_alloc", "replace_rebuild", "megatron_builtin"]
# Multiples of 512 (the store's alignment) in one bucket: every figure below is a plain sum.
SIZES = {"weights": [1024], "grads": [4096], "main_weights": [512, 1024], "optimizer_states": [1024, 2048, 512]}


def test_cuda_plan_pins_the_store_and_one_ceiling_buffer_for_the_run_and_nothing_for_grads():
    plan = plan_host_memory(SIZES, methods=ALL, cuda=True, pin=True, bucket_size=2**20)
    # held throughout: store 1024 + 1536 + 3584, one ceiling buffer of the full copy (6144), megatron's
    # param_data_cpu (a power-of-two block of the 1024-byte buffer); while one method runs:
    # fresh_host_alloc's pinned copy of the largest part (3584), megatron's pageable .cpu() of the
    # optimizer (1536 + 3584) the largest pageable one
    assert plan.pinned_bytes == 6144 + 6144 + 1024 + 3584
    assert plan.pageable_bytes == 1536 + 3584
    assert plan.peak_bytes == plan.pinned_bytes + plan.pageable_bytes
    bigger_grads = plan_host_memory({**SIZES, "grads": [10**9]}, methods=ALL, cuda=True, pin=True, bucket_size=2**20)
    assert bigger_grads == plan  # grads are never copied: no host buffer for them
    bare = plan_host_memory(SIZES, methods=[], cuda=True, pin=True, bucket_size=2**20)
    assert (bare.pinned_bytes, bare.pageable_bytes) == (12288, 0)
    mib = plan_host_memory(
        {k: [n * 2**10 for n in v] for k, v in SIZES.items()}, methods=ALL, cuda=True, pin=True, bucket_size=2**30
    )  # the same in KiB units: 1 KiB -> 1 MiB
    assert mib.summary().startswith(
        "host memory plan: peak 21.5 MiB = 16.5 MiB pinned + 5.0 MiB pageable (manager "
        "host store 6.0 MiB pinned; ceiling host buffer (shared with release_bound) 6.0 MiB "
        "pinned; per_tensor_new_host host copies 3.5 MiB (while per_tensor_new_host runs)"
    )


def test_cpu_plan_counts_the_device_buffers_too():
    """On CPU the "device" is host memory: the ceiling's and the bound's device buffers (the larger of
    the full copy and grads' zero-fill; the bound's is held through a part's rounds), and while it
    runs replace_rebuild's new buffers."""
    plan = plan_host_memory(SIZES, methods=ALL, cuda=False, pin=False, bucket_size=2**20)
    assert plan.pinned_bytes == 0
    assert plan.pageable_bytes == (6144 + 6144 + 2 * 6144 + 1024) + 2 * 3584
    with_bigger_grads = plan_host_memory(
        {**SIZES, "grads": [8192]}, methods=ALL, cuda=False, pin=False, bucket_size=2**20
    )
    assert with_bigger_grads.pageable_bytes == (6144 + 6144 + 2 * 8192 + 1024) + 2 * 3584


def test_estimated_sizes_are_the_committed_cpu_runs_bytes():
    measured = json.loads(CPU_RUN.read_text())["model"]["bytes_per_part"]
    estimated = part_bytes(estimate_part_sizes(load_config("cpu").trainer))
    assert estimated.keys() == measured.keys()
    for part, nbytes in measured.items():  # Adam's 4-byte step counters are all that is left out
        assert nbytes - 1024 <= estimated[part] <= nbytes, part


def test_time_estimate_is_copies_over_bandwidth_plus_fresh_pages():
    sizes = {"weights": [int(5.5e9)], "grads": [0], "main_weights": [], "optimizer_states": []}
    est = estimate_seconds(
        sizes,
        methods=["fresh_host_alloc", "per_tensor_new_host"],
        repeats=3,
        warmup=1,
        cycles=2,
        cuda=True,
        pin=True,
        fresh_gbps=5.5,
    )
    pinned, pageable, fresh = 0.1, 5.5 / 16, 1.0  # seconds to copy the weights pinned, pageable; to touch them anew
    per_round = (
        2 * 2 * pinned
        + 2 * pinned
        + 2 * pinned  # manager (untimed, then timed), ceiling, release_bound
        + 2 * pinned
        + 2 * fresh  # fresh_host_alloc: new pages, pinned (counted twice)
        + 2 * pageable
        + fresh  # per_tensor_new_host: new pageable pages
        + 12 * 0.005
    )  # 12 calls
    assert est.parts_s["weights"] == pytest.approx(4 * per_round)
    assert est.cycles_s == pytest.approx(2 * (2 * pinned + 2 * 0.005))
    assert est.bandwidths_gbps == {"pinned": 55.0, "pageable": 16.0, "fill": 1000.0, "fresh pages": 5.5}
    on_cpu = estimate_seconds(
        sizes, methods=[], repeats=3, warmup=1, cycles=2, cuda=False, pin=False, copy_gbps=11.0, fresh_gbps=5.5
    )
    # on CPU every regrow touches fresh pages: the manager's and the bound's onloads
    assert on_cpu.cycles_s == pytest.approx(2 * (2 * 0.5 + fresh + 2 * 0.005))
    with pytest.raises(ValueError, match="copy_gbps must be > 0 on CPU"):
        estimate_seconds(sizes, methods=[], repeats=3, warmup=1, cycles=2, cuda=False, pin=False)


def test_refusal_is_one_line_with_the_numbers_and_what_to_run_instead():
    plan = plan_host_memory(
        {k: [n * 2**10 for n in v] for k, v in SIZES.items()}, methods=ALL, cuda=False, pin=False, bucket_size=2**30
    )  # 32 MiB, all pageable on CPU
    assert plan.peak_bytes == 32 * 2**20
    refuse_unless_fits(plan, HostMemory(plan.peak_bytes + 2**20, ()), 2**20, lambda room: "unused")  # just fits
    refuse_unless_fits(plan, HostMemory(None, ()), 2**20, lambda room: "unused")  # nothing readable: no check
    with pytest.raises(HostMemoryPlanError) as e:
        refuse_unless_fits(
            plan,
            HostMemory(21 * 2**20, (("MemAvailable", 21 * 2**20),)),
            2**20,
            lambda room: f"Run less ({room} bytes left).",
        )
    assert str(e.value) == (
        "the benchmark would hold up to 0.0 MiB pinned + 32.0 MiB pageable = 32.0 MiB of host "
        "memory, but the process can use 20.0 MiB (MemAvailable 0.02 GiB; minus a 1.0 MiB margin); "
        f"nothing was measured. Run less ({20 * 2**20} bytes left)."
    )


def test_the_swap_rows_copy_bound_and_what_the_target_says_of_it():
    """Two host copies at once over the same copies in turn (a ratio, its value a measurement: not
    asserted); the target names the bound when it is above the limit, and passes or fails on the
    measured ratio alone."""
    import math

    from chatlearn_mem_bench.overlap import copy_bound_ratio
    from chatlearn_mem_bench.targets import overlap_targets

    ratio = copy_bound_ratio(2 * 2**20, 2**20, repeats=3, nbytes=2**20)
    assert ratio > 0 and math.isfinite(ratio)
    row = {
        "name": "swap",
        "ratio": 0.9,
        "ratio_spread": [0.85, 0.95],
        "overlapped_s": 0.9,
        "serial_s": 1.0,
        "threads": 1,
        "copy_bound_ratio": 0.97,
    }
    target, near_bound = overlap_targets([row], gpu=False)
    assert (
        not target["passed"] and "out of reach on this machine: two host copies at once take 0.97" in target["detail"]
    )
    assert near_bound["name"] == "overlap swap: within 0.05 of its bound (two copies at once)"
    assert near_bound["passed"]  # 0.90 against a bound of 0.97
    target, near_bound = overlap_targets([{**row, "copy_bound_ratio": 0.6, "ratio": 0.8}], gpu=False)
    assert target["passed"] and "out of reach" not in target["detail"]
    assert not near_bound["passed"] and "0.80 of serial against a bound of 0.60" in near_bound["detail"]
    assert [t["name"] for t in overlap_targets([row], gpu=True)] == ["overlap swap: overlapped <= 0.65 of serial"]


def test_the_gpu_onload_then_forward_target_is_judged_against_the_longer_half():
    # On an H200 the 25 ms weights onload outlasted the 15.6 ms forward: "1.1x the forward alone"
    # was out of reach for any schedule. The bound is the longer of the two, both timed in the row.
    from chatlearn_mem_bench.targets import overlap_targets

    row = {
        "name": "onload_then_forward",
        "ratio": 0.605,
        "ratio_spread": [0.60, 0.61],
        "overlapped_s": 0.0260,
        "serial_s": 0.0430,
        "threads": 16,
        "forward_alone_s": 0.0156,
        "onload_alone_s": 0.0250,
        "best_possible_s": 0.0250,
        "best_possible_ratio": 0.0250 / 0.0430,
    }
    (target,) = overlap_targets([row], gpu=True)
    assert target["name"] == (
        "overlap onload_then_forward: <= 1.1x the longer of the onload alone and the first module's copy then the forward"
    )
    assert target["passed"] and target["detail"].startswith("1.04x")
    (target,) = overlap_targets([{**row, "overlapped_s": 0.0400}], gpu=True)
    assert not target["passed"] and target["detail"].startswith("1.60x")
    old = {k: v for k, v in row.items() if k not in ("onload_alone_s", "best_possible_s")}
    (target,) = overlap_targets([old], gpu=True)  # a result from before the onload was timed alone
    assert not target["passed"] and target["detail"].startswith("1.67x")
    cpu = overlap_targets([row], gpu=False)
    assert cpu[1]["name"] == (
        "overlap onload_then_forward: within 0.05 of its bound "
        "(the longer of the onload alone and the first module's copy then the forward)"
    )
    # on a CPU device the row also times the same schedule with plain copies (the forward beside
    # the copy on one memory bus): the target is judged against that, and says what it was without
    contended = {**row, "plain_overlap_s": 0.0300, "contended_best_s": 0.0300, "contended_best_ratio": 0.0300 / 0.0430}
    target = overlap_targets([contended], gpu=False)[1]
    assert target["name"] == (
        "overlap onload_then_forward: within 0.05 of its bound "
        "(the same schedule with plain copies, the forward beside the copy)"
    )
    assert target["passed"] and target["detail"].startswith("0.60 of serial against a bound of 0.70")
    assert "plain copies in the same schedule take 30.0 ms" in target["detail"]
    assert "the bound without that contention would be 0.58" in target["detail"]
    assert not overlap_targets([{**contended, "ratio": 0.76}], gpu=False)[1]["passed"]
    assert overlap_targets([contended], gpu=True)[0]["name"].startswith("overlap onload_then_forward: <= 1.1x")
    # a row that timed the first module's copy says so, and what the bound would be without it
    with_first = {**row, "first_module_bytes": 48 * 2**20, "first_module_copy_s": 0.006}
    assert (
        "the first module's 48 MiB copy in 6.0 ms; without it the bound would be 0.58"
        in (overlap_targets([with_first], gpu=False)[1]["detail"])
    )


def test_the_cpu_plan_counts_the_copy_bound_buffers():
    from chatlearn_mem_bench.plan import COPY_BOUND_BYTES, copy_bound_sizes

    sizes = {p.value: [2**20] for p in Part}
    overlap = {p.value: 2**19 for p in Part}
    cpu = {
        i.what: i.nbytes
        for i in plan_host_memory(
            sizes, methods=[], cuda=False, pin=False, bucket_size=2**20, overlap_bytes=overlap
        ).items
    }
    # a small trainer: the row's own sizes (4 MiB out, 2 MiB in), sources and destinations
    assert cpu["overlap rows: swap copy-bound buffers"] == 2 * (4 * 2**20 + 2 * 2**20)
    # a large one: scaled so that the larger copy is COPY_BOUND_BYTES
    assert copy_bound_sizes(4 * 2**30, 2**30) == (COPY_BOUND_BYTES, COPY_BOUND_BYTES // 4)
    gpu = {
        i.what
        for i in plan_host_memory(
            sizes, methods=[], cuda=True, pin=True, bucket_size=2**20, overlap_bytes=overlap
        ).items
    }
    assert "overlap rows: swap copy-bound buffers" not in gpu
    # onload_then_forward's bound with plain copies beside the forward: the weights' bytes, twice,
    # freed before the swap row builds its second trainer: a phase of its own, not added to it
    assert cpu["overlap rows: plain-copy bound buffers"] == 2 * 2**20
    plan = plan_host_memory(sizes, methods=[], cuda=False, pin=False, bucket_size=2**20, overlap_bytes=overlap)
    swap_phase = sum(i.nbytes for i in plan.items if i.held_by == "overlap")
    assert plan.pageable_bytes == sum(i.nbytes for i in plan.items if i.held_by is None) + max(swap_phase, 2 * 2**20)
    assert "overlap rows: plain-copy bound buffers" not in gpu


def test_the_first_module_copy_pins_as_the_run_does_not_as_the_config_says():
    """``pin_memory: true`` in the bench config is ignored on a machine without CUDA (the run's host
    buffers are not pinned); the ``onload_then_forward`` row's first-module copy derived its own
    pinning from the config and asked torch for pinned memory there, which raises on CPU."""
    from types import SimpleNamespace

    import torch

    from chatlearn_mem_bench.overlap import _first_module_copy

    cfg = load_config("tiny", ["pin_memory=true", "repeats=3", "warmup=0"])
    mm = SimpleNamespace(
        state=SimpleNamespace(weight_user_ranges=lambda: [[(7, 0, 4096), (7, 8192, 9216)], [(7, 0, 1)]])
    )
    nbytes, samples = _first_module_copy(cfg, mm, torch.device("cpu"), threads=1, pin=False)
    assert nbytes == 4096 + 1024 and len(samples) == 3 and all(t > 0 for t in samples)


def test_torch_memory_saver_is_planned_on_its_tags_bytes_and_only_on_cuda():
    from chatlearn_mem_bench.plan import method_parts, tms_part_bytes
    from chatlearn_mem_bench.tms import TMS_IN_GBPS, TMS_OUT_GBPS

    assert method_parts("torch_memory_saver", cuda=False) == ()
    assert method_parts("torch_memory_saver", cuda=True) == ("weights", "main_weights", "optimizer_states", "full")
    b = part_bytes(SIZES)  # weights 1024, grads 4096, main 1536, states 3584, full 6144
    # its "model" tag holds the weights and the grads; "full" pauses every tag, grads included
    assert [tms_part_bytes(b, p) for p in ("weights", "main_weights", "optimizer_states", "full")] == [
        5120,
        1536,
        3584,
        10240,
    ]
    cuda = dict(cuda=True, pin=True, bucket_size=2**20)
    bare = plan_host_memory(SIZES, methods=[], **cuda)
    plan = plan_host_memory(SIZES, methods=["torch_memory_saver"], **cuda)
    assert plan.pinned_bytes == bare.pinned_bytes + 10240  # its pinned backups, while it runs
    item = next(i for i in plan.items if i.what.startswith("torch_memory_saver"))
    assert item.held_by == "torch_memory_saver" and item.pinned
    retained = plan_host_memory(SIZES, methods=["torch_memory_saver"], tms_retain_cpu_backup=True, **cuda)
    assert next(i for i in retained.items if i.what.startswith("torch_memory_saver")).held_by is None
    assert plan_host_memory(SIZES, methods=["torch_memory_saver"], cuda=False, pin=False, bucket_size=2**20) == (
        plan_host_memory(SIZES, methods=[], cuda=False, pin=False, bucket_size=2**20)
    )
    # time: its bytes at its users' measured rates, per call, in every round of its parts
    big = {p: [n * 10**9 // 1024] for p, (n,) in {k: [sum(v)] for k, v in SIZES.items()}.items()}
    args = dict(repeats=3, warmup=0, cycles=2, cuda=True, pin=True)
    with_tms = estimate_seconds(big, methods=["torch_memory_saver"], **args)
    without = estimate_seconds(big, methods=[], **args)
    bb = part_bytes(big)
    from chatlearn_mem_bench.plan import CALL_OVERHEAD_S

    want = 3 * sum(CALL_OVERHEAD_S + tms_part_bytes(bb, "full") / 1e9 / r for r in (TMS_OUT_GBPS, TMS_IN_GBPS))
    assert with_tms.parts_s["full"] - without.parts_s["full"] == pytest.approx(want)
    assert with_tms.parts_s["grads"] == without.parts_s["grads"]  # not timed on grads


def test_without_the_release_bound_the_plan_and_estimate_leave_it_out():
    cpu = dict(cuda=False, pin=False, bucket_size=2**20)
    with_bound = plan_host_memory(SIZES, methods=[], **cpu)
    without = plan_host_memory(SIZES, methods=[], release_bound=False, **cpu)
    assert with_bound.pageable_bytes - without.pageable_bytes == 6144  # the bound's "device" buffer
    args = dict(repeats=3, warmup=1, cycles=2, cuda=True, pin=True)
    assert (
        estimate_seconds(SIZES, methods=[], release_bound=False, **args).total_s
        < estimate_seconds(SIZES, methods=[], **args).total_s
    )


def test_the_device_plan_holds_the_state_and_the_ceiling_and_what_runs_beside():
    from chatlearn_mem_bench.plan import activation_bytes, plan_device_memory

    b = part_bytes(SIZES)
    state = 1024 + 4096 + 1536 + 3584
    plan = plan_device_memory(SIZES, methods=[], activations=100)
    assert plan["timing_bytes"] == state + 2 * 6144 and plan["setup_bytes"] == state + 100
    assert plan["peak_bytes"] == max(plan["timing_bytes"], plan["setup_bytes"]) and max(b.values()) == 6144
    alone = plan_device_memory(SIZES, methods=[], release_bound=False, activations=100)
    assert alone["timing_bytes"] == state + 6144
    tms = plan_device_memory(SIZES, methods=["torch_memory_saver"], activations=100)
    assert tms["timing_bytes"] == 2 * state + 2 * 6144 and tms["setup_bytes"] == 2 * (state + 100)
    gpu = load_config("gpu")
    assert 1 * 2**30 < activation_bytes(gpu.trainer, gpu.batch_size) < 8 * 2**30  # the step's, about 4 GiB


def test_the_large_preset_fits_an_h100_and_the_gpu_machines_host():
    from chatlearn_mem import MemoryConfig
    from chatlearn_mem_bench.plan import activation_bytes, plan_device_memory

    cfg = load_config("gpu_large")
    sizes = estimate_part_sizes(cfg.trainer)
    params = part_bytes(sizes)["optimizer_states"] / 8
    assert 2.0e9 < params < 3.0e9 and not cfg.release_bound and cfg.methods == []
    device = plan_device_memory(
        sizes, methods=cfg.methods, release_bound=False, activations=activation_bytes(cfg.trainer, cfg.batch_size)
    )
    assert device["peak_bytes"] < 0.9 * 81559 * 2**20  # an H100 80GB, with room for contexts and NCCL
    host = plan_host_memory(
        sizes,
        methods=cfg.methods,
        cuda=True,
        pin=True,
        bucket_size=MemoryConfig(bucket_size_mb=cfg.bucket_size_mb).bucket_size_bytes,
        release_bound=False,
    )
    assert host.peak_bytes < 64 * 2**30  # half the GPU machine's 128 GiB
