"""The one owner of a manager's parts' state, and the protocol the rest of the package uses.

A manager (:mod:`chatlearn_mem.manager`) says which tensors make up each part; a
:class:`PartsState` holds everything that changes as the parts move: the storage groups, the
transitions in flight, the per-module weight fences, the placements recorded after each call,
the lock, whether the manager is closed, the thread served host copies for a checkpoint and the
dirty epoch. :mod:`chatlearn_mem.transitions`, :mod:`chatlearn_mem.checkpoint_serving`,
:mod:`chatlearn_mem.owners` and the guards ask it through its public methods:

- begin: :meth:`~PartsState.begin_offload`, :meth:`~PartsState.begin_onload` (checked, host
  stores ready, nothing submitted); :meth:`~PartsState.transfer_started` /
  :meth:`~PartsState.transfer_settled` (what :class:`~chatlearn_mem.transitions.Transfer` reports);
- settle: :meth:`~PartsState.settle`, :meth:`~PartsState.await_parts`;
- serve host copies for a checkpoint: :meth:`~PartsState.served_groups`,
  :meth:`~PartsState.serving_host_copies`;
- retake after a load: :meth:`~PartsState.retake`.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Iterator, Optional, Protocol

import torch

from chatlearn_mem import device_memory, external, host_memory
from chatlearn_mem.config import MemoryConfig
from chatlearn_mem.copy_engine import CopyEngine
from chatlearn_mem.device_memory import storage_key
from chatlearn_mem.errors import ChatlearnMemError, HostMemoryError
from chatlearn_mem.group_transfer import GroupTransfer
from chatlearn_mem.parts import Part, PartsArg, parse_parts
from chatlearn_mem.storage import StorageGroup, extent, unique_storages

__all__ = ["ModelHooks", "PartsState", "Pending", "weak"]


class Pending(Protocol):
    """A transition in flight, as the state sees it (:class:`~chatlearn_mem.transitions.Transfer`)."""

    def settle_unobserved(self) -> None:
        """Settle it as the manager's next call does (raise a failure no one has seen yet)."""


def weak(method: Callable) -> Callable:
    """A function that calls the bound ``method`` without keeping its object alive (the state is
    held by its manager: a strong reference back would make the manager a reference cycle)."""
    ref = weakref.WeakMethod(method)

    def call(*args, **kwargs):
        return ref()(*args, **kwargs)

    return call


@dataclass(frozen=True)
class ModelHooks:
    """What the state asks its manager about the model (functions; see ``MemoryManagerBase``).

    Attributes:
        part_tensors: ``part -> tensors`` that make up the part.
        part_slots: ``part -> (slot, tensor)``, where each tensor is held (see :mod:`external`).
        part_token: ``part -> token`` describing its current contents (None: unknown).
        named_weights: ``() -> (name, tensor)`` of the weights whose storage the audit follows.
        check_offload: ``(parts, force) -> None``; raises to refuse an offload, changing nothing.
        before_release: ``part -> None``; drops what hangs off the part before its release.
        offload_started: ``part -> None``; called once the offload of a part is started.
        retake: ``() -> None``; claim the model's tensors afresh (after a checkpoint load).
    """

    part_tensors: Callable[[Part], Iterable[torch.Tensor]]
    part_slots: Callable[[Part], Iterable[tuple[Hashable, torch.Tensor]]]
    part_token: Callable[[Part], Optional[Hashable]]
    named_weights: Callable[[], Iterable[tuple[str, torch.Tensor]]]
    check_offload: Callable[[list[Part], bool], None]
    before_release: Callable[[Part], None]
    offload_started: Callable[[Part], None]
    retake: Callable[[], None]


def _own_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """A module's own parameters and buffers (not its children's), each once. Read from the
    module's registries directly: ``parameters(recurse=False)`` costs a generator chain per module,
    most of the per-module time of a non-blocking onload's byte ranges (once per call)."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    for registry in (module._parameters, module._buffers):
        for t in registry.values():
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out


class PartsState:
    """The parts of one manager and everything that changes as they move.

    Args:
        owner: The manager's class name, for messages.
        parts: ``part -> keep`` (copy the contents to the host; False: drop them).
        device: The device the parts live on.
        config: The manager's config.
        hooks: What the state asks the manager (:class:`ModelHooks`).
        offload_order: Order in which parts are offloaded.
        onload_order: Order in which parts are onloaded.
        created_at: ``file:line`` where the manager was created (messages).
        contiguous: Parts whose storages may be laid out in a slab (nothing else resizes them).
        hints: How changes made behind the manager's back are explained (default: megatron-core's calls).

    Attributes:
        lock: The manager's lock: its public calls run one at a time under it.
        closed: Whether the manager was closed.
        created_at: Where the manager was created.
    """

    def __init__(
        self,
        owner: str,
        parts: dict[Part, bool],
        device: torch.device,
        config: MemoryConfig,
        hooks: ModelHooks,
        offload_order: tuple[Part, ...],
        onload_order: tuple[Part, ...],
        created_at: str,
        contiguous: frozenset = frozenset(),
        hints: Optional[external.ExternalHints] = None,
    ):
        self.owner = owner
        self.device = device
        self.config = config
        self.hooks = hooks
        self.offload_order = offload_order
        self.onload_order = onload_order
        self.created_at = created_at
        self.hints = hints
        self.lock = threading.RLock()
        self.closed = False
        self._groups = {
            part: StorageGroup(part.value, keep, config, contiguous=part in contiguous) for part, keep in parts.items()
        }
        self._serving_host: Optional[int] = None  # thread reading the host copies through the model
        self._dirty_epoch = 0
        self._placements: dict[Part, external.Placement] = {}  # recorded after each call, see external.py
        # transitions submitted to the copy engine and not yet settled: part -> (handle, its group's)
        self._pending: dict[Part, tuple[Pending, GroupTransfer]] = {}
        # a weights onload in flight with per-module fences: (its group transfer, {id(module): user})
        self._weights_in_flight: Optional[tuple[GroupTransfer, dict[int, int]]] = None
        self._weight_users_of: list[tuple[torch.nn.Module, int]] = []  # modules that read weights, in order

    # -- what the parts are ------------------------------------------------------------------
    @property
    def parts(self) -> tuple[Part, ...]:
        return tuple(self._groups)

    def group(self, part: Part | str) -> StorageGroup:
        """The storage group of ``part``."""
        return self._groups[Part(part)]

    def groups(self) -> dict[Part, StorageGroup]:
        """``part -> storage group``, every part (a new dict)."""
        return dict(self._groups)

    def parse(self, parts: PartsArg) -> list[Part]:
        return parse_parts(parts, self._groups)

    def offloaded(self, part: Part) -> bool:
        """Whether ``part`` counts as offloaded now (also while its offload is in flight)."""
        return part in self._groups and self._groups[part].offloaded

    def offloaded_parts(self) -> list[Part]:
        return [p for p, g in self._groups.items() if g.offloaded]

    def storages(self, part: Part) -> list[torch.UntypedStorage]:
        """The distinct device storages of ``part``'s tensors."""
        return unique_storages(self.hooks.part_tensors(part), self.device)

    def storage_keys(self) -> set[int]:
        """Storage key of every tensor the manager moves or follows (weights and every part)."""
        keys = {storage_key(t) for _, t in self.hooks.named_weights()}
        for part in self._groups:
            keys.update(storage_key(t) for t in self.hooks.part_tensors(part) if t is not None)
        return keys

    def check_open(self, what: str) -> None:
        if self.closed:
            raise ChatlearnMemError(f"{self.owner}.{what}() after close(): the manager is closed; create a new one")

    # -- the dirty epoch -----------------------------------------------------------------------
    @property
    def dirty_epoch(self) -> int:
        """Bumped when the weights changed in a way the manager cannot see (part of the tokens)."""
        return self._dirty_epoch

    def mark_dirty(self) -> None:
        with self.lock:
            self._dirty_epoch += 1

    # -- changes made behind the manager's back ------------------------------------------------
    def record_placement(self, parts: Iterable[Part] = ()) -> None:
        """Remember where ``parts`` (all by default) are now; see :mod:`chatlearn_mem.external`."""
        for part in parts or self._groups:
            self._placements[part] = external.Placement.of(self.hooks.part_slots(part), self.device)

    def external_changes(self, parts: Iterable[Part] = ()) -> list[str]:
        """One sentence per change made to ``parts`` (all by default) by something other than the manager."""
        out = []
        for part in parts or self._groups:
            group = self._groups[part]
            out += external.changes(
                part.value,
                group.offloaded,
                group.released,
                self.hooks.part_slots(part),
                self.device,
                self._placements.get(part),
                self.hints,
            )
        return out

    def _refuse_external_changes(self, parts: Iterable[Part], what: str) -> None:
        found = self.external_changes(parts)
        if found:
            raise external.ExternalChangeError(
                f"refusing to {what}: memory the manager manages was changed by something else, so "
                "it would copy released memory or restore stale bytes. " + "; ".join(found)
            )

    # -- begin an offload or onload --------------------------------------------------------------
    def begin_offload(
        self, parts: PartsArg, force: bool = False, stacklevel: int = 4, paced: bool = False
    ) -> list[tuple[Part, GroupTransfer]]:
        """Check, prepare the host stores and start (not submit) the offload of ``parts``
        (``paced``: a swap's, whose steps another manager's regrows follow, R8).

        Everything that can refuse or fail before a copy (unconsumed grads, communication in
        flight, memory changed behind the manager's back, host memory) is checked first, and
        every host store is allocated before any part changes state, so a refusal changes nothing.
        """
        chosen = self.parse(parts)
        self.settle(chosen)  # R6: a part moves in one direction at a time
        todo = [p for p in self.offload_order if p in chosen and not self._groups[p].offloaded]
        if not todo:
            if chosen:
                what = f"{chosen[0]} are" if len(chosen) == 1 else "the chosen parts are"
                warnings.warn(f"{what} already offloaded; nothing to do", stacklevel=stacklevel)
            return []
        self.hooks.check_offload(todo, force)
        self._refuse_external_changes(todo, "offload")
        storages = {p: self.storages(p) for p in todo}
        self._check_host_memory(storages)
        for p in todo:  # allocate every host store first: a host OOM leaves everything resident
            self._groups[p].prepare(storages[p])
        caller = CopyEngine.for_device(self.device).caller_event()
        started: list[tuple[Part, GroupTransfer]] = []
        try:
            for p in todo:
                self.hooks.before_release(p)
                token = self.hooks.part_token(p) if self.config.skip_unchanged_weights else None
                started.append((p, self._groups[p].start_offload(storages[p], token, caller, paced)))
                self.hooks.offload_started(p)
        except BaseException:
            for _, gt in reversed(started):
                gt.cancel()
            raise
        return started

    def begin_onload(
        self, parts: PartsArg, stacklevel: int = 4, use_order: bool = True, paced: bool = False
    ) -> list[tuple[Part, GroupTransfer]]:
        """Start (not submit) the onload of ``parts``; with ``use_order`` weights are queued in the
        order the model reads them, with a fence per module (R4). Without it (a blocking call,
        where no forward overlaps the copy) they come in storage order and every module waits for
        all of them: no per-tensor work on the host. ``paced``: a swap's, whose regrows follow another
        manager's releases (R8)."""
        chosen = self.parse(parts)
        self.settle(chosen)  # R6
        todo = [p for p in self.onload_order if p in chosen and self._groups[p].offloaded]
        if not todo:
            if chosen:
                what = f"{chosen[0]} are" if len(chosen) == 1 else "the chosen parts are"
                warnings.warn(f"{what} already on the device; nothing to do", stacklevel=stacklevel)
            return []
        self._refuse_external_changes(todo, "onload")
        started: list[tuple[Part, GroupTransfer]] = []
        try:
            for p in todo:
                users = self.weight_user_ranges() if p is Part.WEIGHTS and use_order else None
                started.append((p, self._groups[p].start_onload(users, token=self.hooks.part_token(p), paced=paced)))
        except BaseException:
            for _, gt in reversed(started):
                gt.cancel()
            raise
        return started

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

    # -- in flight and settled -------------------------------------------------------------------
    def transfer_started(self, part: Part, transfer: Pending, gt: GroupTransfer) -> None:
        """``transfer`` now moves ``part`` (called by :func:`chatlearn_mem.transitions.run`)."""
        self._pending[part] = (transfer, gt)
        if part is Part.WEIGHTS and gt.direction == "onload" and self._weight_users_of:
            self._weights_in_flight = (gt, {id(m): u for m, u in self._weight_users_of})

    def transfer_settled(self, part: Part, transfer: Pending, gt: GroupTransfer) -> None:
        """``transfer`` finished moving ``part`` (or rolled it back)."""
        if self._pending.get(part, (None, None))[0] is transfer:
            del self._pending[part]
        w = self._weights_in_flight
        if w is not None and w[0] is gt:
            self._weights_in_flight = None
        if part not in self._placements:
            # A transfer resizes storages and never rebinds a tensor, so the placement the call was
            # checked against still holds: not scanning every tensor again saves O(tensors) per
            # call, and a change made while a non-blocking transfer ran is still caught next call.
            self.record_placement([part])

    def after_offload_settled(self) -> None:
        """Return freed memory (CUDA: the caching allocator's blocks; CPU: the heap's top)."""
        if not self.config.empty_cache:
            return
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        elif self.device.type == "cpu":
            device_memory.trim_host_heap()

    def in_flight(self, part: Part) -> Optional[GroupTransfer]:
        """The group transfer moving ``part`` now (submitted, not settled), or None."""
        entry = self._pending.get(part)
        return entry[1] if entry is not None else None

    def any_in_flight(self) -> bool:
        return bool(self._pending)

    def settle(self, parts: Optional[Iterable[Part]] = None) -> None:
        """Wait for the transitions in flight that move ``parts`` (all by default) and settle them.

        Raises:
            The error of a non-blocking transition that failed and was never waited for (once).
        """
        if not self._pending:
            return
        wanted = None if parts is None else set(parts)
        todo = {id(t): t for p, (t, _) in list(self._pending.items()) if wanted is None or p in wanted}
        for t in todo.values():
            t.settle_unobserved()

    def await_parts(self, parts: Iterable[Part]) -> None:
        """Make the caller's work wait for the onloads in flight of ``parts`` (R4): on CUDA its
        stream waits, the host does not; on CPU the host waits. A pending offload needs no wait:
        the part counts as offloaded already."""
        for p in parts:
            entry = self._pending.get(p)
            if entry is not None and entry[1].direction == "onload" and entry[1].batch.steps:
                entry[1].batch.fence().wait_on_current_stream()

    def moving_keys(self) -> frozenset[int]:
        """Storages a non-blocking offload in flight is still copying from."""
        return frozenset(
            storage_key(s) for _, gt in self._pending.values() if gt.direction == "offload" for s in gt.storages
        )

    def released_keys(self) -> frozenset[int]:
        return frozenset(storage_key(s) for g in self._groups.values() if g.offloaded for s, _ in g.released)

    def part_of_released(self, key: int) -> Optional[Part]:
        """The offloaded part that released the storage ``key``, or None."""
        return next(
            (p for p, g in self._groups.items() if g.offloaded and any(storage_key(s) == key for s, _ in g.released)),
            None,
        )

    # -- per-module weight fences ----------------------------------------------------------------
    @property
    def weight_users(self) -> list[torch.nn.Module]:
        """The modules that read weights directly and wait for their own at an onload, in order."""
        return [m for m, _ in self._weight_users_of]

    def weight_user_of(self, module: torch.nn.Module) -> Optional[int]:
        """The index of ``module``'s fence in the weights onload in flight, or None."""
        w = self._weights_in_flight
        return None if w is None else w[1].get(id(module))

    def weight_user_ranges(self) -> Optional[list[list[tuple[int, int, int]]]]:
        """For each module that reads weights directly, in model order: the byte ranges of its own
        parameters and buffers, ``(storage key, first byte, end byte)``."""
        if not self._weight_users_of:
            return None
        device = self.device
        out = []
        for module, _ in self._weight_users_of:
            ranges = []
            for t in _own_tensors(module):
                if t.device == device:
                    size = t.element_size()
                    start = t.storage_offset() * size
                    ranges.append((storage_key(t), start, start + extent(t) * size))
            out.append(ranges)
        return out

    def register_weight_users(self, modules: Iterable[torch.nn.Module]) -> list:
        """Give every module that holds parameters or buffers a forward pre-hook that waits for its
        own weights while an onload is in flight (the per-module fences of R4); returns the hooks."""
        users, handles = [], []
        for m in modules:
            if _own_tensors(m):
                users.append((m, len(users)))
                handles.append(m.register_forward_pre_hook(self._wait_for_own_weights, prepend=True))
        self._weight_users_of = users
        return handles

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

    # -- serve host copies for a checkpoint, retake after a load -----------------------------------
    def served_groups(self) -> dict[int, StorageGroup]:
        """``storage key -> group`` of every released storage whose bytes are in a host store."""
        served = {}
        for g in self._groups.values():
            if g.offloaded and g.keep_contents:
                for s, _ in g.released:
                    served[storage_key(s)] = g
        return served

    @contextlib.contextmanager
    def serving_host_copies(self) -> Iterator[None]:
        """While inside, the guards let this thread's calls through: the tensors view host copies."""
        self._serving_host = threading.get_ident()
        try:
            yield
        finally:
            self._serving_host = None

    def serving_this_thread(self) -> bool:
        return self._serving_host == threading.get_ident()

    def retake(self) -> None:
        """After a checkpoint load replaced tensors: host copies are stale and the manager takes the
        model's tensors as they are now."""
        self._dirty_epoch += 1
        self.hooks.retake()
        self.record_placement()

    # -- bytes ---------------------------------------------------------------------------------------
    def released_bytes(self) -> dict[str, int]:
        """Per offloaded part, the bytes its storages had when released (what an onload regrows)."""
        return {part.value: sum(n for _, n in g.released) for part, g in self._groups.items() if g.offloaded}

    def host_bytes(self) -> dict[str, int]:
        return {part.value: g.host_bytes for part, g in self._groups.items()}

    def check_storage_state(self, report: Any, part: Part) -> None:
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
            released = {storage_key(s) for s, _ in group.released}
            for s in self.storages(part):
                report.checked += 1
                if s.nbytes() and storage_key(s) not in released:
                    report.add(
                        f"{part}: a storage of {s.nbytes()} bytes is on the device although the "
                        "part is offloaded (created after the offload?)"
                    )
            return
        for t in self.hooks.part_tensors(part):
            if t is None or t.device != self.device:
                continue
            report.checked += 1
            need = (t.storage_offset() + extent(t)) * t.element_size()
            if t.untyped_storage().nbytes() < need:
                report.add(
                    f"{part}: a tensor of shape {tuple(t.shape)} needs {need} bytes but its "
                    f"storage holds {t.untyped_storage().nbytes()} (released and not restored)"
                )

    # -- close ---------------------------------------------------------------------------------------
    def close(self, detach: Callable[[], None]) -> bool:
        """Settle, refuse when a part is offloaded, ``detach()`` the manager, give storages in a
        slab memory of their own, free the host stores.

        Returns:
            False when already closed (nothing done).

        Raises:
            ChatlearnMemError: A part is offloaded (closing would strand it).
        """
        if self.closed:
            return False
        self.settle()  # R7: a transition in flight finishes (or rolls back) first
        offloaded = self.offloaded_parts()
        if offloaded:
            raise ChatlearnMemError(
                f"cannot close {self.owner}: {', '.join(offloaded)} are offloaded, and "
                "closing would strand them (their storages would stay at 0 bytes with nothing to "
                "restore them). Call onload() first, then close()"
            )
        detach()
        for part, g in self._groups.items():
            # a slab's storages get memory of their own back: resizable by others again
            g.leave_slab(self.storages(part))
            g.drop_host_store()
        self.closed = True
        return True
