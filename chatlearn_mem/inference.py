"""Offload and onload of a model without an optimizer (reference, reward, rollout policy)."""

from __future__ import annotations

from typing import Hashable, Iterable, Optional

import torch

from chatlearn_mem.audit import AuditReport
from chatlearn_mem.config import MemoryConfig
from chatlearn_mem.guards import serialized
from chatlearn_mem.manager import MemoryManagerBase
from chatlearn_mem.parts import Part, PartsArg
from chatlearn_mem.residency import Residency, measure

__all__ = ["InferenceMemoryManager"]


class InferenceMemoryManager(MemoryManagerBase):
    """Puts an ``nn.Module`` with no optimizer to sleep and wakes it up, bit-exactly.

    Every parameter (any dtype, frozen or not) and buffer on the device is copied into a
    bucketed host store and its storage released in place; onload grows the same storages back
    and copies the bytes in, so tied weights and any other views survive.

    How the manager knows the weights are unchanged: after an onload it records PyTorch's
    version counter of every parameter and buffer (``tensor._version``). Every in-place write
    through a tensor or a view of it (``param.copy_()`` under ``no_grad``,
    ``load_state_dict()``, an optimizer step) increments it. If no counter moved since the
    onload, the host copy is still exact and the next offload only releases device memory.
    A write through ``param.data`` gets a fresh counter and is invisible: call
    :meth:`mark_weights_dirty` after one, or set ``MemoryConfig(skip_unchanged_weights=False)``.

    Args:
        module: The model; its parameters and buffers on the device are managed.
        config: Host store settings; defaults to ``MemoryConfig()``.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        ValueError: ``module`` has no parameters or buffers.
    """

    _CONTIGUOUS = frozenset({Part.WEIGHTS})  # a model's parameters: nothing else resizes them

    def __init__(self, module: torch.nn.Module, config: Optional[MemoryConfig] = None):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        tensors = list(module.parameters()) + list(module.buffers())
        if not tensors:
            raise ValueError("the module has no parameters or buffers; nothing to manage")
        super().__init__({Part.WEIGHTS: True}, tensors[0].device, config)
        self._module = module
        self._tracked = {name: t for name, t in self._named_tensors()}
        self._remember_weight_storages()
        self._claim("this module")
        self._hook_handles += self.state.register_weight_users(module.modules())
        self._guard_module(module, module)

    def _named_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        yield from self._module.named_parameters(remove_duplicate=False)
        yield from self._module.named_buffers(remove_duplicate=False)

    def _named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        return self._named_tensors()

    def _state_dict_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        return ((n, t) for n, t in self._module.state_dict(keep_vars=True).items() if isinstance(t, torch.Tensor))

    def _part_tensors(self, part: Part) -> Iterable[torch.Tensor]:
        assert part is Part.WEIGHTS, part
        return (t for _, t in self._named_tensors())

    def _part_token(self, part: Part) -> Optional[Hashable]:
        return (self.state.dirty_epoch, tuple(t._version for t in self._part_tensors(part)))

    @serialized
    def offload(self, parts: PartsArg = None, *, blocking: bool = True):
        """Offload the chosen parts (an inference model has one: ``Part.WEIGHTS``; None: all).

        Args:
            parts: ``"weights"``, ``Part.WEIGHTS``, a list of them, or None.
            blocking: Wait and return the stats (default), or return a
                :class:`~chatlearn_mem.Transfer` at once.

        Returns:
            One :class:`TransferStats`, or none (with a warning) when already offloaded; or the
            ``Transfer``.

        Raises:
            ValueError: A part other than ``weights``.
        """
        return self._run("offload", self.state.begin_offload(parts), blocking)

    @serialized
    def onload(self, parts: PartsArg = None, *, blocking: bool = True):
        """Onload the chosen parts (``Part.WEIGHTS``; None: all); see :meth:`offload`. With
        ``blocking=False`` a forward pass may start at once: each module waits for its own
        weights only."""
        return self._run("onload", self.state.begin_onload(parts, use_order=not blocking), blocking)

    @serialized
    def residency(self) -> Residency:
        """Device bytes of the parameters and buffers (each storage once) and host store bytes, once
        the transitions in flight have finished."""
        self.state.settle()
        return measure(
            {Part.WEIGHTS.value: self._part_tensors(Part.WEIGHTS)},
            self.device,
            self.state.host_bytes(),
            self.state.released_bytes(),
        )

    @serialized
    def audit(self) -> AuditReport:
        """Check that every parameter and buffer is the tensor the manager tracks, still uses the
        storage it tracks, and is resident (or released) as the manager's state says."""
        self.state.settle()
        report = AuditReport()
        current = dict(self._named_tensors())
        replaced = set()
        for name, t in self._tracked.items():
            report.checked += 1
            now = current.get(name)
            if now is None:
                report.add(f"{name} is no longer in the module")
            elif now is not t:
                replaced.add(name)
                report.add(f"{name} was replaced by a new tensor; the manager offloads the old one")
        self._check_rebinds(report, skip=frozenset(replaced))
        for name in current.keys() - self._tracked.keys():
            report.checked += 1
            report.add(f"{name} was added after the manager was created and is not managed")
        self.state.check_storage_state(report, Part.WEIGHTS)
        return report
