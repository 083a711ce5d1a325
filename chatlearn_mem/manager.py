"""What the trainer and inference managers share: parts, their state machine, locking, guards."""

from __future__ import annotations

import functools
import threading
import warnings
from typing import Callable, Hashable, Iterable, Optional

import torch

from chatlearn_mem.config import MemoryConfig
from chatlearn_mem import external
from chatlearn_mem.errors import ChatlearnMemError, OffloadedError
from chatlearn_mem.parts import Part, PartsArg, parse_parts
from chatlearn_mem.storage import StorageGroup, TransferStats, extent, storage_key, unique_storages

__all__ = ["MemoryManagerBase", "serialized"]


_READ_ONLY_CALLS = frozenset({"audit", "residency"})


def serialized(method: Callable) -> Callable:
    """Run a public manager method under the manager's lock: concurrent calls queue, never interleave.

    The outermost call also records itself in ``_active_call`` so that the forward and step guards
    (which run in the training thread, outside the lock) can refuse to run while another thread
    is releasing or restoring memory.
    """

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            outer = self._active_call is None
            if outer:
                self._active_call = (method.__name__, threading.get_ident())
            try:
                return method(self, *args, **kwargs)
            finally:
                if outer:
                    self._active_call = None

    return wrapper


class MemoryManagerBase:
    """Parts (named :class:`StorageGroup` s), their offload/onload with no-op warnings, and guards.

    Subclasses say which tensors make up each part (:meth:`_part_tensors`) and which token
    describes a part's current contents (:meth:`_part_token`).
    """

    def __init__(self, parts: dict[Part, bool], device: torch.device, config: Optional[MemoryConfig]):
        if config is not None and not isinstance(config, MemoryConfig):
            raise TypeError(f"config must be a chatlearn_mem.MemoryConfig, got {type(config).__name__}")
        self.config = config or MemoryConfig()
        self.device = device
        self._lock = threading.RLock()
        self._active_call: Optional[tuple[str, int]] = None  # (method, thread id) of the call in progress
        # part -> its storages; ``keep``: copy the contents to the host (False: drop them)
        self._groups = {part: StorageGroup(part.value, keep, self.config) for part, keep in parts.items()}
        self._dirty_epoch = 0
        self._hook_handles: list = []
        self._placements: dict[Part, external.Placement] = {}  # recorded after each call, see external.py

    # -- to be provided by subclasses -------------------------------------------------------
    def _part_tensors(self, part: Part) -> Iterable[torch.Tensor]:
        raise NotImplementedError

    def _part_token(self, part: Part) -> Optional[Hashable]:
        return None

    def _named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of the weights whose storage the audit follows."""
        raise NotImplementedError

    def _state_dict_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of what :meth:`weights_state_dict` exports, in state-dict naming."""
        raise NotImplementedError

    def _part_slots(self, part: Part) -> Iterable[tuple[Hashable, torch.Tensor]]:
        """``(slot, tensor)`` for each tensor of ``part``: a slot names where the tensor is held,
        so that a tensor rebound or replaced in place is recognised (default: the tensor itself)."""
        return ((id(t), t) for t in self._part_tensors(part) if t is not None)

    # -- shared mechanics --------------------------------------------------------------------
    @property
    def parts(self) -> tuple[Part, ...]:
        """The parts this manager moves."""
        return tuple(self._groups)

    def _parse_parts(self, parts: PartsArg) -> list[Part]:
        return parse_parts(parts, self._groups)

    def is_offloaded(self, part: Part | str) -> bool:
        """Whether ``part`` is currently offloaded (released from the device).

        Raises:
            ValueError: ``part`` is not one of :attr:`parts`.
        """
        (part,) = self._parse_parts([part])
        return self._groups[part].offloaded

    def _storages(self, part: Part) -> list[torch.UntypedStorage]:
        return unique_storages(self._part_tensors(part), self.device)

    # -- changes made behind the manager's back (megatron-core's own offload calls) ------------
    def _record_placement(self, parts: Iterable[Part] = ()) -> None:
        """Remember where ``parts`` (all by default) are now; see :mod:`chatlearn_mem.external`."""
        for part in parts or self._groups:
            self._placements[part] = external.Placement.of(self._part_slots(part), self.device)

    def _external_changes(self, parts: Iterable[Part] = ()) -> list[str]:
        """One sentence per change made to ``parts`` (all by default) by something other than the manager."""
        out = []
        for part in parts or self._groups:
            group = self._groups[part]
            out += external.changes(part.value, group.offloaded, group.released, self._part_slots(part),
                                    self.device, self._placements.get(part))
        return out

    def _refuse_external_changes(self, parts: Iterable[Part], what: str) -> None:
        found = self._external_changes(parts)
        if found:
            raise external.ExternalChangeError(
                f"refusing to {what}: memory the manager manages was changed by something else, so "
                "it would copy released memory or restore stale bytes. " + "; ".join(found))

    def _offload_part(self, part: Part, storages: Optional[list] = None) -> Optional[TransferStats]:
        group = self._groups[part]
        if group.offloaded:
            warnings.warn(f"{part} are already offloaded; nothing to do", stacklevel=3)
            return None
        self._refuse_external_changes([part], f"offload {part}")
        storages = self._storages(part) if storages is None else storages
        token = self._part_token(part) if self.config.skip_unchanged_weights else None
        stats = group.offload(storages, token)
        if part is Part.WEIGHTS:
            self._remember_weight_storages()
        self._record_placement([part])
        return stats

    def _remember_weight_storages(self) -> None:
        """Record the storage of each weight: the ones the manager releases and restores."""
        self._weight_storages = {name: storage_key(t) for name, t in self._named_weights()}

    def _check_rebinds(self, report, skip: frozenset = frozenset()) -> None:
        """Report weights whose ``.data`` now lives in a storage the manager does not restore.

        Args:
            skip: Names already reported for a worse reason (the tensor itself was replaced).
        """
        for name, t in self._named_weights():
            if name in skip:
                continue
            report.checked += 1
            if name in self._weight_storages and storage_key(t) != self._weight_storages[name]:
                report.add(f"{name} .data was rebound to a new tensor since the manager last "
                           "offloaded it; the manager would restore the old storage")

    def _onload_part(self, part: Part) -> Optional[TransferStats]:
        group = self._groups[part]
        if not group.offloaded:
            warnings.warn(f"{part} are already on the device; nothing to do", stacklevel=3)
            return None
        self._refuse_external_changes([part], f"onload {part}")
        stats = group.onload()
        group.set_host_token(self._part_token(part))
        self._record_placement([part])
        return stats

    def _before_offload(self, part: Part) -> None:
        """Refuse an offload that is unsafe now (subclasses); called before anything changes."""

    def _offload_one(self, part: Part) -> Optional[TransferStats]:
        self._before_offload(part)
        stats = self._offload_part(part)
        self._empty_cache()
        return stats

    @serialized
    def offload_weights(self) -> Optional[TransferStats]:
        """Copy the weights to the host store (unless the copy there is current) and free them."""
        return self._offload_one(Part.WEIGHTS)

    @serialized
    def onload_weights(self) -> Optional[TransferStats]:
        """Reallocate the weights on the device and copy them back from the host store."""
        return self._onload_part(Part.WEIGHTS)

    @serialized
    def weights_state_dict(self) -> dict[str, torch.Tensor]:
        """A host copy of every weight, named as in the model's ``state_dict()``.

        While the weights are offloaded they are read from the host store, so a sleeping model
        can send its weights (for example to a rollout engine) without being woken up. While
        resident they are copied from the device.
        """
        group = self._groups[Part.WEIGHTS]
        out = {}
        for name, t in self._state_dict_tensors():
            if group.offloaded:
                out[name] = group.read_host(t)
            else:
                out[name] = t.detach().to("cpu", copy=True)
        return out

    def _empty_cache(self) -> None:
        if self.config.empty_cache and self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _check_no_concurrent_call(self, what: str) -> None:
        """Refuse ``what`` (a forward pass, an optimizer step) while another thread is inside an
        offload or onload: the memory it would compute with is being released or restored."""
        active = self._active_call
        if active is not None and active[1] != threading.get_ident() and active[0] not in _READ_ONLY_CALLS:
            raise ChatlearnMemError(
                f"{what} while another thread is inside {type(self).__name__}.{active[0]}(); the "
                "memory it would use is being released or restored. Run training and the manager's "
                "calls from one thread at a time (e.g. a Ray actor with max_concurrency=1 or one "
                "concurrency group)")

    def _check_weights_resident(self, what: str) -> None:
        if self._groups[Part.WEIGHTS].offloaded:
            raise OffloadedError(f"{what} while the weights are offloaded: call onload_weights() "
                                 "(or onload()) first")

    def mark_weights_dirty(self) -> None:
        """Declare that the weights changed in a way the manager cannot see.

        Writes through ``param.data`` bypass PyTorch's version counter, which is how the manager
        tells unchanged weights (see ``MemoryConfig.skip_unchanged_weights``); call this after
        such a write so the next offload copies the weights again.
        """
        with self._lock:
            self._dirty_epoch += 1

    def close(self) -> None:
        """Remove the hooks the manager registered. The manager must not be used afterwards."""
        with self._lock:
            for h in self._hook_handles:
                h.remove()
            self._hook_handles.clear()

    def _host_bytes(self) -> dict[str, int]:
        return {part.value: g.host_bytes for part, g in self._groups.items()}

    def _check_storage_state(self, report, part: Part) -> None:
        """Offloaded parts hold no device bytes; resident parts hold every byte their tensors need."""
        group = self._groups[part]
        if group.offloaded:
            for s, n in group.released:
                report.checked += 1
                if s.nbytes() != 0:
                    report.add(f"{part}: a released storage of {n} bytes holds {s.nbytes()} bytes on "
                               "the device although the part is offloaded")
            released = {s._cdata for s, _ in group.released}
            for s in self._storages(part):
                report.checked += 1
                if s.nbytes() and s._cdata not in released:
                    report.add(f"{part}: a storage of {s.nbytes()} bytes is on the device although the "
                               "part is offloaded (created after the offload?)")
            return
        for t in self._part_tensors(part):
            if t is None or t.device != self.device:
                continue
            report.checked += 1
            need = (t.storage_offset() + extent(t)) * t.element_size()
            if t.untyped_storage().nbytes() < need:
                report.add(f"{part}: a tensor of shape {tuple(t.shape)} needs {need} bytes but its "
                           f"storage holds {t.untyped_storage().nbytes()} (released and not restored)")

