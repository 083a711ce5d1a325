"""The trainer's side of a checkpoint: its host copies served to megatron while it sleeps, and
its manager's state before and after a load.

These functions go through the manager's :class:`~chatlearn_mem.parts_state.PartsState`
(``manager.state``: its storage groups, the thread being served, retaking the model after a
load); :mod:`chatlearn_mem.checkpoint` calls them around megatron's ``dist_checkpointing`` save
and load.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from chatlearn_mem.device_memory import storage_key
from chatlearn_mem.errors import OffloadedError
from chatlearn_mem.guards import serialized
from chatlearn_mem.mcore import checkpointing

__all__ = ["after_load", "prepare_load", "trainer_parts", "with_host_copies"]


def trainer_parts(manager: Any) -> tuple[list, Any, list]:
    """``(model chunks, optimizer, leaf optimizers)`` of a trainer manager."""
    from chatlearn_mem.trainer import TrainerMemoryManager

    if not isinstance(manager, TrainerMemoryManager):
        raise TypeError(f"expected a chatlearn_mem.TrainerMemoryManager, got {type(manager).__name__}")
    return manager.checkpoint_parts


@serialized
def with_host_copies(
    manager, build: Callable[[Callable[[torch.Tensor], bool]], Any]
) -> tuple[Any, contextlib.ExitStack]:
    """Run ``build(is_live)`` while every tensor megatron reads for a checkpoint views its host
    copy; return its result and the registration of every host store it may still reference.

    While a part is offloaded its tensors (parameters, main weights, shard views, states) keep
    their released device storages; for the duration of ``build`` each one's ``.data`` is
    pointed at its bytes in the host store (:meth:`StorageGroup.host_view`, no copy where the
    bytes lie in one bucket) and the offload guards let megatron's ``sharded_state_dict`` calls
    through, in this thread only. Then every ``.data`` is pointed back at its device storage:
    nothing is allocated on the device and the trainer stays asleep. ``build`` must detach what
    it keeps (a parameter object follows its ``.data`` back) and copy what ``is_live(t)``
    (the tensor is training state on the device) says will change.

    The returned ExitStack holds :meth:`StorageGroup.reading` on every offloaded part: until it
    is closed, an offload that would overwrite those host stores waits.
    """
    state = manager.state
    state.settle()  # R5: read the host copies once written
    served = state.served_groups()
    live = state.storage_keys()
    chunks, _, leaves = manager.checkpoint_parts
    swapped = []
    readers = contextlib.ExitStack()
    try:
        for t in checkpointing.checkpoint_read_tensors(chunks, leaves):
            group = served.get(storage_key(t))
            if group is not None:
                view = group.host_view(t)
                swapped.append((t, t.data))
                t.data = view
        with state.serving_host_copies():
            out = build(lambda t: storage_key(t) in live)
        for g in dict.fromkeys(served.values()):
            readers.enter_context(g.reading())
        return out, readers
    finally:
        for t, original in reversed(swapped):
            t.data = original


@serialized
def prepare_load(manager) -> None:
    """Before a checkpoint is loaded: every part resident, optimizer states created."""
    manager.state.settle()
    offloaded = [p.value for p in manager.state.offloaded_parts()]
    if offloaded:
        raise OffloadedError(f"loading a checkpoint while {', '.join(offloaded)} are offloaded: call onload() first")
    checkpointing.init_optimizer_states(manager.checkpoint_parts[2])


@serialized
def after_load(manager) -> None:
    """After a checkpoint was loaded: the optimizer replaced its state tensors and every part
    changed, so host copies are stale and the manager takes the new tensors over."""
    manager.state.retake()
