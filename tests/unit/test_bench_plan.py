"""The benchmark's host memory plan and time estimate: pure functions of the parts' sizes (no
trainer is built; the smoke run in tests/megatron/test_benchmarks.py checks them against one)."""

import json
from pathlib import Path

import pytest

pytest.importorskip("psutil")

from chatlearn_mem.host_memory import HostMemory  # noqa: E402
from chatlearn_mem_bench import load_config  # noqa: E402
from chatlearn_mem_bench.plan import (METHOD_COST, HostMemoryPlanError, estimate_part_sizes, estimate_seconds,  # noqa: E402
                                      part_bytes, plan_host_memory, refuse_unless_fits)

RESULTS = Path(__file__).parents[2] / "benchmarks" / "results"
CPU_RUN = RESULTS / "2026-11-23_cpu-2core-xeon-24gib.json"
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
    mib = plan_host_memory({k: [n * 2**10 for n in v] for k, v in SIZES.items()}, methods=ALL, cuda=True, pin=True,
                           bucket_size=2**30)  # the same in KiB units: 1 KiB -> 1 MiB
    assert mib.summary().startswith("host memory plan: peak 21.5 MiB = 16.5 MiB pinned + 5.0 MiB pageable (manager "
                                    "host store 6.0 MiB pinned; ceiling host buffer (shared with release_bound) 6.0 MiB "
                                    "pinned; per_tensor_new_host host copies 3.5 MiB (while per_tensor_new_host runs)")


def test_cpu_plan_counts_the_device_buffers_too():
    """On CPU the "device" is host memory: the ceiling's device buffer (the larger of the full copy
    and grads' zero-fill), and while they run the bound's and replace_rebuild's new buffers."""
    plan = plan_host_memory(SIZES, methods=ALL, cuda=False, pin=False, bucket_size=2**20)
    assert plan.pinned_bytes == 0
    assert plan.pageable_bytes == (6144 + 6144 + 6144 + 1024) + 2 * 3584
    with_bigger_grads = plan_host_memory({**SIZES, "grads": [8192]}, methods=ALL, cuda=False, pin=False,
                                         bucket_size=2**20)
    assert with_bigger_grads.pageable_bytes == (6144 + 6144 + 8192 + 1024) + 8192  # now release_bound's


def test_estimated_sizes_are_the_committed_cpu_runs_bytes():
    measured = json.loads(CPU_RUN.read_text())["model"]["bytes_per_part"]
    assert part_bytes(estimate_part_sizes(load_config("cpu").trainer)) == measured


def test_method_costs_cover_the_committed_cpu_run():
    """METHOD_COST says it is the largest time/ceiling ratio of the committed CPU run, rounded up."""
    rows = json.loads(CPU_RUN.read_text())["timings"]
    med = {(r["part"], r["method"], r["direction"]): r["seconds"]["median"] for r in rows}
    for (part, method, direction), seconds in med.items():
        if part == "grads":
            continue  # nothing copied: the estimate uses a fill
        ratio = seconds / med[(part, "ceiling", direction)]
        assert METHOD_COST[method][direction == "onload"] >= ratio, (part, method, direction, ratio)


def test_time_estimate_is_bytes_over_bandwidth_times_cost():
    sizes = {"weights": [int(5.5e9)], "grads": [0], "main_weights": [], "optimizer_states": []}
    est = estimate_seconds(sizes, methods=[], repeats=3, warmup=1, cycles=2, cuda=True, pin=True)
    copy = 5.5 / 55  # seconds of one pinned copy of the weights
    per_round = copy * (2 * sum(METHOD_COST["manager"]) + sum(METHOD_COST["ceiling"])
                        + sum(METHOD_COST["release_bound"])) + 8 * 0.005  # 8 calls
    assert est.parts_s["weights"] == pytest.approx(4 * per_round)
    assert est.cycles_s == pytest.approx(2 * (copy * sum(METHOD_COST["manager"]) + 2 * 0.005))
    assert est.bandwidths_gbps == {"pinned": 55.0, "pageable": 16.0, "fill": 1000.0}
    with pytest.raises(ValueError, match="copy_gbps must be > 0 on CPU"):
        estimate_seconds(sizes, methods=[], repeats=3, warmup=1, cycles=2, cuda=False, pin=False)


def test_refusal_is_one_line_with_the_numbers_and_what_to_run_instead():
    plan = plan_host_memory({k: [n * 2**10 for n in v] for k, v in SIZES.items()}, methods=ALL, cuda=False,
                            pin=False, bucket_size=2**30)  # 26 MiB, all pageable on CPU
    assert plan.peak_bytes == 26 * 2**20
    refuse_unless_fits(plan, HostMemory(plan.peak_bytes + 2**20, ()), 2**20, lambda room: "unused")  # just fits
    refuse_unless_fits(plan, HostMemory(None, ()), 2**20, lambda room: "unused")  # nothing readable: no check
    with pytest.raises(HostMemoryPlanError) as e:
        refuse_unless_fits(plan, HostMemory(21 * 2**20, (("MemAvailable", 21 * 2**20),)), 2**20,
                           lambda room: f"Run less ({room} bytes left).")
    assert str(e.value) == ("the benchmark would hold up to 0.0 MiB pinned + 26.0 MiB pageable = 26.0 MiB of host "
                            "memory, but the process can use 20.0 MiB (MemAvailable 0.02 GiB; minus a 1.0 MiB margin); "
                            f"nothing was measured. Run less ({20 * 2**20} bytes left).")
