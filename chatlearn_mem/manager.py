"""What the trainer and inference managers share: the parts and their state machine.

A part (:class:`~chatlearn_mem.parts.Part`) is a named :class:`~chatlearn_mem.storage.StorageGroup`;
it is resident or offloaded, and moves between the two through the copy engine (submitted,
settled, rolled back on failure). The guards that keep calls away from released memory live in
:mod:`chatlearn_mem.guards`, the one-manager-per-model registry in :mod:`chatlearn_mem.owners`.
"""

from __future__ import annotations

import threading
import warnings
from typing import Hashable, Iterable, Optional

import torch
import torch.utils._pytree

from chatlearn_mem import device_memory, external, host_memory, transitions
from chatlearn_mem.config import MemoryConfig
from chatlearn_mem.copy_engine import CopyEngine
from chatlearn_mem.debug_guard import ReleasedTensorGuard
from chatlearn_mem.device_memory import storage_key
from chatlearn_mem.errors import ChatlearnMemError, HostMemoryError
from chatlearn_mem.group_transfer import GroupTransfer
from chatlearn_mem.guards import ModelGuards, serialized
from chatlearn_mem.owners import OwnedStorages, caller_site
from chatlearn_mem.parts import Part, PartsArg, parse_parts
from chatlearn_mem.storage import StorageGroup, extent, unique_storages

__all__ = ["MemoryManagerBase"]


def _own_tensors(module: torch.nn.Module) -> Iterable[torch.Tensor]:
    """A module's own parameters and buffers (not its children's)."""
    yield from (t for t in module.parameters(recurse=False) if t is not None)
    yield from (t for t in module.buffers(recurse=False) if t is not None)


class MemoryManagerBase(ModelGuards, OwnedStorages):
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
        self._serving_host: Optional[int] = None  # thread reading the host copies through the model (checkpoint)
        # part -> its storages; ``keep``: copy the contents to the host (False: drop them)
        self._groups = {part: StorageGroup(part.value, keep, self.config) for part, keep in parts.items()}
        self._dirty_epoch = 0
        self._hook_handles: list = []  # anything with .remove(): torch hook handles, method guards
        self._closed = False
        self._claimed: list[int] = []
        self._created_at = caller_site()
        self._debug_guard = ReleasedTensorGuard(self._released_message) if self.config.resolved_debug_guard() else None
        self._placements: dict[Part, external.Placement] = {}  # recorded after each call, see external.py
        # transitions submitted to the copy engine and not yet settled: part -> (handle, its group's)
        self._pending: dict[Part, tuple[transitions.Transfer, GroupTransfer]] = {}
        # a weights onload in flight with per-module fences: (its group transfer, {id(module): user})
        self._weights_in_flight: Optional[tuple[GroupTransfer, dict[int, int]]] = None
        self._weight_users_of: list[tuple[torch.nn.Module, int]] = []  # modules that read weights, in order

    _OFFLOAD_ORDER: tuple[Part, ...] = (Part.WEIGHTS,)
    _ONLOAD_ORDER: tuple[Part, ...] = (Part.WEIGHTS,)

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
        self._settle([part])
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
            out += external.changes(
                part.value,
                group.offloaded,
                group.released,
                self._part_slots(part),
                self.device,
                self._placements.get(part),
            )
        return out

    def _refuse_external_changes(self, parts: Iterable[Part], what: str) -> None:
        found = self._external_changes(parts)
        if found:
            raise external.ExternalChangeError(
                f"refusing to {what}: memory the manager manages was changed by something else, so "
                "it would copy released memory or restore stale bytes. " + "; ".join(found)
            )

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
                report.add(
                    f"{name} .data was rebound to a new tensor since the manager last "
                    "offloaded it; the manager would restore the old storage"
                )

    # -- transitions ---------------------------------------------------------------------------------
    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ChatlearnMemError(
                f"{type(self).__name__}.{what}() after close(): the manager is closed; create a new one"
            )

    def _before_offload_checks(self, todo: list[Part], force: bool) -> None:
        """Refuse an offload of ``todo`` that is unsafe now (subclasses); nothing has changed yet."""

    def _before_release(self, part: Part) -> None:
        """Drop what hangs off ``part`` just before its release is submitted (subclasses)."""

    def _begin_offload(
        self, parts: PartsArg, force: bool = False, stacklevel: int = 4
    ) -> list[tuple[Part, GroupTransfer]]:
        """Check, prepare the host stores and start (not submit) the offload of ``parts``.

        Everything that can refuse or fail before a copy (unconsumed grads, communication in
        flight, memory changed behind the manager's back, host memory) is checked first, and
        every host store is allocated before any part changes state, so a refusal changes nothing.
        """
        chosen = self._parse_parts(parts)
        self._settle(chosen)  # R6: a part moves in one direction at a time
        todo = [p for p in self._OFFLOAD_ORDER if p in chosen and not self._groups[p].offloaded]
        if not todo:
            if chosen:
                what = f"{chosen[0]} are" if len(chosen) == 1 else "the chosen parts are"
                warnings.warn(f"{what} already offloaded; nothing to do", stacklevel=stacklevel)
            return []
        self._before_offload_checks(todo, force)
        self._refuse_external_changes(todo, "offload")
        storages = {p: self._storages(p) for p in todo}
        self._check_host_memory(storages)
        for p in todo:  # allocate every host store first: a host OOM leaves everything resident
            self._groups[p].prepare(storages[p])
        caller = CopyEngine.for_device(self.device).caller_event()
        started: list[tuple[Part, GroupTransfer]] = []
        try:
            for p in todo:
                self._before_release(p)
                token = self._part_token(p) if self.config.skip_unchanged_weights else None
                started.append((p, self._groups[p].start_offload(storages[p], token, caller)))
                if p is Part.WEIGHTS:
                    self._remember_weight_storages()
        except BaseException:
            for _, gt in reversed(started):
                gt.cancel()
            raise
        return started

    def _begin_onload(
        self, parts: PartsArg, stacklevel: int = 4, use_order: bool = True
    ) -> list[tuple[Part, GroupTransfer]]:
        """Start (not submit) the onload of ``parts``; with ``use_order`` weights are queued in the
        order the model reads them, with a fence per module (R4). Without it (a blocking call,
        where no forward overlaps the copy) they come in storage order and every module waits for
        all of them: no per-tensor work on the host."""
        chosen = self._parse_parts(parts)
        self._settle(chosen)  # R6
        todo = [p for p in self._ONLOAD_ORDER if p in chosen and self._groups[p].offloaded]
        if not todo:
            if chosen:
                what = f"{chosen[0]} are" if len(chosen) == 1 else "the chosen parts are"
                warnings.warn(f"{what} already on the device; nothing to do", stacklevel=stacklevel)
            return []
        self._refuse_external_changes(todo, "onload")
        started: list[tuple[Part, GroupTransfer]] = []
        try:
            for p in todo:
                users = self._weight_user_ranges() if p is Part.WEIGHTS and use_order else None
                started.append((p, self._groups[p].start_onload(users, token=self._part_token(p))))
        except BaseException:
            for _, gt in reversed(started):
                gt.cancel()
            raise
        return started

    def _run(self, kind: str, started: list[tuple[Part, GroupTransfer]], blocking: bool):
        """Submit started transitions as one job: the stats when ``blocking``, else the handle."""
        if not started:
            return [] if blocking else transitions.run(kind, [], blocking=False)
        on_settled = [self._after_offload_settled] if kind == "offload" else []
        return transitions.run(kind, [(self, p, gt) for p, gt in started], blocking, on_settled)

    def _transfer_started(self, part: Part, transfer: "transitions.Transfer", gt: GroupTransfer) -> None:
        self._pending[part] = (transfer, gt)
        if part is Part.WEIGHTS and gt.direction == "onload" and self._weight_users_of:
            self._weights_in_flight = (gt, {id(m): u for m, u in self._weight_users_of})

    def _transfer_settled(self, part: Part, transfer: "transitions.Transfer", gt: GroupTransfer) -> None:
        if self._pending.get(part, (None, None))[0] is transfer:
            del self._pending[part]
        w = self._weights_in_flight
        if w is not None and w[0] is gt:
            self._weights_in_flight = None
        self._record_placement([part])

    def _after_offload_settled(self) -> None:
        self._empty_cache()

    def _settle(self, parts: Optional[Iterable[Part]] = None) -> None:
        """Wait for the transitions in flight that move ``parts`` (all by default) and settle them.

        Raises:
            The error of a non-blocking transition that failed and was never waited for (once).
        """
        if not self._pending:
            return
        wanted = None if parts is None else set(parts)
        todo = {id(t): t for p, (t, _) in list(self._pending.items()) if wanted is None or p in wanted}
        for t in todo.values():
            t._settle(observed=False)

    def _await_parts(self, parts: Iterable[Part]) -> None:
        """Make the caller's work wait for the onloads in flight of ``parts`` (R4): on CUDA its
        stream waits, the host does not; on CPU the host waits. A pending offload needs no wait:
        the part counts as offloaded already."""
        for p in parts:
            entry = self._pending.get(p)
            if entry is not None and entry[1].direction == "onload" and entry[1].batch.steps:
                entry[1].batch.fence().wait_on_current_stream()

    def _weight_user_ranges(self) -> Optional[list[list[tuple[int, int, int]]]]:
        """For each module that reads weights directly, in model order: the byte ranges of its own
        parameters and buffers, ``(storage key, first byte, end byte)``."""
        if not self._weight_users_of:
            return None
        out = []
        for module, _ in self._weight_users_of:
            ranges = []
            for t in _own_tensors(module):
                if t.device == self.device:
                    size = t.element_size()
                    start = t.storage_offset() * size
                    ranges.append((storage_key(t), start, start + extent(t) * size))
            out.append(ranges)
        return out

    def _register_weight_users(self, modules: Iterable[torch.nn.Module]) -> None:
        """Give every module that holds parameters or buffers a forward pre-hook that waits for its
        own weights while an onload is in flight (the per-module fences of R4)."""
        users = []
        for m in modules:
            if any(True for _ in _own_tensors(m)):
                users.append((m, len(users)))
                self._hook_handles.append(m.register_forward_pre_hook(self._wait_for_own_weights, prepend=True))
        self._weight_users_of = users

    def _wait_for_own_weights(self, module, args) -> None:
        w = self._weights_in_flight
        if w is None:
            return
        gt, user_of = w
        u = user_of.get(id(module))
        if u is None:
            return
        fence = gt.user_fence(u)
        if fence is not None:
            fence.wait_on_current_stream()

    def _check_host_memory(self, storages: dict[Part, list[torch.UntypedStorage]]) -> None:
        """Refuse, before anything changes, an offload whose new host buffers would not fit in the
        host memory the process can use minus the configured margin (see :mod:`host_memory`)."""
        if not self.config.check_host_memory:
            return
        need = {p: self._groups[p].new_host_bytes(st) for p, st in storages.items()}
        total = sum(need.values())
        if total == 0:
            return  # host stores reused: nothing new to allocate
        usable = host_memory.usable_host_memory()
        if usable.nbytes is None:
            return
        margin = self.config.host_memory_margin_bytes
        if total > usable.nbytes - margin:
            gib = host_memory.gib
            parts = ", ".join(f"{p} {gib(n)}" for p, n in need.items() if n)
            raise HostMemoryError(
                f"offload refused, nothing was changed: it would allocate {gib(total)} of host memory "
                f"({parts}) but the process can use only {gib(max(0, usable.nbytes - margin))} "
                f"({usable.describe()}; minus host_memory_margin_mb={self.config.host_memory_margin_mb:g} "
                f"MiB). Free host memory or raise the memory limit, offload fewer parts, or lower "
                "MemoryConfig.host_memory_margin_mb (check_host_memory=False skips this check)"
            )

    @serialized
    def offload_weights(self, *, blocking: bool = True):
        """Copy the weights to the host store (unless the copy there is current) and free them.

        Args:
            blocking: Wait and return the :class:`TransferStats` (None when already offloaded), or
                return a :class:`~chatlearn_mem.Transfer` at once.
        """
        out = self._run("offload", self._begin_offload([Part.WEIGHTS]), blocking)
        return (out[0] if out else None) if blocking else out

    @serialized
    def onload_weights(self, *, blocking: bool = True):
        """Reallocate the weights on the device and copy them back from the host store.

        Args:
            blocking: Wait and return the :class:`TransferStats` (None when already resident), or
                return a :class:`~chatlearn_mem.Transfer` at once; a forward pass may start right
                away and each module waits for its own weights only.
        """
        out = self._run("onload", self._begin_onload([Part.WEIGHTS], use_order=not blocking), blocking)
        return (out[0] if out else None) if blocking else out

    @serialized
    def weights_state_dict(self) -> dict[str, torch.Tensor]:
        """A host copy of every weight, named as in the model's ``state_dict()``.

        While the weights are offloaded they are read from the host store, so a sleeping model
        can send its weights (for example to a rollout engine) without being woken up. While
        resident they are copied from the device.
        """
        self._settle()  # R5: the host copy is read only once written
        group = self._groups[Part.WEIGHTS]
        out = {}
        for name, t in self._state_dict_tensors():
            if group.offloaded:
                out[name] = group.read_host(t)
            else:
                out[name] = t.detach().to("cpu", copy=True)
        return out

    def _empty_cache(self) -> None:
        if not self.config.empty_cache:
            return
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        elif self.device.type == "cpu":
            device_memory.trim_host_heap()

    def mark_weights_dirty(self) -> None:
        """Declare that the weights changed in a way the manager cannot see.

        Writes through ``param.data`` bypass PyTorch's version counter, which is how the manager
        tells unchanged weights (see ``MemoryConfig.skip_unchanged_weights``); call this after
        such a write so the next offload copies the weights again.
        """
        with self._lock:
            self._dirty_epoch += 1

    def close(self) -> None:
        """Detach the manager from its model and free its host store.

        Removes every hook and method guard it installed, frees the host buffers and lets another
        manager take the model. The manager must not be used afterwards (its calls raise). Calling
        it again is a no-op.

        Raises:
            ChatlearnMemError: A part is offloaded. Closing would strand it (its storages stay at 0
                bytes with nothing left to restore them); call ``onload()`` first. The manager
                does not onload by itself: the device may be in use by another model.
        """
        with self._lock:
            if self._closed:
                return
            self._settle()  # R7: a transition in flight finishes (or rolls back) first
            offloaded = [p for p, g in self._groups.items() if g.offloaded]
            if offloaded:
                raise ChatlearnMemError(
                    f"cannot close {type(self).__name__}: {', '.join(offloaded)} are offloaded, and "
                    "closing would strand them (their storages would stay at 0 bytes with nothing to "
                    "restore them). Call onload() first, then close()"
                )
            for h in reversed(self._hook_handles):
                h.remove()
            self._hook_handles.clear()
            if self._debug_guard is not None:
                self._debug_guard.update(frozenset())
            for g in self._groups.values():
                g.drop_host_store()
            self._release_claim()
            self._closed = True

    def __del__(self) -> None:
        # A sleeping manager dies only with its model (its hooks keep it alive), but the host copy
        # is then the only copy of the state; say so instead of losing it silently.
        try:
            if getattr(self, "_closed", True):
                return
            offloaded = [p.value for p, g in self._groups.items() if g.offloaded]
            if offloaded:
                warnings.warn(
                    f"{type(self).__name__} (created at {self._created_at}) was garbage collected while "
                    f"{', '.join(offloaded)} were offloaded: their host copies are freed with it and the "
                    "model's storages stay released. Call onload() (chatlearn_mem.manager_of(model) finds "
                    "the manager) before dropping a model you still need",
                    UserWarning,
                    stacklevel=2,
                )
            self._release_claim(blocking=False)
        except Exception:  # noqa: BLE001 - never raise from a finaliser (interpreter shutdown)
            pass

    def _released_bytes(self) -> dict[str, int]:
        """Per offloaded part, the bytes its storages had when released (what an onload regrows)."""
        return {part.value: sum(n for _, n in g.released) for part, g in self._groups.items() if g.offloaded}

    def _host_bytes(self) -> dict[str, int]:
        return {part.value: g.host_bytes for part, g in self._groups.items()}

    def _check_storage_state(self, report, part: Part) -> None:
        """Offloaded parts hold no device bytes; resident parts hold every byte their tensors need."""
        group = self._groups[part]
        if group.offloaded:
            for s, n in group.released:
                report.checked += 1
                if s.nbytes() != 0:
                    report.add(
                        f"{part}: a released storage of {n} bytes holds {s.nbytes()} bytes on "
                        "the device although the part is offloaded"
                    )
            released = {s._cdata for s, _ in group.released}
            for s in self._storages(part):
                report.checked += 1
                if s.nbytes() and s._cdata not in released:
                    report.add(
                        f"{part}: a storage of {s.nbytes()} bytes is on the device although the "
                        "part is offloaded (created after the offload?)"
                    )
            return
        for t in self._part_tensors(part):
            if t is None or t.device != self.device:
                continue
            report.checked += 1
            need = (t.storage_offset() + extent(t)) * t.element_size()
            if t.untyped_storage().nbytes() < need:
                report.add(
                    f"{part}: a tensor of shape {tuple(t.shape)} needs {need} bytes but its "
                    f"storage holds {t.untyped_storage().nbytes()} (released and not restored)"
                )
