"""Guarantee 4: repeated calls are no-ops, offloaded state is never used, failures lose nothing."""

import re
import threading
import warnings

import pytest
import torch
from trainer_runs import STEPS, bit_equal, train

from chatlearn_mem import (
    ChatlearnMemError,
    OffloadedError,
    Part,
    TrainerMemoryManager,
    UnsupportedLayoutError,
    host_store,
)
from chatlearn_mem import group_transfer as storage
from chatlearn_mem.mcore import layout
from chatlearn_mem.models import gpt

CFG = gpt.GPTTrainerConfig()


@pytest.fixture
def trained(dist1):
    """A bf16 distributed-optimizer trainer after two steps, and its manager."""
    _, _, mm, trainer = train(CFG, steps=2)
    return mm, trainer


@pytest.mark.parametrize("offload,onload", [("offload_weights", "onload_weights"), ("offload", "onload")])
@pytest.mark.parametrize("part", [None, Part.GRADS, Part.MAIN_WEIGHTS, Part.OPTIMIZER_STATES])
def test_repeated_calls_are_noops_with_a_warning(trained, offload, onload, part):
    if offload == "offload_weights" and part is not None:
        pytest.skip("offload_weights() takes no part")
    mm, _ = trained
    args = () if part is None else (part,)
    with pytest.warns(UserWarning, match="already on the device"):
        assert not getattr(mm, onload)(*args)
    getattr(mm, offload)(*args)
    before = mm.residency()
    with pytest.warns(UserWarning, match="already"):
        assert not getattr(mm, offload)(*args)
    assert mm.residency() == before
    getattr(mm, onload)(*args)
    assert mm.audit().ok


def test_forward_with_offloaded_weights_raises(trained):
    mm, trainer = trained
    mm.offload_weights()
    with pytest.raises(OffloadedError, match=r"weights are offloaded: call onload_weights\(\)"):
        with torch.no_grad():
            trainer.loss(gpt.synthetic_batch(CFG, 0))
    with pytest.raises(OffloadedError, match="onload_weights"):  # the inner module is guarded too
        trainer.model.module(torch.zeros(1, 4, dtype=torch.long), torch.arange(4)[None], None)
    mm.onload_weights()
    with torch.no_grad():
        assert torch.isfinite(trainer.loss(gpt.synthetic_batch(CFG, 0)))


def test_training_forward_with_released_grads_raises_but_no_grad_forward_works(trained):
    mm, trainer = trained
    batch = gpt.synthetic_batch(CFG, 0)
    with torch.no_grad():
        expected = trainer.loss(batch)
    mm.offload(Part.GRADS)
    with pytest.raises(OffloadedError, match=r"onload\(\['grads'\]\)"):
        trainer.loss(batch)
    with torch.no_grad():
        assert torch.equal(trainer.loss(batch), expected)
    mm.onload(Part.GRADS)
    trainer.train_step(batch)


@pytest.mark.parametrize("part", ["main_weights", "optimizer_states"])
def test_step_with_offloaded_optimizer_part_raises(trained, part):
    mm, trainer = trained
    mm.offload(part)
    with pytest.raises(OffloadedError, match=rf"{part} are offloaded: call onload\(\['{part}'\]\)"):
        trainer.train_step(gpt.synthetic_batch(CFG, 5))
    mm.onload(part)
    trainer.train_step(gpt.synthetic_batch(CFG, 6))
    assert mm.audit().ok


def test_step_before_first_state_exists_with_states_offloaded_raises(dist1):
    trainer = gpt.build_gpt_trainer(CFG)
    mm = TrainerMemoryManager(trainer.model, trainer.optimizer)
    mm.offload(Part.OPTIMIZER_STATES)  # nothing exists yet: an empty offload
    with pytest.raises(OffloadedError, match="optimizer_states"):
        trainer.train_step(gpt.synthetic_batch(CFG, 0))
    mm.onload(Part.OPTIMIZER_STATES)
    trainer.train_step(gpt.synthetic_batch(CFG, 0))


def _backward_without_step(trainer):
    trainer.model.zero_grad_buffer()
    trainer.loss(gpt.synthetic_batch(CFG, 7)).backward()
    trainer.model.finish_grad_sync()


def test_free_grads_refuses_unconsumed_gradients(trained):
    mm, trainer = trained
    _backward_without_step(trainer)
    before = mm.residency()
    with pytest.raises(ChatlearnMemError, match=r"no optimizer step has consumed.*force=True"):
        mm.offload(Part.GRADS)
    with pytest.raises(ChatlearnMemError, match="force=True"):
        mm.offload()
    assert mm.residency() == before  # the refused offload released nothing
    assert not any(mm.is_offloaded(p) for p in Part)
    mm.offload(Part.GRADS, force=True)
    mm.onload(Part.GRADS)
    assert all(not b.grad_data.any() for b in layout.ddp_buffers(trainer.model))


def test_free_grads_allowed_after_step_or_zeroing(trained):
    mm, trainer = trained
    resident = mm.residency().device_bytes
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in layout.ddp_buffers(trainer.model))

    def freed_and_back() -> None:
        assert mm.is_offloaded(Part.GRADS) and mm.residency().device_bytes == resident - grads
        mm.onload(Part.GRADS)
        assert not mm.is_offloaded(Part.GRADS) and mm.residency().device_bytes == resident
        assert all(not b.grad_data.any() for b in layout.ddp_buffers(trainer.model))

    mm.offload(Part.GRADS)  # the last thing that happened was a step: no error
    freed_and_back()
    _backward_without_step(trainer)
    trainer.model.zero_grad_buffer()
    mm.offload(Part.GRADS)  # zeroed: nothing to lose, no error
    freed_and_back()


def _cycle_then_continue(fail_patch, monkeypatch):
    """Train 3 steps, fail one offload/onload with ``fail_patch``, recover, finish; compare."""
    base_losses, base_state, _, _ = train(CFG)
    trainer = gpt.build_gpt_trainer(CFG)
    mm = TrainerMemoryManager(trainer.model, trainer.optimizer)
    losses = []
    for step in range(STEPS):
        losses.append(trainer.train_step(gpt.synthetic_batch(CFG, step)))
        if step == 3:
            fail_patch(mm, monkeypatch)
            assert mm.audit().ok
            monkeypatch.undo()
            mm.offload()
            mm.onload()
            assert mm.audit().ok
    from trainer_runs import snapshot

    assert losses == base_losses
    assert bit_equal(snapshot(trainer), base_state)


def test_host_allocation_failure_during_offload_loses_nothing(dist1, monkeypatch):
    def fail(mm, mp):
        before = mm.residency()
        calls = {"n": 0}

        def flaky(nbytes, pin):
            calls["n"] += 1
            if calls["n"] == 2:
                raise MemoryError("simulated host OOM")
            return torch.empty(nbytes, dtype=torch.uint8)

        mp.setattr(host_store, "_allocate_host_bucket", flaky)
        with pytest.raises(MemoryError, match="simulated host OOM"):
            mm.offload()
        assert mm.residency().device_bytes == before.device_bytes
        assert not any(mm.is_offloaded(p) for p in Part)

    _cycle_then_continue(fail, monkeypatch)


@pytest.mark.parametrize("fail_at", [1, 2, 4])
def test_device_allocation_failure_during_onload_loses_nothing(dist1, monkeypatch, fail_at):
    def fail(mm, mp):
        mm.offload()
        calls = {"n": 0}
        real = storage._grow_storage

        def flaky(s, n, *args):
            calls["n"] += 1
            if calls["n"] == fail_at:
                raise torch.OutOfMemoryError("simulated device OOM")
            real(s, n, *args)

        mp.setattr(storage, "_grow_storage", flaky)
        with pytest.raises(torch.OutOfMemoryError, match="simulated device OOM"):
            mm.onload()
        assert any(mm.is_offloaded(p) for p in Part)
        mp.undo()
        mm.onload()  # retry once memory is available

    _cycle_then_continue(fail, monkeypatch)


def test_in_flight_communication_is_refused(trained):
    mm, trainer = trained
    group = layout.bucket_groups([trainer.model])[0]
    group.grad_reduce_handle = object()
    try:
        with pytest.raises(ChatlearnMemError, match="in flight.*finish_grad_sync"):
            mm.offload()
    finally:
        group.grad_reduce_handle = None
    assert not mm.is_offloaded("weights")


def test_concurrent_calls_are_serialised(trained):
    mm, trainer = trained
    errors = []

    def worker():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for _ in range(20):
                    mm.offload()
                    mm.onload()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert not any(mm.is_offloaded(p) for p in Part)
    assert mm.audit().ok


def test_unsupported_megatron_version_is_refused(trained, monkeypatch):
    for refused in ("0.12.3", "0.20.0", "1.0.0", "not-a-version"):
        with pytest.raises(UnsupportedLayoutError, match=rf"{re.escape(refused)} is not supported.*0\.13 to 0\.19"):
            layout.check_supported_version(refused)
    for accepted in ("0.13.0", "0.16.1", "0.17.0", "0.19.2", "0.19.9rc1"):
        assert layout.check_supported_version(accepted) == accepted
    _, trainer = trained
    monkeypatch.setattr(layout, "megatron_core_version", lambda: "0.11.0")
    with pytest.raises(UnsupportedLayoutError, match="pip install"):
        TrainerMemoryManager(trainer.model, trainer.optimizer)


def test_version_ignores_the_git_hash_megatron_appends(monkeypatch):
    """megatron-core 0.19 appends ``git rev-parse --short HEAD`` of the current directory to its
    version ("0.19.2+41a04a1"): the repository the user runs from, not megatron's build."""
    from megatron.core import package_info

    monkeypatch.setattr(package_info, "__version__", "0.19.2+41a04a1")
    assert layout.megatron_core_version() == "0.19.2"


def test_wrong_argument_types_are_refused(trained):
    _, trainer = trained
    with pytest.raises(TypeError, match="not megatron.core.distributed.DistributedDataParallel"):
        TrainerMemoryManager(trainer.model.module, trainer.optimizer)
    with pytest.raises(TypeError, match="get_megatron_optimizer"):
        TrainerMemoryManager(trainer.model, torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1))
    with pytest.raises(TypeError, match="MemoryConfig"):
        TrainerMemoryManager(trainer.model, trainer.optimizer, config={"bucket_size_mb": 1})
