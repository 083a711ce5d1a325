"""The benchmark's opt-in reports, their pure parts: the planner report's seeded schedules, each
report's markdown section and target from a results dict (no trainer is built; the smoke run in
tests/megatron/test_benchmarks.py runs both reports end to end)."""

import random

import pytest

pytest.importorskip("psutil")

from chatlearn_mem_bench.checkpoint_saves import KINDS, checkpoint_lines, checkpoint_targets  # noqa: E402
from chatlearn_mem_bench.plan import plan_host_memory  # noqa: E402
from chatlearn_mem_bench.planner_speed import (  # noqa: E402
    TARGET_MS,
    measure_planner,
    models_schedule,
    planner_lines,
    planner_targets,
    random_schedule,
)


@pytest.mark.parametrize("make", [models_schedule, random_schedule])
def test_the_planner_schedules_are_64_items_over_8_phases_and_seeded(make):
    sizes, phases, written, scratch = make(random.Random(0))
    assert len(sizes) == 64 and len(phases) == len(written) == 8
    assert all(w <= p for w, p in zip(written, phases)) and scratch <= set(sizes)
    assert make(random.Random(0)) == (sizes, phases, written, scratch)  # the same schedule every time
    assert make(random.Random(1))[0] != sizes


def test_the_planner_report_rows_summary_and_target():
    pl = measure_planner(repeats=1, seeds=1)
    assert len(pl["rows"]) == 8 and pl["target_ms"] == TARGET_MS
    # at twice the largest phase of a random schedule, a proof comes at once
    assert any(r["optimal"] and r["bytes_moved"] < r["all_or_nothing_bytes"] for r in pl["rows"])
    md = "\n".join(planner_lines(pl))
    assert "| models | 0 | 1.00 |" in md and "| random | 0 | 2.00 |" in md and "Median of the medians" in md
    fast = dict(pl, slowest_median_ms=TARGET_MS - 1)
    slow = dict(pl, slowest_median_ms=TARGET_MS)
    assert planner_targets(fast)[0]["passed"] and not planner_targets(slow)[0]["passed"]
    assert planner_lines(None) == planner_targets(None) == []


def test_the_checkpoint_report_section_and_its_target():
    seconds = {k: 2.0 for k in KINDS}
    seconds.update(plain_write=1.0, save_async_return=0.5)
    timed = [k for k in KINDS if "return" not in k]
    ck = {
        "tensor_bytes": 2 * 10**9,
        "repeats": 3,
        "seconds": seconds,
        "gb_per_s": {k: 2e9 / seconds[k] / 1e9 for k in timed},
        "save_vs_plain_write": {k: 1.0 / seconds[k] for k in timed},
        "asleep_device_bytes_max": 0,
        "manifest_share_of_save": {k: 0.1 for k in timed if k != "plain_write"},
    }
    md = "\n".join(checkpoint_lines(ck))
    assert "## Checkpoint saves against a plain write (1.86 GiB of tensors, 3 repeat(s), medians)" in md
    assert "| async save, default, asleep: call returns / committed | 0.50 / 2.00 | 1.00 | 0.50 | 10% |" in md
    assert "| plain sequential `f.write` + `fsync` of the same bytes (ceiling) | 1.00 | 2.00 | 1.00 | - |" in md
    (target,) = checkpoint_targets(ck)
    assert target["passed"] and "12 saves of the sleeping trainer" in target["detail"]
    assert not checkpoint_targets(dict(ck, asleep_device_bytes_max=512))[0]["passed"]


def test_the_checkpoint_report_is_planned_only_when_it_runs():
    sizes = {"weights": [1024], "grads": [1024], "main_weights": [2048], "optimizer_states": [4096]}

    def plan(**kw):
        return plan_host_memory(sizes, methods=[], cuda=False, pin=False, bucket_size=2**20, **kw)

    without, with_ = plan(), plan(checkpoint=True)
    added = {i.what: i for i in with_.items if i.held_by == "checkpoint"}
    assert not any(i.held_by == "checkpoint" for i in without.items)
    assert added["checkpoint report: plain-write buffer"].nbytes == 1024 + 2048 + 4096  # the copied parts
    assert with_.pageable_bytes == without.pageable_bytes + sum(i.nbytes for i in added.values())
