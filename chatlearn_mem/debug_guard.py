"""The opt-in debug guard: any torch operation on a released tensor raises ``OffloadedError``.

While a part is offloaded its storages hold 0 bytes, yet every tensor viewing them (a parameter,
its ``main_grad``, an Adam state) is still there. The managers guard the calls of the documented
workflows (forward, backward, megatron's DDP and optimizer calls, state dicts), but any other
read (``p.norm()`` in a logging hook, an EMA update) reaches the released memory: on CPU it
crashes the process, on a GPU it reads freed memory. Intercepting every torch call costs too
much to be on by default, so this guard is opt-in (``MemoryConfig(debug_guard=True)`` or
``CHATLEARN_MEM_DEBUG_GUARD=1``).

:class:`ReleasedTensorGuard` is a ``TorchFunctionMode``: while its manager has parts offloaded
it sits at the bottom of the torch-function mode stack of the thread that offloaded (the bottom,
so that a user's ``with SomeMode():`` block above it still pops its own mode) and checks the
tensor arguments of every torch call for a released storage. Metadata queries (shape, dtype,
``untyped_storage()``, ``.grad``...) pass. Torch-function modes are per thread: other threads
are not watched.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Callable, Optional

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack, _pop_mode, _push_mode

from chatlearn_mem.device_memory import storage_key
from chatlearn_mem.errors import OffloadedError

__all__ = ["ReleasedTensorGuard", "function_name"]


def _getter(name: str):
    return getattr(torch.Tensor, name).__get__


# Calls that read no tensor data (metadata, identity, hooks): allowed on a released tensor.
_METADATA = frozenset(
    [
        _getter(n)
        for n in (
            "shape",
            "dtype",
            "device",
            "requires_grad",
            "is_leaf",
            "grad",
            "grad_fn",
            "_version",
            "ndim",
            "layout",
            "is_cuda",
            "is_meta",
            "is_sparse",
            "is_quantized",
            "is_nested",
            "names",
            "_base",
            "data",
            "itemsize",
            "nbytes",
            "output_nr",
        )
        if hasattr(torch.Tensor, n)
    ]
    + [torch.Tensor.grad.__set__]
    + [
        getattr(torch.Tensor, n)
        for n in (
            "size",
            "dim",
            "numel",
            "nelement",
            "stride",
            "storage_offset",
            "untyped_storage",
            "data_ptr",
            "element_size",
            "is_contiguous",
            "is_floating_point",
            "is_complex",
            "get_device",
            "requires_grad_",
            "register_hook",
            "retain_grad",
            "detach",
            "__len__",
            "__hash__",
            "_is_view",
            "is_pinned",
        )
        if hasattr(torch.Tensor, n)
    ]
)


def function_name(func: Callable) -> str:
    """``norm()``, ``torch.add()``, ``.data`` ... for messages."""
    self = getattr(func, "__self__", None)
    name = getattr(func, "__name__", None) or repr(func)
    if name in ("__get__", "__set__") and self is not None:
        return f".{getattr(self, '__name__', '?')}"
    if getattr(func, "__module__", None) in ("torch", "torch.functional", "torch.nn.functional"):
        return f"{func.__module__}.{name}()"
    return f"{name}()"


class ReleasedTensorGuard(TorchFunctionMode):
    """Raise ``OffloadedError`` when a torch call gets a tensor whose storage the manager released.

    Args:
        message: ``message(tensor, func)`` returns the error text, or None to let the call through
            (the manager's own calls); held weakly, so the guard never keeps a manager alive.
    """

    def __init__(self, message: Callable[[torch.Tensor, Callable], Optional[str]]):
        super().__init__()
        self._message = weakref.WeakMethod(message)
        self.keys: frozenset[int] = frozenset()  # storage keys released now; empty: dormant
        self.moving: frozenset[int] = frozenset()  # of those, the ones an offload in flight still copies

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if self.keys and func not in _METADATA:
            t = self._released_argument(args, kwargs)
            if t is not None:
                message = self._message()
                text = message(t, func) if message is not None else None
                if text is not None:
                    raise OffloadedError(text)
        return func(*args, **kwargs)

    def _released_argument(self, args, kwargs) -> Optional[torch.Tensor]:
        for a in itertools.chain(args, kwargs.values()):
            if isinstance(a, torch.Tensor):
                if self._released(a):
                    return a
            elif isinstance(a, (list, tuple)):  # foreach ops, torch.cat, ...
                for b in a:
                    if isinstance(b, torch.Tensor) and self._released(b):
                        return b
        return None

    def _released(self, t: torch.Tensor) -> bool:
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, wrapper subclasses
            return False
        key = storage_key(s)
        return key in self.keys and t.numel() > 0 and (s.nbytes() == 0 or key in self.moving)

    # -- the per-thread mode stack ---------------------------------------------------------------
    def update(self, keys: frozenset[int], moving: frozenset[int] = frozenset()) -> None:
        """Watch these released storages (on this thread); none: stop watching it here.

        Args:
            keys: Storages the manager has released (or is releasing).
            moving: Those of ``keys`` a non-blocking offload is still copying: flagged even
                though they still hold their bytes (the copy engine frees them any moment).
        """
        self.keys = frozenset(keys)
        self.moving = frozenset(moving) & self.keys
        if self.keys:
            self._install_here()
        else:
            self.uninstall_here()

    def _install_here(self) -> None:
        stack = _get_current_function_mode_stack()
        if any(m is self for m in stack):
            return
        for _ in stack:  # bottom of the stack: modes the user entered above keep their order
            _pop_mode()
        _push_mode(self)
        for m in stack:
            _push_mode(m)

    def uninstall_here(self) -> None:
        """Take the guard off this thread's mode stack (other threads keep it, dormant once
        :attr:`keys` is empty: one Python call per torch operation, no check)."""
        stack = _get_current_function_mode_stack()
        if not any(m is self for m in stack):
            return
        for _ in stack:
            _pop_mode()
        for m in stack:
            if m is not self:
                _push_mode(m)
