"""Guarantee 1: offload/onload cycles between train steps change nothing, bit for bit (one rank;
the multi-rank runs are in tests/multirank/test_trainer_exactness_multirank.py)."""

import pytest
from trainer_runs import STEPS, TRANSITIONS, bit_equal, train

from chatlearn_mem import Part
from chatlearn_mem.models import gpt

LAYOUTS = {
    "bf16-distopt": dict(precision="bf16", use_distributed_optimizer=True),
    "bf16-float16opt": dict(precision="bf16", use_distributed_optimizer=False),
    "fp32-distopt": dict(precision="fp32", use_distributed_optimizer=True),
    "fp32-fp32opt": dict(precision="fp32", use_distributed_optimizer=False),
    "bf16-distopt-bf16grads": dict(precision="bf16", use_distributed_optimizer=True, grad_reduce_in_fp32=False),
}


@pytest.mark.parametrize("transitions", list(TRANSITIONS))
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_full_cycle_every_step_is_bit_exact(dist1, name, transitions):
    cfg = gpt.GPTTrainerConfig(**LAYOUTS[name])
    base_losses, base_state, _, _ = train(cfg)
    between, config = TRANSITIONS[transitions]
    losses, state, mm, trainer = train(cfg, between=between, config=config)
    assert len(losses) == STEPS
    assert losses == base_losses
    assert bit_equal(state, base_state)
    assert losses[-1] < losses[0]  # it really trained


def _weights_only(mm, trainer, step, blocking=True):
    if blocking:
        mm.offload_weights()
        mm.onload_weights()
    else:
        mm.offload_weights(blocking=False)
        mm.onload_weights(blocking=False)


def _grads_only(mm, trainer, step, blocking=True):
    if blocking:
        mm.offload(Part.GRADS)
        mm.onload(Part.GRADS)
    else:
        mm.offload(Part.GRADS, blocking=False)
        mm.onload(Part.GRADS, blocking=False)


def _optimizer_only(mm, trainer, step, blocking=True):
    mm.offload([Part.MAIN_WEIGHTS, Part.OPTIMIZER_STATES], blocking=blocking)
    mm.onload([Part.MAIN_WEIGHTS, Part.OPTIMIZER_STATES], blocking=blocking)


def _forward_only_phase(mm, trainer, step, blocking=True):
    # What a PPO loop does around a scoring phase: sleep fully, wake weights alone, sleep, wake all.
    mm.offload(blocking=blocking)
    mm.onload(Part.WEIGHTS, blocking=blocking)
    assert mm.audit().ok
    mm.offload(blocking=blocking)
    mm.onload(blocking=blocking)


def _alternating(mm, trainer, step, blocking=True):
    if step % 2:
        if blocking:
            mm.offload(Part.MAIN_WEIGHTS)
            mm.offload(Part.OPTIMIZER_STATES)
            mm.onload(Part.OPTIMIZER_STATES)
            mm.onload(Part.MAIN_WEIGHTS)
        else:
            mm.offload(Part.MAIN_WEIGHTS, blocking=False)
            mm.offload(Part.OPTIMIZER_STATES, blocking=False)
            mm.onload(Part.OPTIMIZER_STATES, blocking=False)
            mm.onload(Part.MAIN_WEIGHTS, blocking=False)
    else:
        if blocking:
            mm.offload(Part.GRADS)
            mm.offload_weights()
            mm.onload_weights()
            mm.onload(Part.GRADS)
        else:
            mm.offload(Part.GRADS, blocking=False)
            mm.offload_weights(blocking=False)
            mm.onload_weights(blocking=False)
            mm.onload(Part.GRADS, blocking=False)


@pytest.mark.parametrize("transitions", list(TRANSITIONS))
@pytest.mark.parametrize("between", [_weights_only, _grads_only, _optimizer_only, _forward_only_phase, _alternating])
@pytest.mark.parametrize("name", ["bf16-distopt", "bf16-float16opt"])
def test_partial_offload_is_bit_exact(dist1, name, between, transitions):
    cfg = gpt.GPTTrainerConfig(**LAYOUTS[name])
    base_losses, base_state, _, _ = train(cfg)
    blocking = transitions == "blocking"
    losses, state, mm, _ = train(
        cfg, between=lambda *a: between(*a, blocking=blocking), config=TRANSITIONS[transitions][1]
    )
    assert losses == base_losses
    assert bit_equal(state, base_state)
    assert mm.audit().ok


def test_forward_only_phase_skips_copy_of_unchanged_weights(dist1):
    cfg = gpt.GPTTrainerConfig()
    _, _, mm, trainer = train(cfg, steps=2)
    first = {s.group: s for s in mm.offload()}
    assert first["weights"].copied_bytes > 0
    mm.onload(["weights"])  # plain names work too
    import torch

    with torch.no_grad():
        trainer.loss(gpt.synthetic_batch(cfg, 99))  # forward only: weights unchanged
    second = mm.offload_weights()
    assert second.copied_bytes == 0 and second.nbytes == first["weights"].nbytes
    mm.onload()
    # a step changes the weights: the next offload must copy again
    trainer.train_step(gpt.synthetic_batch(cfg, 100))
    third = {s.group: s for s in mm.offload()}
    assert third["weights"].copied_bytes == first["weights"].copied_bytes
    assert third["main_weights"].copied_bytes > 0 and third["optimizer_states"].copied_bytes > 0
    mm.onload()
    assert mm.audit().ok


@pytest.mark.parametrize("transitions", list(TRANSITIONS))
def test_full_cycles_through_a_device_slab_are_bit_exact(dist1, monkeypatch, transitions):
    """The main weights and optimizer states laid out in a DeviceSlab (what ``cuda_contiguous`` lays
    them out in on CUDA), here on the CPU backend: the same segments, pieces and merged copies."""
    from chatlearn_mem.device_memory import DeviceSlab, Slab
    from chatlearn_mem.storage import StorageGroup

    cfg = gpt.GPTTrainerConfig(**LAYOUTS["bf16-distopt"])
    base_losses, base_state, _, _ = train(cfg)
    real = StorageGroup._slab_kind
    monkeypatch.setattr(StorageGroup, "_slab_kind", lambda g, s: DeviceSlab if real(g, s) is Slab else real(g, s))
    between, config = TRANSITIONS[transitions]
    losses, state, mm, _ = train(cfg, between=between, config=config)
    assert losses == base_losses
    assert bit_equal(state, base_state)
    slabs = {part: mm.state.group(part).slab for part in (Part.MAIN_WEIGHTS, Part.OPTIMIZER_STATES)}
    assert all(isinstance(s, DeviceSlab) and s.allocated for s in slabs.values()), slabs
