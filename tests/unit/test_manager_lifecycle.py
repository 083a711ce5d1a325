"""One manager per model, close(), garbage collection and the model-level guards, on a plain module.

Nothing here reads a released tensor (that could crash the process): the debug guard's reads run
in a child process in test_debug_guard.py, and backward after offload in the megatron tier's
misuse child.
"""

import gc
import warnings

import pytest
import torch
from torch import nn

from chatlearn_mem import ChatlearnMemError, InferenceMemoryManager, OffloadedError, manager_of


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(8, 8)
        self.dec = nn.Linear(8, 8, bias=False)
        self.dec.weight = self.enc.weight

    def forward(self, x):
        return self.dec(torch.relu(self.enc(x)))


@pytest.fixture
def model():
    torch.manual_seed(0)
    return Tied()


def _bits(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(model, snap):
    return all(torch.equal(model.state_dict()[k], v) for k, v in snap.items())


def test_manager_of_is_typed_as_the_manager_a_caller_uses():
    """A type checker sees what ``manager_of`` returns as a manager with ``onload``/``close``, not
    as the registry's internal Protocol (which has neither): its hints name the two managers."""
    import typing

    from chatlearn_mem import TrainerMemoryManager

    hint = typing.get_type_hints(manager_of)["return"]
    assert set(typing.get_args(hint)) == {TrainerMemoryManager, InferenceMemoryManager, type(None)}, hint
    for manager in (TrainerMemoryManager, InferenceMemoryManager):
        for call in ("onload", "offload", "close", "residency", "audit"):
            assert callable(getattr(manager, call, None)), (manager, call)


def test_second_manager_is_refused_naming_the_first(model):
    mm = InferenceMemoryManager(model)
    for target in (model, model.enc, model.dec):  # the whole model, a part, a part sharing a tied weight
        with pytest.raises(
            ChatlearnMemError,
            match=r"^this module is already managed by InferenceMemoryManager "
            r"\(created at .*test_manager_lifecycle\.py:\d+\); .*manager_of\(model\) returns it\) "
            r"or call its close\(\) first$",
        ):
            InferenceMemoryManager(target)
    assert manager_of(model) is mm and manager_of(model.dec) is mm and manager_of(model.enc.weight) is mm
    assert manager_of([nn.Linear(2, 2), model]) is mm
    assert manager_of(nn.Linear(2, 2)) is None
    with pytest.raises(TypeError, match="torch.nn.Module, a tensor or a list"):
        manager_of("model")
    mm.close()
    assert manager_of(model) is None
    mm2 = InferenceMemoryManager(model.enc)  # allowed once the first is closed
    assert manager_of(model) is mm2
    mm2.close()


def test_close_while_offloaded_refuses_and_keeps_everything(model):
    snap = _bits(model)
    mm = InferenceMemoryManager(model)
    mm.offload()
    with pytest.raises(
        ChatlearnMemError,
        match=r"^cannot close InferenceMemoryManager: weights are offloaded, "
        r"and closing would strand them .* Call onload\(\) first, then close\(\)$",
    ):
        mm.close()
    assert mm.is_offloaded("weights") and manager_of(model) is mm
    mm.onload()
    assert _same(model, snap)
    mm.close()


def test_close_removes_guards_frees_the_host_store_and_refuses_later_calls(model):
    mm = InferenceMemoryManager(model)
    mm.offload()
    mm.onload()
    assert mm.residency().host_bytes > 0
    mm.close()
    mm.close()  # a no-op
    assert not model._forward_pre_hooks and not model._forward_hooks and not model._state_dict_pre_hooks
    assert all(g.host_bytes == 0 for g in mm.state.groups().values())
    for call in (mm.offload, mm.onload, mm.audit, mm.residency, mm.weights_state_dict):
        with pytest.raises(ChatlearnMemError, match=r"after close\(\): the manager is closed; create a new one"):
            call()


def test_dropped_manager_survives_with_its_model_and_is_found_again(model):
    snap = _bits(model)
    mm = InferenceMemoryManager(model)
    mm.offload()
    with warnings.catch_warnings(record=True) as caught:  # nothing is lost: the model holds its manager
        warnings.simplefilter("always")
        del mm
        gc.collect()
    assert not [w for w in caught if "garbage collected" in str(w.message)]
    mm = manager_of(model)
    assert mm is not None and mm.is_offloaded("weights")
    mm.onload()
    assert _same(model, snap)
    mm.close()


def test_manager_collected_with_its_sleeping_model_warns():
    mm = InferenceMemoryManager(Tied())
    mm.offload()
    with pytest.warns(
        UserWarning,
        match=r"^InferenceMemoryManager \(created at .*test_manager_lifecycle\.py:\d+\) "
        r"was garbage collected while weights were offloaded: their host copies are freed",
    ):
        del mm
        gc.collect()


def test_resident_manager_collected_without_warning():
    mm = InferenceMemoryManager(Tied())
    mm.offload()
    mm.onload()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del mm
        gc.collect()
    assert not [w for w in caught if "garbage collected" in str(w.message)]


def test_state_dict_and_load_state_dict_refuse_while_offloaded(model):
    snap = _bits(model)
    mm = InferenceMemoryManager(model)
    mm.offload()
    with pytest.raises(
        OffloadedError,
        match=r"^state_dict\(\) while weights are offloaded: call onload_weights\(\) "
        r"\(or onload\(\)\) first, or use the manager's weights_state_dict\(\)",
    ):
        model.state_dict()
    with pytest.raises(OffloadedError, match=r"^load_state_dict\(\) while weights are offloaded"):
        model.load_state_dict(snap)
    host = mm.weights_state_dict()  # the host copy, without waking the model
    assert host.keys() == snap.keys() and all(torch.equal(host[k], v) for k, v in snap.items())
    mm.onload()
    assert _same(model, snap)
    model.load_state_dict(host)  # resident again: both work
    mm.close()


def test_manager_collected_inside_a_registry_lookup_does_not_deadlock():
    """The garbage collector may finalise a sleeping manager while this thread holds the registry
    lock (inside manager_of): its __del__ must not wait for that lock. Before the fix the misuse
    child process hung here for good (found by CI on megatron-core 0.13.1)."""
    import threading

    from chatlearn_mem import owners as owners_module

    mm = InferenceMemoryManager(Tied())
    mm.offload()
    collected = []

    def collect_while_locked():
        nonlocal mm
        with owners_module._owners_lock, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            del mm
            gc.collect()
            collected.append(True)  # reached only if nothing above raised or hung

    t = threading.Thread(target=collect_while_locked, daemon=True)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive(), "the finaliser waited for the registry lock its own thread holds"
    assert collected, "the collecting thread failed before it collected the manager"
    other = Tied()  # the registry still works afterwards (dead entries are pruned on lookup)
    mm2 = InferenceMemoryManager(other)
    assert manager_of(other) is mm2
    mm2.close()
