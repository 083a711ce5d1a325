"""The host's work per call and per step of a trainer's transitions: O(steps) and O(storages),
never O(parameters) of a buffer. Every transition reports its lane's steps, actions and host time
(:class:`~chatlearn_mem.TransferStats`); the weights, one buffer however many parameters it holds,
move in the same steps and actions at 2 layers and at 8; the parts of one storage per tensor grow
by at most two actions per storage."""

import time

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
