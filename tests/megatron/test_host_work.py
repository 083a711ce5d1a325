"""The host's work per call and per step of a trainer's transitions: O(steps) and O(storages),
never O(parameters) of a buffer. Every transition reports its lane's steps, actions and host time
(:class:`~chatlearn_mem.TransferStats`); the weights, one buffer however many parameters it holds,
move in the same steps and actions at 2 layers and at 8; the parts of one storage per tensor grow
by at most two actions per storage."""

import time

import pytest
import torch
from trainer_runs import BATCH

from chatlearn_mem import MemoryConfig, Part, TrainerMemoryManager, copy_engine
from chatlearn_mem.models import gpt


def _manager(layers: int):
    cfg = gpt.GPTTrainerConfig(num_layers=layers, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=16)
    trainer = gpt.build_gpt_trainer(cfg)
    trainer.train_step(gpt.synthetic_batch(cfg, 0, batch_size=BATCH))
    return trainer, TrainerMemoryManager(trainer.model, trainer.optimizer, MemoryConfig(skip_unchanged_weights=False))


def _counted(monkeypatch, call):
    """Run ``call``; returns its stats, the actions the lanes ran and the call's wall time."""
    ran = []
    monkeypatch.setattr(copy_engine, "_before_step", lambda lane, label: ran.append(label))
    t0 = time.perf_counter()
    stats = call()
    wall = time.perf_counter() - t0
    monkeypatch.setattr(copy_engine, "_before_step", copy_engine._NO_HOOK)
    return stats, ran, wall


def _script(name: str):
    """``scripts/<name>.py`` of this checkout, imported as a module."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[2] / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_stats_count_the_steps_actions_and_host_time_of_each_call(dist1, monkeypatch):
    trainer, mm = _manager(2)
    try:
        calls = (  # (untimed preparation, the counted call, the parts it moves)
            (None, mm.offload, len(mm.parts)),
            (None, mm.onload, len(mm.parts)),
            (lambda: mm.offload(Part.WEIGHTS), lambda: mm.onload(Part.WEIGHTS, blocking=False).wait(), 1),
        )
        for prepare, call, parts in calls:
            if prepare is not None:
                prepare()
            stats, ran, wall = _counted(monkeypatch, call)
            assert len(stats) == parts
            assert sum(s.actions for s in stats) == len(ran) > 0  # every action the lanes ran, counted once
            assert all(0 < s.steps <= s.actions for s in stats)
            assert all(0 < s.host_seconds <= wall for s in stats)
        assert mm.audit().ok
    finally:
        mm.close()


def test_a_buffers_parameters_cost_the_lane_nothing_per_parameter(dist1, monkeypatch):
    """The weights of a megatron trainer are one buffer: its transitions take the same steps and
    actions at 2 layers as at 8 (4x the parameters). Main weights and optimizer states are one
    storage per tensor here: each costs a release or a regrow and at most one copy."""
    counts = {}
    for layers in (2, 8):
        trainer, mm = _manager(layers)
        try:
            off = {s.group: s for s in mm.offload()}
            on = {s.group: s for s in mm.onload()}
            mm.offload(Part.WEIGHTS)
            nb = mm.onload(Part.WEIGHTS, blocking=False).wait()[0]
            storages = {p: len(mm.state.storages(Part(p))) for p in ("main_weights", "optimizer_states")}
            counts[layers] = off, on, nb, storages
        finally:
            mm.close()
    (off2, on2, nb2, st2), (off8, on8, nb8, st8) = counts[2], counts[8]
    for a, b in ((off2, off8), (on2, on8)):
        assert (a["weights"].steps, a["weights"].actions) == (b["weights"].steps, b["weights"].actions)
    assert (nb2.steps, nb2.actions) == (nb8.steps, nb8.actions)
    for p in ("main_weights", "optimizer_states"):
        assert st8[p] > st2[p]
        for st, transitions in ((st2, (off2, on2)), (st8, (off8, on8))):
            for t in transitions:  # a release or a regrow per storage, at most one copy per storage
                # (on a CPU device consecutive storages' copies merge in a slab), a few per step
                assert st[p] <= t[p].actions <= 2 * st[p] + 2 * t[p].steps, (p, st[p], t[p])


def test_profile_onload_script_measures_and_profiles_both_cache_settings(dist1, tmp_path):
    """scripts/profile_onload.py (run on the GPU machines) on the bench's tiny trainer: every
    figure is there, each non-blocking onload returned before it was done, and the profile is of
    the onload call."""
    import json

    import pytest

    pytest.importorskip("psutil")  # the bench's extra (installed with [test])
    mod = _script("profile_onload")
    out = tmp_path / "profile.json"
    assert mod.main(["--preset", "tiny", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert sorted(results) == ["empty_cache=False", "empty_cache=True"]
    for r in results.values():
        assert len(r["nonblocking_return_ms"]) == len(r["onload_total_ms"]) == 6
        assert all(a <= b for a, b in zip(r["nonblocking_return_ms"], r["onload_total_ms"]))
        assert len(r["serial_ms"]) == len(r["overlapped_ms"]) == 4
        assert r["weights_storages"] >= 1 and r["weights_mib"] > 0
        assert "direction='onload'" in r["stats"] and "onload" in r["profile_cumtime"]


def test_measure_host_overhead_profiles_each_kind_of_call(dist1):
    """scripts/measure_host_overhead.py --profile: every kind of call has its leading functions,
    per call, and a full onload's regrows are counted once per storage (on a CPU device they run
    on the calling thread, which cProfile follows)."""

    mod = _script("measure_host_overhead")
    row = mod.measure(2, 2, profile=True)
    assert sorted(row["profile"]) == sorted(mod.CALLS) == sorted(row["calls"])
    for prof in row["profile"].values():
        functions = prof["functions"]
        assert 0 < len(functions) <= mod.PROFILE_TOP and prof["profiled_wall_ms"] > 0
        own = [f["tottime_us"] for f in functions]
        assert own == sorted(own, reverse=True) and all(f["ncalls"] > 0 for f in functions)
    regrow = [f for f in row["profile"]["full onload"]["functions"] if f["function"].endswith("(regrow)")]
    assert len(regrow) == 1 and regrow[0]["ncalls"] == sum(row["storages"].values())
    unprofiled = mod.measure(2, 2)
    assert "profile" not in unprofiled and sorted(unprofiled["calls"]) == sorted(mod.CALLS)
    # --device-slab: the same calls with the main weights and optimizer states in a DeviceSlab
    # (on a CPU device in place of the mmap Slab), which is put back afterwards
    from chatlearn_mem.storage import StorageGroup

    kind = StorageGroup._slab_kind
    slabbed = mod.measure(2, 2, device_slab=True)
    assert slabbed["device_slab"] and not unprofiled["device_slab"]
    assert StorageGroup._slab_kind is kind
    for call in ("full offload", "full onload"):  # the copies merge in either slab: as many actions
        assert slabbed["calls"][call]["actions"] == unprofiled["calls"][call]["actions"]
    # one model alone: its table, with no cost per extra parameter (a difference needs two)
    assert set(mod._print_table([unprofiled], "").values()) == {None}


def test_measure_host_overhead_refuses_a_device_slab_this_torch_cannot_lay_out(monkeypatch, capsys):
    # on a GPU machine with torch 2.11, --device-slab both measured the same code twice
    import chatlearn_mem.device_memory as dm

    mod = _script("measure_host_overhead")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dm, "parks_cpu_memory", lambda: False)
    with pytest.raises(SystemExit) as info:
        mod.main(["--layers", "2", "--device-slab", "both"])
    assert info.value.code == 2 and "--device-slab both: cuda_contiguous=True needs" in capsys.readouterr().err


def test_measure_overlap_sync_times_each_kind_against_the_plain_schedule(dist1, tmp_path):
    """scripts/measure_overlap_sync.py on the bench's tiny trainer: every kind has one sample per
    round, the plain schedule is its own reference, the fenced lane copies in the manager's own
    steps, and the manager's onloads leave it exact (the script audits it)."""
    import json

    import pytest

    pytest.importorskip("psutil")  # the bench's extra (installed with [test])
    mod = _script("measure_overlap_sync")
    out = tmp_path / "sync.json"
    assert mod.main(["--preset", "tiny", "--rounds", "2", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert sorted(r["samples"]) == sorted(mod.KINDS) == sorted(r["summary"])
    assert all(len(rows) == 2 for rows in r["samples"].values())
    assert r["summary"]["plain"]["ratio_to_plain"] == 1.0
    assert r["steps"] == len(r["step_mib"]) >= 1
    assert sum(r["step_bytes"]) == r["weights_bytes"] > 0  # the steps copy every byte of the weights
    for name in ("plain", "fenced", "manager"):  # a copy finished within each of those rounds
        assert all(0 < row["copy_end_ms"] <= row["wall_ms"] for row in r["samples"][name])
    with pytest.raises(SystemExit):
        mod.main(["--preset", "tiny", "--rounds", "0"])
