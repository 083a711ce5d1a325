"""The guards: what stops a call from touching memory the manager has released or is moving.

- :func:`serialized`: the manager's public calls run one at a time under its lock.
- :class:`ModelGuards`: torch hooks on the model (forward, backward, ``state_dict()``,
  ``load_state_dict()``) and checks that raise :class:`~chatlearn_mem.errors.OffloadedError`
  naming the call that brings the missing parts back, or refuse a forward pass while another
  thread is inside an offload or onload; and the messages of the debug guard
  (:mod:`chatlearn_mem.debug_guard`).
- :class:`MethodGuard` / :func:`guard_methods`: the same check before methods megatron offers no
  hook for (the table of those methods is megatron's, in :mod:`chatlearn_mem.mcore.layout`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterable, Optional

import torch
import torch.utils._pytree

from chatlearn_mem.debug_guard import function_name
from chatlearn_mem.device_memory import storage_key
from chatlearn_mem.errors import ChatlearnMemError, OffloadedError
from chatlearn_mem.parts import Part

__all__ = ["MethodGuard", "ModelGuards", "guard_methods", "onload_call", "serialized"]

_READ_ONLY_CALLS = frozenset({"audit", "residency"})
# calls whose work is the manager's own bookkeeping and copies (no megatron-core code that
# allocates on "the CUDA device"): they run with a device-rewriting mode popped
_OWN_WORK_CALLS = frozenset({"offload", "onload", "offload_weights", "onload_weights", "audit", "residency"})


@contextlib.contextmanager
def _without_device_rewrites():
    """Run the ``with`` block with a device-rewriting torch function mode popped, when one is the
    innermost mode of this thread (the CPU backend's: its class sets ``skip_in_manager_calls``).

    A manager's offload, onload, audit and residency do work per tensor (the storage of each,
    its version counter, its placement), and under such a mode every one of those accesses goes
    through Python: about 18x slower, 25 ms of a 160 ms optimizer-state offload on a 2-core
    machine. Those calls name their devices themselves and need no rewriting (the checkpoint
    calls run megatron-core's code, which does, and keep the mode). Any other mode (a user's) stays.
    """
    try:  # torch's own helpers (private; every torch since 2.0 has them)
        from torch.overrides import _get_current_function_mode_stack, _pop_mode_temporarily
    except ImportError:  # a torch without them: the call runs under the mode, only slower
        yield
        return
    stack = _get_current_function_mode_stack()
    if not stack or not getattr(stack[-1], "skip_in_manager_calls", False):
        yield
        return
    with _pop_mode_temporarily():
        yield


def serialized(method: Callable) -> Callable:
    """Run a public manager method under the manager's lock: concurrent calls queue, never interleave.

    It also refuses a call after ``close()``. The outermost call also records itself in ``_active_call`` so that the forward and step guards
    (which run in the training thread, outside the lock) can refuse to run while another thread
    is releasing or restoring memory.
    """

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self.state.lock:
            self.state.check_open(method.__name__)
            outer = self._active_call is None
            if outer:
                self._active_call = (method.__name__, threading.get_ident())
                if self._debug_guard is not None:  # the manager's own calls need no guard
                    self._debug_guard.uninstall_here()
            try:
                if not outer or method.__name__ not in _OWN_WORK_CALLS:
                    return method(self, *args, **kwargs)
                with _without_device_rewrites():
                    return method(self, *args, **kwargs)
            finally:
                if outer:
                    self._active_call = None
                    if self._debug_guard is not None:
                        self._debug_guard.update(self.state.released_keys(), self.state.moving_keys())

    return wrapper


def onload_call(parts: Iterable[Part]) -> str:
    """The call that brings ``parts`` back, for error messages: ``onload_weights()`` for the
    weights alone, else ``onload([...])`` with the part names."""
    parts = list(parts)
    if parts == [Part.WEIGHTS]:
        return "onload_weights()"
    return f"onload({[p.value for p in parts]!r})"


class ModelGuards:
    """The guards of a manager (a mixin of :class:`~chatlearn_mem.manager.MemoryManagerBase`)."""

    def _check_no_concurrent_call(self, what: str) -> None:
        """Refuse ``what`` (a forward pass, an optimizer step) while another thread is inside an
        offload or onload: the memory it would compute with is being released or restored."""
        active = self._active_call
        if active is not None and active[1] != threading.get_ident() and active[0] not in _READ_ONLY_CALLS:
            raise ChatlearnMemError(
                f"{what} while another thread is inside {type(self).__name__}.{active[0]}(); the "
                "memory it would use is being released or restored. Run training and the manager's "
                "calls from one thread at a time (e.g. a Ray actor with max_concurrency=1 or one "
                "concurrency group)"
            )

    def _check_weights_resident(self, what: str) -> None:
        if self.state.offloaded(Part.WEIGHTS):  # also while an offload is in flight
            raise OffloadedError(
                f"{what} while the weights are offloaded: call {onload_call([Part.WEIGHTS])} (or onload()) first"
            )
        if not self.state.weight_users:  # no per-module fences (megatron's overlapped param gather)
            self.state.await_parts((Part.WEIGHTS,))

    def _require(self, what: str, parts: Iterable[Part], hint: str = "") -> None:
        """Raise :class:`OffloadedError` when one of ``parts`` (which ``what`` needs) is offloaded.

        The guard of every call the manager intercepts; a no-op once the manager is closed.
        """
        if self.state.closed or self.state.serving_this_thread():
            return  # closed, or the tensors view their host copies for a checkpoint (trainer)
        self._check_no_concurrent_call(what)
        self.state.await_parts(parts)  # R4: an onload in flight is waited for, not refused
        missing = [p for p in parts if self.state.offloaded(p)]
        if missing:
            raise OffloadedError(
                f"{what} while {', '.join(missing)} are offloaded: call {onload_call(missing)} "
                f"(or onload()) first{hint}"
            )

    def _in_own_call(self) -> bool:
        """Whether this thread is inside one of the manager's public calls."""
        active = self._active_call
        return active is not None and active[1] == threading.get_ident()

    # -- guards on the model (torch hooks) -------------------------------------------------------
    def _guard_module(self, outer: torch.nn.Module, inner: torch.nn.Module) -> None:
        """Register the torch hooks that guard a model: forward (on ``outer`` and, first of all its
        pre-hooks, ``inner``), backward (a hook on each forward output that needs a gradient,
        which fires before any backward node of the model runs), ``state_dict()`` and
        ``load_state_dict()`` (on ``inner``, which megatron's DDP delegates both to)."""
        for m in dict.fromkeys((outer, inner)):
            self._hook_handles.append(m.register_forward_pre_hook(self._before_forward, prepend=True))
        self._hook_handles.append(outer.register_forward_hook(self._after_forward))
        self._hook_handles.append(inner.register_state_dict_pre_hook(self._before_state_dict))
        register = getattr(inner, "register_load_state_dict_pre_hook", None)
        if register is not None:  # torch >= 2.5
            self._hook_handles.append(register(self._before_load_state_dict))
        else:
            self._hook_handles.append(
                inner._register_load_state_dict_pre_hook(
                    lambda module, *args: self._before_load_state_dict(module, *args), with_module=True
                )
            )

    def _before_forward(self, module, args) -> None:
        self._check_no_concurrent_call("forward pass")
        self._check_weights_resident("forward pass")

    def _backward_parts(self) -> tuple[Part, ...]:
        """The parts a backward pass through the model reads or writes."""
        return (Part.WEIGHTS,)

    def _after_forward(self, module, args, output) -> None:
        if not torch.is_grad_enabled() or self.state.closed:
            return
        for t in torch.utils._pytree.tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._before_backward)

    def _before_backward(self, grad) -> None:
        self._require("backward pass", self._backward_parts())

    def _before_state_dict(self, module, prefix, keep_vars) -> None:
        if not self._in_own_call():  # weights_state_dict() reads the names through state_dict()
            self._require(
                "state_dict()",
                (Part.WEIGHTS,),
                hint=", or use the manager's weights_state_dict() "
                "for a host copy of the weights without waking the model",
            )

    def _before_load_state_dict(self, module, *args) -> None:
        self._require("load_state_dict()", (Part.WEIGHTS,))

    # -- the debug guard ---------------------------------------------------------------------------
    def _guard_names(self) -> Iterable[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of the tensors the debug guard can name (subclasses add theirs)."""
        return self._named_weights()

    def _released_message(self, t: torch.Tensor, func) -> Optional[str]:
        """The debug guard's error for ``func`` on ``t``; None inside the manager's own calls."""
        if self._in_own_call() or self.state.closed:
            return None
        key = storage_key(t)
        part = self.state.part_of_released(key)
        if part is None:
            return None
        where = (key, t.storage_offset(), tuple(t.shape), t.stride())
        name = None
        for n, x in self._guard_names():
            if x is t:
                name = n
                break
            if (
                name is None
                and isinstance(x, torch.Tensor)
                and (storage_key(x), x.storage_offset(), tuple(x.shape), x.stride()) == where
            ):
                name = f"a view of {n}"
        name = name or f"a tensor of shape {tuple(t.shape)} ({t.dtype}) in a released {part} storage"
        return (
            f"{function_name(func)} on {name} while {part} are offloaded: call {onload_call([part])} "
            "(or onload()) first. Raised by the debug guard (MemoryConfig.debug_guard / "
            "CHATLEARN_MEM_DEBUG_GUARD=1); without it this operation would read released memory (a crash "
            "on CPU, garbage on a GPU)"
        )


class MethodGuard:
    """One method of one object wrapped per instance so that ``check`` runs first.

    The wrapper is stored in the instance's ``__dict__``, where attribute lookup finds it before
    the class's method; :meth:`remove` deletes it again (and restores an instance attribute it
    shadowed). Callers that looked the method up *before* the wrapping (a bound method megatron's
    pipeline config captured) keep calling the original.
    """

    def __init__(self, obj: Any, name: str, check: Callable[[], None]):
        self.obj, self.name = obj, name
        d = vars(obj)
        self._had, self._previous = name in d, d.get(name)
        original = getattr(obj, name)

        @functools.wraps(original)
        def guarded(*args, **kwargs):
            check()
            return original(*args, **kwargs)

        self.wrapper = guarded
        object.__setattr__(obj, name, guarded)

    def remove(self) -> None:
        d = vars(self.obj)
        if d.get(self.name) is not self.wrapper:
            return  # wrapped again by someone else since; the check is a no-op once the manager closes
        if self._had:
            object.__setattr__(self.obj, self.name, self._previous)
        else:
            del d[self.name]


def guard_methods(
    obj: Any, table: dict[str, tuple[Part, ...]], check: Callable[[str, tuple[Part, ...]], None]
) -> list[MethodGuard]:
    """Wrap each method of ``table`` that ``obj`` has so that ``check("Type.method()", parts)``
    runs before it; returns the guards (``remove()`` each to undo)."""
    guards = []
    for name, parts in table.items():
        if not callable(getattr(type(obj), name, None)):
            continue
        what = f"{type(obj).__name__}.{name}()"
        guards.append(MethodGuard(obj, name, functools.partial(check, what, parts)))
    return guards
