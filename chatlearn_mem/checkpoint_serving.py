"""The trainer's side of a checkpoint: its host copies served to the checkpoint's writer while it
sleeps, and its manager's state before and after a load.

These functions go through the manager's :class:`~chatlearn_mem.parts_state.PartsState`
(``manager.state``: its storage groups, the thread being served, retaking the model after a
load) and its backend's checkpoint calls (``manager.backend.checkpoint_io()``: megatron's
``dist_checkpointing``, torch's ``torch.distributed.checkpoint``); :mod:`chatlearn_mem.checkpoint`
calls them around the save and the load.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch

from chatlearn_mem.device_memory import storage_key
from chatlearn_mem.errors import OffloadedError
from chatlearn_mem.guards import serialized

__all__ = ["HostCopies", "after_load", "checkpoint_io", "prepare_load", "with_host_copies"]


def checkpoint_io(manager: Any) -> Any:
    """The checkpoint calls of a trainer manager's backend (see :mod:`chatlearn_mem.checkpoint`)."""
    from chatlearn_mem.trainer import TrainerMemoryManager

    if not isinstance(manager, TrainerMemoryManager):
        raise TypeError(f"expected a chatlearn_mem.TrainerMemoryManager, got {type(manager).__name__}")
    return manager.backend.checkpoint_io()


class HostCopies:
    """What a checkpoint's state is built from while the trainer may sleep (see :func:`with_host_copies`).

    Attributes:
        is_live: ``t -> bool``: ``t`` is training state on the device (copy it: it will change).
        view: ``t -> host tensor or None``: ``t``'s bytes in the host store, without a copy where
            they lie in one bucket, when ``t``'s part is offloaded; None when ``t`` is resident.
    """

    def __init__(self, live: set[int], served: dict):
        self._live, self._served = live, served

    def is_live(self, t: torch.Tensor) -> bool:
        return storage_key(t) in self._live

    def view(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        group = self._served.get(storage_key(t))
        return group.host_view(t) if group is not None else None


@serialized
def with_host_copies(manager, build: Callable[[HostCopies], Any]) -> tuple[Any, contextlib.ExitStack]:
    """Run ``build(host)`` while every tensor the checkpoint reads can be read from its host copy;
    return its result and the registration of every host store it may still reference.

    While a part is offloaded its tensors keep their released device storages. ``build`` reads
    them through ``host.view(t)`` (torch's backend), or, for the tensors the backend's
    ``swapped_tensors()`` lists (megatron, whose ``sharded_state_dict`` reads the trainer's own
    objects), each one's ``.data`` is pointed at its bytes in the host store
    (:meth:`StorageGroup.host_view`, no copy where the bytes lie in one bucket) for the duration
    of ``build`` and the offload guards let those calls through, in this thread only. Then every
    ``.data`` is pointed back at its device storage: nothing is allocated on the device and the
    trainer stays asleep. ``build`` must detach what it keeps (a parameter object follows its
    ``.data`` back) and copy what ``host.is_live(t)`` says will change.

    The returned ExitStack holds :meth:`StorageGroup.reading` on every offloaded part: until it
    is closed, an offload that would overwrite those host stores waits.
    """
    state = manager.state
    state.settle()  # R5: read the host copies once written
    served = state.served_groups()
    host = HostCopies(state.storage_keys(), served)
    swapped = []
    readers = contextlib.ExitStack()
    try:
        for t in checkpoint_io(manager).swapped_tensors():
            group = served.get(storage_key(t))
            if group is not None:
                view = group.host_view(t)
                swapped.append((t, t.data))
                t.data = view
        with state.serving_host_copies():
            out = build(host)
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
    checkpoint_io(manager).prepare_load()


@serialized
def after_load(manager) -> None:
    """After a checkpoint was loaded: the optimizer replaced its state tensors and every part
    changed, so host copies are stale and the manager takes the new tensors over."""
    manager.state.retake()
