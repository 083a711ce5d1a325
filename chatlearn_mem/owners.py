"""One manager per model: a process-wide registry of which live manager moves which storage.

:func:`manager_of` finds the manager of a model (to wake a sleeping model from anywhere), and a
second manager created on the same model is refused with where the first one was created. The
registry holds weak references: it never keeps a manager alive (the hooks a manager registers on
its model do, as long as the model lives).
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from typing import Any, Iterable, Optional, Protocol

import torch

from chatlearn_mem.device_memory import storage_key
from chatlearn_mem.errors import ChatlearnMemError

__all__ = ["Manager", "ManagerState", "caller_site", "claim", "manager_of", "release"]


class ManagerState(Protocol):
    """What the registry reads of a manager's :class:`~chatlearn_mem.parts_state.PartsState`."""

    closed: bool
    created_at: str

    def storage_keys(self) -> set[int]: ...


class Manager(Protocol):
    """A memory manager, as the registry sees it (:class:`~chatlearn_mem.manager.MemoryManagerBase`)."""

    @property
    def state(self) -> ManagerState: ...


# storage key -> the live manager that releases and restores that storage. Weak: the registry
# never keeps a manager alive (the hooks it registers on its model do, as long as the model lives).
_owners: dict[int, weakref.ref] = {}
_owners_lock = threading.Lock()
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _owner(key: int) -> Optional[Manager]:
    """The live manager of a storage key; call with ``_owners_lock`` held."""
    ref = _owners.get(key)
    manager = ref() if ref is not None else None
    if manager is None and ref is not None:
        del _owners[key]  # left by a manager collected while the lock was held (see __del__)
    if manager is None or manager.state.closed:
        return None
    # A storage the manager claimed may have been freed since (a parameter whose .data was
    # rebound) and its address reused: only a storage the manager moves *now* counts.
    return manager if key in manager.state.storage_keys() else None


def _tensors_of(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, torch.nn.Module):
        # unbound: megatron's DDP shadows Module.buffers with a list attribute
        yield from torch.nn.Module.parameters(obj)
        yield from torch.nn.Module.buffers(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors_of(o)
    else:
        raise TypeError(f"expected a torch.nn.Module, a tensor or a list of them, got {type(obj).__name__}")


def manager_of(model: Any) -> Optional[Manager]:
    """The registry's lookup behind :func:`chatlearn_mem.manager_of` (which documents it and types
    its result as the manager it is); raises TypeError for what is no model, chunk or tensor."""
    with _owners_lock:
        for t in _tensors_of(model):
            manager = _owner(storage_key(t))
            if manager is not None:
                return manager
    return None


def caller_site() -> str:
    """``file:line`` of the first frame outside this package (where a manager was created)."""
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "<unknown>"


def claim(manager: Manager, keys: set[int], what: str) -> list[int]:
    """Register ``manager`` as the manager of the storages ``keys`` (every storage it moves) and
    return them; refuse when another live manager already moves one of them.

    Raises:
        ChatlearnMemError: Another live manager moves one of ``keys``; nothing was registered.
    """
    with _owners_lock:
        for k in keys:
            other = _owner(k)
            if other is not None and other is not manager:
                raise ChatlearnMemError(
                    f"{what} is already managed by {type(other).__name__} (created at {other.state.created_at}); "
                    "a second manager would release and restore the same storages behind the first "
                    "one's back (each onload would shrink what the other restored). Use that manager "
                    "(chatlearn_mem.manager_of(model) returns it) or call its close() first"
                )
        ref = weakref.ref(manager)
        for k in keys:
            _owners[k] = ref
    return list(keys)


def release(manager: Manager, keys: Iterable[int], blocking: bool = True) -> bool:
    """Drop ``manager``'s entries for ``keys`` from the registry; False when it did not (below).

    Args:
        blocking: False from a finaliser: the garbage collector can run one in a thread that
            already holds ``_owners_lock`` (inside :func:`manager_of` or :func:`claim`), and
            waiting for it there would deadlock. The entries then stay as dead weak references,
            which ``_owner`` ignores and removes.
    """
    if not _owners_lock.acquire(blocking=blocking):
        return False
    try:
        for k in keys:
            ref = _owners.get(k)
            if ref is not None and ref() in (manager, None):
                del _owners[k]
        return True
    finally:
        _owners_lock.release()
