"""Non-blocking transitions of a megatron-core trainer: a training step overlapping the onload that
precedes it, swaps between two trainers, and a stress test racing random transitions against
training from two threads. The exactness, layout and misuse tests run non-blocking too (each is
parametrized over ``trainer_runs.TRANSITIONS``)."""

import random
import threading
import time
import warnings

import pytest
import torch
from trainer_runs import BATCH, NON_BLOCKING, bit_equal, slow_lanes, snapshot, train

from chatlearn_mem import Part, TrainerMemoryManager, copy_engine, swap
from chatlearn_mem.models import gpt
from chatlearn_mem.storage import unique_storages

CFG = gpt.GPTTrainerConfig()


def _step(trainer, cfg, step):
    return trainer.train_step(gpt.synthetic_batch(cfg, step, batch_size=BATCH))


def test_train_step_starts_while_the_weights_are_still_arriving(dist1):
    base_losses, base_state, _, _ = train(CFG, steps=4)
    trainer = gpt.build_gpt_trainer(CFG)
    mm = TrainerMemoryManager(trainer.model, trainer.optimizer, NON_BLOCKING)
    losses = [_step(trainer, CFG, s) for s in range(2)]
    mm.offload()
    in_flight_at_first_layer = []
    embedding = trainer.model.module.embedding

    def probe(module, args):
        gt = mm.state.in_flight(Part.WEIGHTS)
        in_flight_at_first_layer.append(gt is not None and not gt.batch.done())

    handle_probe = embedding.register_forward_pre_hook(probe)
    with slow_lanes(1e-3):
        handle = mm.onload(blocking=False)
        losses += [_step(trainer, CFG, 2)]  # zero_grad_buffer, forward, backward, step: each waits as needed
    handle_probe.remove()
    assert in_flight_at_first_layer == [True], "the forward only began once every weight had arrived"
    assert [s.group for s in handle.wait()] == ["grads", "weights", "main_weights", "optimizer_states"]
    losses += [_step(trainer, CFG, 3)]
    assert losses == base_losses
    assert bit_equal(snapshot(trainer), base_state)
    assert mm.audit().ok


def test_overlapped_param_gather_waits_for_every_weight_before_the_forward(dist1):
    cfg = gpt.GPTTrainerConfig(overlap_grad_reduce=True, overlap_param_gather=True, ddp_bucket_size=4000)
    trainer = gpt.build_gpt_trainer(cfg)
    mm = TrainerMemoryManager(trainer.model, trainer.optimizer, NON_BLOCKING)
    assert mm.state.weight_users == []  # megatron's pre-hooks gather whole buckets: no per-module fences
    _step(trainer, cfg, 0)
    mm.offload()
    seen = []
    hook = trainer.model.module.embedding.register_forward_pre_hook(
        lambda m, a: seen.append(
            mm.state.in_flight(Part.WEIGHTS).batch.done() if mm.state.in_flight(Part.WEIGHTS) else True
        )
    )
    with slow_lanes(1e-3):
        mm.onload(blocking=False)
        _step(trainer, cfg, 1)
    hook.remove()
    assert seen == [True]
    assert mm.audit().ok


def _resident(*trainers) -> int:
    tensors = []
    for t in trainers:
        mm = t._mm
        tensors += [x for p in mm.parts for x in mm.state.hooks.part_tensors(p) if x is not None]
    return sum(s.nbytes() for s in unique_storages(tensors, torch.device("cpu")))


@pytest.mark.parametrize("blocking", [True, False])
def test_swap_between_two_trainers_is_exact_and_never_holds_both(dist1, monkeypatch, blocking):
    small = gpt.GPTTrainerConfig(hidden_size=32, num_layers=1)
    # references: each trainer alone, no offload
    ref_a, state_a, _, _ = train(CFG, steps=4)
    ref_b, state_b, _, _ = train(small, steps=4)
    a, b = gpt.build_gpt_trainer(CFG), gpt.build_gpt_trainer(small)
    a._mm = TrainerMemoryManager(a.model, a.optimizer, NON_BLOCKING)
    b._mm = TrainerMemoryManager(b.model, b.optimizer, NON_BLOCKING)
    full = {"a": None, "b": None}
    losses_a, losses_b = [], []
    b._mm.offload()
    peaks = []
    for step in range(4):
        losses_a.append(_step(a, CFG, step))
        full["a"] = full["a"] or _resident(a)
        monkeypatch.setattr(copy_engine, "_before_step", lambda lane, label: peaks.append(_resident(a, b)))
        out = swap(out=a._mm, into=b._mm, headroom_bytes=0, blocking=blocking)
        if not blocking:
            out = out.wait()
        monkeypatch.undo()
        assert [s.direction for s in out] == ["offload"] * 4 + ["onload"] * 4
        losses_b.append(_step(b, small, step))
        full["b"] = full["b"] or _resident(b)
        swap(out=b._mm, into=a._mm, blocking=blocking)
        if not blocking:
            a._mm.residency()  # waits
    assert losses_a == ref_a and losses_b == ref_b
    b._mm.onload()
    assert bit_equal(snapshot(a), state_a) and bit_equal(snapshot(b), state_b)
    assert max(peaks) <= max(full.values()), (max(peaks), full)
    assert a._mm.audit().ok and b._mm.audit().ok


def test_a_thousand_random_non_blocking_transitions_race_training_from_two_threads(dist1):
    """Thread 1 issues 1000 random non-blocking offloads and onloads (waiting on some handles, dropping
    the rest); thread 2 trains, each step preceded by a non-blocking onload. A lock orders only the
    *issuing* of calls (a step must not start while a transition is being issued); the copies race
    freely with the training and with each other. The result must equal the serial run bit for bit."""
    steps = 12
    base_losses, base_state, _, _ = train(CFG, steps=steps)
    trainer = gpt.build_gpt_trainer(CFG)
    mm = TrainerMemoryManager(trainer.model, trainer.optimizer, NON_BLOCKING)
    issue = threading.Lock()
    errors, losses = [], []
    done_training = threading.Event()
    rng = random.Random(1234)
    parts = list(Part)
    counts = {"offload": 0, "onload": 0, "waited": 0}

    def transitions():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "already offloaded" no-ops are part of the race
                for i in range(1000):
                    chosen = rng.sample(parts, rng.randint(1, len(parts)))
                    kind = rng.choice(["offload", "onload"])
                    with issue:
                        if kind == "offload":
                            handle = mm.offload(chosen, force=False, blocking=False)
                        else:
                            handle = mm.onload(chosen, blocking=False)
                    counts[kind] += 1
                    if rng.random() < 0.3:
                        handle.wait()  # outside the lock: races the training thread's calls
                        counts["waited"] += 1
                    if i % 50 == 0:
                        time.sleep(0.001)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def training():
        try:
            for step in range(steps):
                with issue:
                    mm.onload(blocking=False)  # what the other thread offloaded: waited for, not refused
                    losses.append(_step(trainer, CFG, step))
                time.sleep(0.005)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            done_training.set()

    threads = [threading.Thread(target=transitions), threading.Thread(target=training)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors
    assert counts["offload"] + counts["onload"] == 1000 and counts["waited"] > 100
    mm.onload()
    assert losses == base_losses
    assert bit_equal(snapshot(trainer), base_state)
    assert mm.audit().ok
