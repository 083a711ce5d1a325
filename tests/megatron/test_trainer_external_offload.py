"""Mixing the manager with megatron-core's own offload calls (0.16+) is caught, named and refused.

megatron-core's ``DistributedDataParallel.offload_grad_buffers`` / ``restore_grad_buffers`` and
``_ParamAndGradBuffer.offload_to_cpu`` / ``reload_from_cpu`` run on CPU and are called for real here.
``MegatronOptimizer.offload_to_cpu`` acts only on CUDA tensors (``p.is_cuda``), so on CPU it is a
no-op (checked below) and its effect, ``p.data`` rebound off the device, is reproduced by hand.
"""

import pytest
import torch
from trainer_runs import BATCH, STEPS, bit_equal, full_cycle, train

from chatlearn_mem import ExternalChangeError, OffloadedError, Part
from chatlearn_mem.models import gpt

CFG = gpt.GPTTrainerConfig()  # bf16, distributed optimizer: param and grad buffers both exist
AT = 3  # the step after which each scenario runs


def _buffers(trainer):
    return trainer.model.buffers + trainer.model.expert_parallel_buffers


def _needs_builtin_offload(trainer):
    if not hasattr(trainer.model, "offload_grad_buffers"):
        pytest.skip("this megatron-core has no built-in offload (added in 0.16)")


@pytest.fixture(scope="module")
def baseline(dist1):
    losses, weights, _, _ = train(CFG)
    return losses, weights


def _run(scenario):
    """Train STEPS steps, running ``scenario(mm, trainer)`` after step AT; return losses and weights."""
    seen = []

    def between(mm, trainer, step):
        if step == AT:
            _needs_builtin_offload(trainer)
            scenario(mm, trainer)
            seen.append(step)

    losses, weights, mm, _ = train(CFG, between=between)
    assert seen == [AT]
    assert mm.audit().ok, mm.audit()
    return losses, weights


def _refused(mm, call, *match):
    residency = mm.residency()
    with pytest.raises(ExternalChangeError) as e:
        call()
    for m in match:
        assert m in str(e.value), str(e.value)
    assert mm.residency() == residency  # refused before anything changed
    return str(e.value)


def test_grads_released_by_megatron_are_named_and_refused(baseline):
    def scenario(mm, trainer):
        trainer.model.offload_grad_buffers(synchronize=False, empty_cache=False)
        report = mm.audit()
        assert not report.ok and any("grads:" in p and "offload_grad_buffers" in p for p in report.problems), report
        _refused(mm, mm.offload, "grads:", "offload_grad_buffers", "restore_grad_buffers")
        _refused(mm, lambda: mm.offload(Part.GRADS), "grads:")
        assert not any(mm.is_offloaded(p) for p in Part)
        trainer.model.restore_grad_buffers(synchronize=False)  # what the message says to do
        assert mm.audit().ok
        full_cycle(mm, trainer, AT)

    losses, weights = _run(scenario)
    assert losses == baseline[0] and bit_equal(weights, baseline[1])


def test_param_buffer_released_by_megatron_is_named_and_refused(baseline):
    def scenario(mm, trainer):
        for b in _buffers(trainer):
            b.offload_to_cpu(move_params=True, move_grads=False)
        _refused(mm, mm.offload_weights, "weights:", "offload_to_cpu", "reload_from_cpu")
        _refused(mm, mm.offload, "weights:")
        assert not mm.audit().ok
        for b in _buffers(trainer):
            b.reload_from_cpu(move_params=True, move_grads=False)
        full_cycle(mm, trainer, AT)

    losses, weights = _run(scenario)
    assert losses == baseline[0] and bit_equal(weights, baseline[1])


def test_stale_reload_by_megatron_into_offloaded_weights_is_refused(dist1):
    """megatron's reload_from_cpu() copies its own host copy into storages the manager released:
    the manager must not call that trainer onloaded, and must not mix its bytes with megatron's."""

    def scenario(mm, trainer):
        buffers = _buffers(trainer)
        for b in buffers:  # an earlier megatron cycle leaves a host copy behind (param_data_cpu) ...
            b.offload_to_cpu(move_params=True, move_grads=False)
            b.reload_from_cpu(move_params=True, move_grads=False)
        trainer.train_step(gpt.synthetic_batch(CFG, 100, batch_size=BATCH))  # ... which a step makes stale
        current = [b.param_data.clone() for b in buffers]
        mm.offload()
        for b in buffers:
            b.reload_from_cpu(move_params=True, move_grads=False)  # regrows our released storage
        assert not all(torch.equal(b.param_data, c) for b, c in zip(buffers, current))  # stale bytes
        report = mm.audit()
        assert any("weights:" in p and "reload_from_cpu" in p for p in report.problems), report
        _refused(mm, mm.onload, "weights:", "hold", "reload_from_cpu", "release them again")
        assert mm.is_offloaded(Part.WEIGHTS)
        for b in buffers:  # the way out the message gives: release again, then onload
            b.offload_to_cpu(move_params=True, move_grads=False)
        mm.onload()
        assert all(torch.equal(b.param_data, c) for b, c in zip(buffers, current))  # the manager's copy

    _run(scenario)


def test_optimizer_states_moved_off_the_device_are_named_and_refused(baseline):
    def scenario(mm, trainer):
        states = [s for opt in trainer.optimizer.chained_optimizers for s in opt.optimizer.state.values()]
        before = [[v.untyped_storage().nbytes() for v in s.values()] for s in states]
        trainer.optimizer.offload_to_cpu()  # megatron's: moves CUDA tensors only, so a no-op on CPU
        assert [[v.untyped_storage().nbytes() for v in s.values()] for s in states] == before
        saved = [(s, dict(s)) for s in states]
        moved = 0
        for s, _ in saved:  # what it does on a GPU: state[k] = v.cpu(), i.e. off the manager's device
            for k, v in s.items():
                if v.numel() > 1:
                    s[k] = torch.empty_like(v, device="meta")
                    moved += 1
        message = _refused(mm, mm.offload, "optimizer_states:", "MegatronOptimizer.offload_to_cpu", "restore_from_cpu")
        assert f"{moved} tensor(s)" in message
        assert any("optimizer_states:" in p for p in mm.audit().problems)
        for s, original in saved:
            s.update(original)
        assert mm.audit().ok
        full_cycle(mm, trainer, AT)

    losses, weights = _run(scenario)
    assert losses == baseline[0] and bit_equal(weights, baseline[1])


def _restore_from_cpu_as_on_a_gpu(trainer) -> int:
    """What ``MegatronOptimizer.restore_from_cpu()`` leaves on a GPU after ``offload_to_cpu()``: every
    main weight's ``p.data`` and every state entry replaced by a new device tensor, same values.
    (On CPU both calls are no-ops.) Returns how many tensors were replaced."""
    n = 0
    for opt in trainer.optimizer.chained_optimizers:
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                p.data = p.data.clone()
                n += 1
        for state in opt.optimizer.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.numel():
                    state[k] = v.clone()
                    n += 1
    return n


def test_optimizer_tensors_brought_back_as_new_device_tensors_are_refused_and_a_new_manager_takes_them(baseline):
    """megatron's optimizer offload then restore, on a GPU, leaves main weights and states on the
    device in new memory. The manager used to accept that (audit ok) and then offload its own stale
    storages, leaving the live ones resident: 7.3 GB of 18.4 GB stayed allocated after a "full
    offload" in the GPU benchmark. Now it is named, refused, and a new manager takes the tensors."""
    _, _, mm, trainer = train(CFG, steps=AT + 1)
    _needs_builtin_offload(trainer)
    replaced = _restore_from_cpu_as_on_a_gpu(trainer)
    assert replaced > 0
    message = _refused(mm, mm.offload, "main_weights:", "optimizer_states:", "restore_from_cpu", "close()")
    assert "use new memory the manager does not manage" in message
    problems = mm.audit().problems
    assert any(p.startswith("main_weights:") for p in problems) and any(
        p.startswith("optimizer_states:") for p in problems
    ), problems
    mm.close()

    from chatlearn_mem import TrainerMemoryManager

    mm = TrainerMemoryManager(trainer.model, trainer.optimizer)
    live = [
        v
        for opt in trainer.optimizer.chained_optimizers
        for t in (
            [p for g in opt.optimizer.param_groups for p in g["params"]]
            + [v for s in opt.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        )
        for v in [t]
        if v.numel()
    ]
    mm.offload()
    assert all(t.untyped_storage().nbytes() == 0 for t in live)  # the live tensors' memory is released
    mm.onload()
    assert mm.audit().ok, mm.audit()
    losses = []
    for step in range(AT + 1, STEPS):
        losses.append(trainer.train_step(gpt.synthetic_batch(CFG, step, batch_size=BATCH)))
    assert losses == baseline[0][AT + 1 :]


def test_a_rebound_main_weight_is_recognised_by_its_slot():
    """``p.data = p.data.cpu()`` keeps the tensor object: its slot is the tensor, found off the device."""
    from chatlearn_mem import external

    w = [torch.ones(4), torch.ones(4)]
    placement = external.Placement.of(((id(t), t) for t in w), torch.device("cpu"))
    assert external.changes("main_weights", False, [], ((id(t), t) for t in w), torch.device("cpu"), placement) == []
    moved = [(id(w[0]), torch.empty(4, device="meta")), (id(w[1]), w[1])]
    (sentence,) = external.changes("main_weights", False, [], moved, torch.device("cpu"), placement)
    assert sentence.startswith("main_weights: 1 tensor(s) the manager saw on cpu now live elsewhere")
    # a tensor that was never on the device (a CPU-offloading optimizer's state) is not a change
    assert external.changes("main_weights", False, [], moved, torch.device("cpu"), external.Placement()) == []


@pytest.mark.parametrize("move_params", [False, True], ids=["grads", "grads+params"])
def test_megatron_builtin_offload_cycle_is_exact_on_cpu(baseline, move_params):
    """Measured for the README's comparison: megatron's own buffer offload between every step."""

    def between(mm, trainer, step):
        _needs_builtin_offload(trainer)
        for b in _buffers(trainer):
            b.offload_to_cpu(move_params=move_params, move_grads=True)
        for b in _buffers(trainer):
            b.reload_from_cpu(move_params=move_params, move_grads=True)

    losses, weights, _, _ = train(CFG, between=between)
    assert len(losses) == STEPS
    assert losses == baseline[0] and bit_equal(weights, baseline[1])


def test_megatron_optimizer_offload_while_the_manager_holds_the_states_is_refused(dist1):
    """The other order: megatron's optimizer offload would .cpu() every state tensor, reading the
    storages the manager released; it is refused before it runs, naming what to onload."""
    _, _, mm, trainer = train(CFG, steps=1)
    if not hasattr(trainer.optimizer, "offload_to_cpu"):
        pytest.skip("this megatron-core has no built-in optimizer offload (added in 0.16)")
    mm.offload()
    for call in (
        trainer.optimizer.offload_to_cpu,
        trainer.optimizer.restore_from_cpu,
        trainer.optimizer.chained_optimizers[0].offload_to_cpu,
    ):
        with pytest.raises(OffloadedError, match=r"offload_to_cpu\(\)|restore_from_cpu\(\)") as e:
            call()
        assert "main_weights" in str(e.value) or "optimizer_states" in str(e.value)
    mm.onload()
    trainer.optimizer.offload_to_cpu()  # awake: megatron's own call runs (a no-op on CPU)
    assert mm.audit().ok


def test_tensors_replaced_while_a_non_blocking_onload_runs_are_refused_at_the_next_call(baseline):
    """The manager checks where every tensor is before a call, and keeps what it checked: a tensor
    replaced while a non-blocking onload was in flight (after its copies, before it was settled) is
    named at the next call. It once recorded the tensors again when the onload settled, and so took
    the replaced ones for its own."""
    import time

    _, _, mm, trainer = train(CFG, steps=AT + 1)
    mm.offload()
    handle = mm.onload(blocking=False)
    deadline = time.monotonic() + 30
    while not handle.done():  # copied, not settled
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert _restore_from_cpu_as_on_a_gpu(trainer) > 0
    handle.wait()
    _refused(mm, mm.offload, "use new memory the manager does not manage")
    mm.close()
