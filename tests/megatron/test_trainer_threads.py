"""Calls from several threads (a Ray actor with max_concurrency > 1): serialised, never
interleaved; training started while another thread offloads is refused with a clear error."""

import contextlib
import inspect
import threading
import time
import warnings

import pytest
import torch
from trainer_runs import bit_equal, snapshot, train

from chatlearn_mem import ChatlearnMemError, InferenceMemoryManager, Part, TrainerMemoryManager, storage
from chatlearn_mem.mcore import checks
from chatlearn_mem.models import gpt

CFG = gpt.GPTTrainerConfig()
PARTS = tuple(Part)

# Every public method, in an order in which each call is valid, with its arguments.
TRAINER_CALLS = [
    ("residency", ()),
    ("audit", ()),
    ("mark_weights_dirty", ()),
    ("weights_state_dict", ()),
    ("iter_weights", ()),  # a generator: it takes the lock when first read
    ("offload_weights", ()),
    ("onload_weights", ()),
    ("offload", (Part.GRADS,)),
    ("onload", (Part.GRADS,)),
    ("offload", (Part.MAIN_WEIGHTS,)),
    ("onload", (Part.MAIN_WEIGHTS,)),
    ("offload", (Part.OPTIMIZER_STATES,)),
    ("onload", (Part.OPTIMIZER_STATES,)),
    ("offload", ()),
    ("onload", ()),
    ("close", ()),
]
INFERENCE_CALLS = [
    ("residency", ()),
    ("audit", ()),
    ("mark_weights_dirty", ()),
    ("weights_state_dict", ()),
    ("iter_weights", ()),  # a generator: it takes the lock when first read
    ("offload_weights", ()),
    ("onload_weights", ()),
    ("offload", ()),
    ("onload", ()),
    ("close", ()),
]
UNLOCKED = {"is_offloaded"}  # reads one flag


@pytest.fixture
def trained(dist1):
    _, _, mm, trainer = train(CFG, steps=2)
    return mm, trainer


def _public_methods(cls):
    return {n for n, v in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")}


@pytest.mark.parametrize("kind", ["trainer", "inference"])
def test_every_public_call_waits_for_the_lock(dist1, kind):
    """Hold the manager's lock (as a call in progress does) and check each public call blocks."""
    if kind == "trainer":
        _, _, mm, _ = train(CFG, steps=1)
        calls, cls = TRAINER_CALLS, TrainerMemoryManager
    else:
        mm = InferenceMemoryManager(torch.nn.Linear(8, 8))
        calls, cls = INFERENCE_CALLS, InferenceMemoryManager
    assert _public_methods(cls) - UNLOCKED == {n for n, _ in calls}, "a new public method: add it here"
    for name, args in calls:
        done = threading.Event()
        errors = []

        def call():
            try:
                out = getattr(mm, name)(*args)
                if name == "iter_weights":
                    list(out)
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)
            done.set()

        with mm.state.lock:
            t = threading.Thread(target=call)
            t.start()
            assert not done.wait(0.2), f"{name}() ran while another thread held the manager's lock"
        t.join(30)
        assert done.is_set() and not errors, (name, errors)


def test_concurrent_offload_onload_audit_residency_never_interleave(trained):
    mm, trainer = trained
    full = mm.residency()
    before = snapshot(trainer)
    # Every loop goes on for 3 s and until each has made 6 calls (3 s alone left how many calls the
    # checks below see to a loaded machine's scheduler), for 120 s at most or until one failed.
    stop, give_up = time.monotonic() + 3.0, time.monotonic() + 120.0
    errors, audits, residencies, calls = [], [], [], [0] * 4

    def loop(i, body):
        def run():
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    while (time.monotonic() < stop or min(calls) < 6) and time.monotonic() < give_up and not errors:
                        body()
                        calls[i] += 1
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        return run

    def cycle():
        mm.offload()
        mm.onload()

    def partial_cycle():
        mm.offload([Part.MAIN_WEIGHTS, Part.OPTIMIZER_STATES])
        mm.onload([Part.MAIN_WEIGHTS, Part.OPTIMIZER_STATES])

    bodies = (cycle, partial_cycle, lambda: audits.append(mm.audit()), lambda: residencies.append(mm.residency()))
    threads = [threading.Thread(target=loop(i, f)) for i, f in enumerate(bodies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert min(calls) >= 6, calls
    bad = [str(a) for a in audits if not a.ok]
    assert not bad, bad[:3]  # an audit that saw half of an offload would report it
    # Each call is atomic, so every residency seen is a sum of whole parts: weights and grads
    # (offloaded and onloaded together by both cycles) and main weights and states.
    c = full.by_category
    model, opt = c["weights"] + c["grads"], c["main_weights"] + c["optimizer_states"]
    allowed = {full.device_bytes, 0, model, opt, model + opt}
    assert {r.device_bytes for r in residencies} <= allowed
    mm.onload()
    assert not any(mm.is_offloaded(p) for p in PARTS)
    assert bit_equal(snapshot(trainer), before)
    assert mm.audit().ok
    trainer.train_step(gpt.synthetic_batch(CFG, 9))


@contextlib.contextmanager
def _blocked_in_offload(call, monkeypatch):
    """Run ``call`` (an offload) in another thread, held inside its first part's offload."""
    entered, release = threading.Event(), threading.Event()
    real = storage.StorageGroup.start_offload

    def slow(self, *args, **kwargs):
        entered.set()
        release.wait(30)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(storage.StorageGroup, "start_offload", slow)
    t = threading.Thread(target=call)
    t.start()
    assert entered.wait(30)
    try:
        yield
    finally:
        release.set()
        t.join(30)
        monkeypatch.undo()


@pytest.fixture
def offload_in_progress(trained, monkeypatch):
    """Another thread is inside mm.offload(), blocked in its first storage release."""
    mm, trainer = trained
    with _blocked_in_offload(mm.offload, monkeypatch):
        yield mm, trainer
    mm.onload()
    assert mm.audit().ok


def test_forward_while_another_thread_offloads_is_refused(offload_in_progress):
    mm, trainer = offload_in_progress
    with pytest.raises(
        ChatlearnMemError,
        match=r"forward pass while another thread is inside "
        r"TrainerMemoryManager\.offload\(\)",
    ):
        trainer.loss(gpt.synthetic_batch(CFG, 0))
    with pytest.raises(ChatlearnMemError, match="another thread"):
        with torch.no_grad():
            trainer.loss(gpt.synthetic_batch(CFG, 0))


def test_step_while_another_thread_offloads_is_refused(offload_in_progress):
    mm, trainer = offload_in_progress
    with pytest.raises(ChatlearnMemError, match=r"Optimizer\.step\(\) while another thread is inside"):
        trainer.optimizer.step()


def test_forward_during_audit_or_residency_in_another_thread_is_allowed(trained, monkeypatch):
    mm, trainer = trained
    entered, release = threading.Event(), threading.Event()
    real = checks.check_hooks

    def slow(*args):
        entered.set()
        release.wait(30)
        return real(*args)

    monkeypatch.setattr(checks, "check_hooks", slow)
    t = threading.Thread(target=mm.audit)
    t.start()
    assert entered.wait(30)
    try:
        with torch.no_grad():
            assert torch.isfinite(trainer.loss(gpt.synthetic_batch(CFG, 0)))
    finally:
        release.set()
        t.join(30)


def test_inference_forward_while_another_thread_offloads_is_refused(dist1, monkeypatch):
    module = torch.nn.Linear(8, 8)
    mm = InferenceMemoryManager(module)
    with _blocked_in_offload(mm.offload_weights, monkeypatch):
        with pytest.raises(ChatlearnMemError, match=r"InferenceMemoryManager\.offload_weights\(\)"):
            module(torch.ones(1, 8))
    mm.onload_weights()
    assert mm.audit().ok
