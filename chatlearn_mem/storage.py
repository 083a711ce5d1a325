"""Release and restore device storages in place, so that every view of them survives.

A tensor is a view into an ``UntypedStorage``. Megatron's parameters, their ``main_grad``, the
buckets, the bucket groups' cached shards and the optimizer's shard groups are all views into a
few large storages. Resizing such a storage to 0 bytes frees its device memory while every view
keeps pointing at the same storage object; growing it back and copying the bytes in makes every
view valid again, at the same offsets, with nothing to rebuild. :class:`StorageGroup` does this
for one category of state (weights, grads, ...), copying contents through a :class:`HostStore`
when they must survive. One offload or onload of a group is a
:class:`~chatlearn_mem.group_transfer.GroupTransfer`.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from typing import Hashable, Iterable, Optional

import torch

from chatlearn_mem.config import MemoryConfig
from chatlearn_mem.copy_engine import CopyEngine
from chatlearn_mem.device_memory import (
    Block,
    DeviceSlab,
    Slab,
    SlabPlacement,
    own_memory,
    parks_cpu_memory,
    storage_id,
    storage_key,
)
from chatlearn_mem.group_transfer import (
    CPU_SLAB_STEP_MULTIPLIER,
    CPU_USER_STEP_DIVISOR,
    USER_STEP_DIVISOR,
    GroupTransfer,
    TransferStats,
    device_of,
    offload_plan,
    onload_plan,
)
from chatlearn_mem.host_store import HostStore

__all__ = [
    "GroupTransfer",
    "StorageGroup",
    "TransferStats",
    "extent",
    "storage_key",
    "unique_storages",
]

logger = logging.getLogger("chatlearn_mem")


def unique_storages(tensors: Iterable[torch.Tensor], device: torch.device) -> list[torch.UntypedStorage]:
    """Distinct storages of ``tensors`` on ``device``, each once, in first-seen order."""
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        if t is None or t.device != device:
            continue
        s = t.untyped_storage()
        seen.setdefault(storage_id(s), s)
    return list(seen.values())


def extent(t: torch.Tensor) -> int:
    """Elements of its storage a tensor reaches past its storage offset (0 when empty)."""
    n = t.numel()
    if n == 0:
        return 0
    if t.is_contiguous():  # the common case, without a Python loop over the dimensions
        return n
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


class StorageGroup:
    """The storages of one category of state, released and restored together.

    Args:
        name: Category name used in messages ("weights", "grads", ...).
        keep_contents: Copy the bytes to the host before releasing and back after restoring.
            When False the storages are dropped and restored zeroed (gradients).
        config: Bucket size and pinning of the host store.
        contiguous: Lay several storages out at the offsets of their host store (at their first
            onload), so that one copy and one release move many of them: on a CPU device in one
            :class:`~chatlearn_mem.device_memory.Slab` (``MemoryConfig.cpu_contiguous``), on CUDA
            in a :class:`~chatlearn_mem.device_memory.DeviceSlab` (``MemoryConfig.cuda_contiguous``).
            Only for storages nothing else resizes: in a slab ``resize_`` raises (a trainer's main
            weights and optimizer states, an inference model's weights; not megatron's param and
            grad buffers, which its own offload calls resize).
    """

    def __init__(self, name: str, keep_contents: bool, config: MemoryConfig, contiguous: bool = False):
        self.name = name
        self.keep_contents = keep_contents
        self.contiguous = contiguous
        self._config = config
        # contiguous: the slab the storages live in, laid out as the host store (forgotten
        # whenever the store changes)
        self._slab: Optional[Slab | DeviceSlab] = None
        self.store: Optional[HostStore] = None
        self._released: list[tuple[torch.UntypedStorage, int]] = []
        # CPU: the memory of each released storage (by storage key) while the group is offloaded
        # (device_memory.release); an onload moves it back in, with no allocation
        self._parked: dict[int, Block] = {}
        # CPU: the address of the memory each storage got at its last regrow (device_memory); a
        # kept block elsewhere is the storage's first allocation, which the next regrow replaces
        # once by fresh memory with huge pages advised: only a hint, never needed for correctness
        self._mapped: dict[int, int] = {}
        self.offloaded = False
        # Token describing the device contents the host copy holds; None when it holds none.
        self._host_token: Optional[Hashable] = None
        self._host_keys: tuple[int, ...] = ()
        # Readers of the host store outside the manager's lock (an asynchronous checkpoint save):
        # nothing may copy into, reallocate or free the store while one is registered.
        self._readers = 0
        self._readers_done = threading.Condition()
        self._transfer: Optional[GroupTransfer] = None  # submitted to the copy engine, not yet settled
        self._plans: dict = {}  # the actions of a transition, per layout (sizes, host store, users)

    @property
    def released(self) -> list[tuple[torch.UntypedStorage, int]]:
        """``(storage, size in bytes)`` of each storage released by the last offload."""
        return list(self._released)

    @property
    def host_bytes(self) -> int:
        return self.store.nbytes if self.store is not None else 0

    def host_copy_current(self, token: Optional[Hashable], storages: list[torch.UntypedStorage]) -> bool:
        """Whether the host store already holds exactly these storages' current contents."""
        return (
            token is not None
            and token == self._host_token
            and tuple(storage_key(s) for s in storages) == self._host_keys
        )

    def set_host_token(self, token: Optional[Hashable]) -> None:
        """Record that the host copy equals the device contents described by ``token``."""
        if self.keep_contents and self.store is not None:
            self._host_token = token

    def read_host(self, t: torch.Tensor) -> torch.Tensor:
        """A new host tensor equal to ``t`` as it was when its storage was offloaded.

        ``t`` is any view of a storage this group released; its bytes are read from the host
        store, so nothing is allocated on the device.

        Raises:
            ValueError: The group is not offloaded, does not keep contents, or ``t`` is not a view
                of one of its storages.
        """
        index, start, nbytes = self._host_span(t)
        out = torch.empty(nbytes, dtype=torch.uint8)
        for host, off in self.store.views(index):
            lo, hi = max(start, off), min(start + nbytes, off + host.numel())
            if lo < hi:
                out[lo - start : hi - start].copy_(host[lo - off : hi - off])
        if t.is_contiguous():  # the bytes are the tensor already: no second copy
            return out.view(t.dtype).view(t.shape)
        return out.view(t.dtype).as_strided(t.shape, t.stride()).clone()

    def _host_span(self, t: torch.Tensor) -> tuple[int, int, int]:
        """``(index of t's storage in the host store, t's first byte, t's byte count)``."""
        if not (self.offloaded and self.keep_contents and self.store is not None):
            raise ValueError(f"{self.name} hold no host copy to read (offloaded={self.offloaded})")
        try:
            index = self._host_keys.index(storage_key(t))
        except ValueError:
            raise ValueError(f"a tensor of shape {tuple(t.shape)} is not a view of a storage of {self.name}") from None
        size = t.element_size()
        return index, t.storage_offset() * size, extent(t) * size

    def host_view(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor equal to ``t`` as it was offloaded, sharing the host store's memory when
        ``t``'s bytes lie in one bucket (else a copy, as :meth:`read_host`).

        The view owns a storage of exactly ``t``'s bytes (not the whole bucket), so writers that
        copy "views of a larger storage" (megatron's checkpoint writer) take it as it is. It is
        valid while the store is not overwritten: hold :meth:`reading` while it is in use.

        Raises:
            ValueError: As :meth:`read_host`.
        """
        index, start, nbytes = self._host_span(t)
        for host, off in self.store.views(index):
            if off <= start and start + nbytes <= off + host.numel():
                piece = host[start - off : start - off + nbytes]
                # from_numpy: a storage of exactly these bytes over the bucket's memory (no copy)
                exact = torch.from_numpy(piece.numpy()) if nbytes else torch.empty(0, dtype=torch.uint8)
                return exact.view(t.dtype).as_strided(t.shape, t.stride())
        return self.read_host(t)

    @contextmanager
    def reading(self):
        """Register a reader of the host store for the duration of the ``with`` block: every call
        that would overwrite, reallocate or free the store (:meth:`offload` with a copy,
        :meth:`prepare`, :meth:`drop_host_store`) waits until no reader is left."""
        with self._readers_done:
            self._readers += 1
        try:
            yield self
        finally:
            with self._readers_done:
                self._readers -= 1
                self._readers_done.notify_all()

    @property
    def readers(self) -> int:
        """Readers registered through :meth:`reading` now."""
        return self._readers

    def wait_for_readers(self) -> None:
        """Block until no reader of the host store is left (see :meth:`reading`)."""
        with self._readers_done:
            if self._readers:
                logger.info(
                    "%s: waiting for %d reader(s) of the host store (a checkpoint save)", self.name, self._readers
                )
            self._readers_done.wait_for(lambda: self._readers == 0)

    def new_host_bytes(self, storages: list[torch.UntypedStorage]) -> int:
        """Host bytes an offload of ``storages`` would newly allocate: 0 when the group keeps no
        contents or its store already fits them (reused), else the new store's size less the old
        one's (:meth:`prepare` frees the old store before allocating the new one)."""
        if not self.keep_contents:
            return 0
        sizes = [s.nbytes() for s in storages]
        if self.store is not None and self.store.sizes == tuple(sizes):
            return 0
        return max(0, HostStore.planned_nbytes(sizes, self._config.bucket_size_bytes) - self.host_bytes)

    def drop_host_store(self) -> None:
        """Free the host store (the group must be resident: the store holds no needed bytes)."""
        assert not self.offloaded, f"{self.name} is offloaded; its host store holds the only copy"
        assert self._transfer is None, f"{self.name} has a transition in flight (R7)"
        self.wait_for_readers()
        if self.store is not None:
            self.store.close()  # unpinned and returned to the OS now, not when collected
        self.store = None
        self._plans.clear()  # they name the store's buckets
        self._host_token = None
        self._host_keys = ()
        self._forget_slab()

    def prepare(self, storages: list[torch.UntypedStorage]) -> None:
        """Allocate (or reuse) the host store for these storages. Changes nothing on failure."""
        if not self.keep_contents:
            return
        sizes = [s.nbytes() for s in storages]
        if self.store is not None and self.store.sizes == tuple(sizes):
            return
        assert self._transfer is None, f"{self.name} has a transition in flight (R7)"
        self.wait_for_readers()
        pin = self._config.resolved_pin_memory()
        old, self.store = self.store, None
        self._plans.clear()  # they name the old store's buckets
        self._host_token = None
        if old is not None:
            old.close()  # free the old buckets before allocating the new ones: no 2x host peak
        del old
        self._forget_slab()  # its layout was the old store's
        self.store = HostStore(sizes, self._config.bucket_size_bytes, pin)

    # -- a slab (see device_memory.Slab, DeviceSlab) ------------------------------------------
    @property
    def slab(self) -> Optional[Slab | DeviceSlab]:
        """The slab the group's storages are laid out in (``contiguous``), or None."""
        return self._slab

    def leave_slab(self, storages: list[torch.UntypedStorage]) -> int:
        """Give each of ``storages`` that lives in a slab memory of its own, with its bytes (one copy
        each; :func:`~chatlearn_mem.device_memory.own_memory`), so that others may resize it; the
        group lays them out again at its next onload. Returns how many moved."""
        if self._slab is None:
            return 0
        moved = sum(own_memory(s) for s in storages)
        if not self._slab.keeps_released:
            device = device_of(storages)
            if device.type == "cuda":  # the copies out of the segments are done before they go
                torch.cuda.current_stream(device).synchronize()
            self._forget_slab()  # a DeviceSlab's segments go with the pieces the storages held
        return moved

    def _forget_slab(self) -> None:
        """The slab's layout is no longer the store's: the next onload lays the storages out anew
        (storages and kept blocks still in the old slab keep it alive until they leave it)."""
        if self._slab is not None and not self._slab.keeps_released:
            self._slab.hand_back()  # its segments stay alive only through the pieces still in use
        self._slab = None

    def _slab_kind(self, storages: list[torch.UntypedStorage]) -> Optional[type]:
        """The kind of slab these storages are laid out in (or are to be) at the store's layout:
        :class:`Slab` on a CPU device (``cpu_contiguous``), :class:`DeviceSlab` on CUDA
        (``cuda_contiguous``), None when not laid out in one."""
        if not (
            self.contiguous
            and self.keep_contents
            and self.store is not None
            and len(storages) > 1
            and parks_cpu_memory()
        ):
            return None
        kind = device_of(storages).type
        if kind == "cpu" and self._config.cpu_contiguous:
            return Slab
        if kind == "cuda" and self._config.cuda_contiguous:
            return DeviceSlab
        return None

    def _slab_for_onload(
        self, storages: list[torch.UntypedStorage]
    ) -> Optional[tuple[Slab | DeviceSlab, SlabPlacement]]:
        """The slab the onload regrows ``storages`` into, laid out for the store if there is none
        yet (a CPU slab: only address space, the pages come with the copies; a DeviceSlab: its
        segments come with the regrows); None when not laid out in one."""
        kind = self._slab_kind(storages)
        if kind is None:
            return None
        offsets = self.store.flat_offsets
        if not isinstance(self._slab, kind):
            self._forget_slab()
            if kind is Slab:
                self._slab = Slab(self.store.nbytes, self._config.cpu_huge_pages)
            else:
                device = device_of(storages)
                engine = CopyEngine.for_device(device)
                streams = tuple(lane.stream for lane in engine.lanes.values()) if engine.is_cuda else ()
                self._slab = DeviceSlab(offsets, self.store.sizes, self._config.copy_chunk_bytes, device, streams)
        return self._slab, self._slab.placement(offsets)

    def _slab_for_offload(
        self, storages: list[torch.UntypedStorage]
    ) -> Optional[tuple[Slab | DeviceSlab, SlabPlacement]]:
        """The slab, when every storage lives in it at its offset (else None: a storage changed
        memory since its onload, or the storages were never onloaded by this group; a DeviceSlab is
        then forgotten, so that its segments go with the releases)."""
        kind = self._slab_kind(storages)
        if kind is None or not isinstance(self._slab, kind):
            return None
        offsets = self.store.flat_offsets
        if not self._slab.holds_all(storages, offsets):
            if not self._slab.keeps_released:
                self._forget_slab()
            return None
        return self._slab, self._slab.placement(offsets)

    # -- transitions through the copy engine ------------------------------------------------
    def _step_sizes(self, storages: list[torch.UntypedStorage], slab, use: bool, paced: bool) -> tuple[int, int]:
        """``(chunk, user step divisor)`` of a transition's plan: ``copy_chunk_bytes`` and
        :data:`~chatlearn_mem.group_transfer.USER_STEP_DIVISOR`, except on a CPU device, where an
        onload in use order (``use``) takes
        :data:`~chatlearn_mem.group_transfer.CPU_USER_STEP_DIVISOR` and a slab's transition
        without one that nothing paces (``paced``: a swap's side) takes steps of
        :data:`~chatlearn_mem.group_transfer.CPU_SLAB_STEP_MULTIPLIER` chunks."""
        chunk = self._config.copy_chunk_bytes
        if device_of(storages).type != "cpu":
            return chunk, USER_STEP_DIVISOR
        if use:
            return chunk, CPU_USER_STEP_DIVISOR
        if slab is not None and not paced:
            return chunk * CPU_SLAB_STEP_MULTIPLIER, USER_STEP_DIVISOR
        return chunk, USER_STEP_DIVISOR

    def start_offload(
        self,
        storages: list[torch.UntypedStorage],
        token: Optional[Hashable] = None,
        caller_event=None,
        paced: bool = False,
    ) -> "GroupTransfer":
        """Start the copy (if needed) and release of ``storages``: the group is offloaded from now
        on (its state is the target state). Submit :attr:`GroupTransfer.batch` to the copy engine;
        :meth:`GroupTransfer.finish` settles it once done (:func:`transitions.run` does both).

        Args:
            storages: Resident device storages of this group.
            token: Describes the current device contents; when it equals the token of the host
                copy the copy is skipped. None always copies.
            caller_event: CUDA: an event on the caller's stream the copies wait for (R1); ignored
                when the storages are not on a CUDA device (none, or CPU ones).
            paced: Another group's regrows follow this offload's releases (a swap, R8): its steps
                stay at ``copy_chunk_bytes`` (see :meth:`_step_sizes`).

        Raises:
            Whatever the host allocation raises; then nothing has changed.
        """
        assert not self.offloaded, f"{self.name} is already offloaded"
        assert self._transfer is None, f"{self.name} has a transition in flight"
        copy = self.keep_contents and not self.host_copy_current(token, storages)
        if copy:
            self.wait_for_readers()  # R5: a checkpoint save still reading the store: let it finish
            self.prepare(storages)
            self._host_token = None  # the copy may fail half way
        sizes = tuple(s.nbytes() for s in storages)
        # R1 on CUDA only: the lane is the storages' (no storages, or CPU ones: a CPU lane, which
        # has no stream to wait with and needs none)
        if device_of(storages).type != "cuda":
            caller_event = None
        slab = self._slab_for_offload(storages)
        chunk, _ = self._step_sizes(storages, slab, False, paced)
        key = (
            "offload",
            sizes,
            copy,
            id(self.store) if copy else None,
            caller_event is not None,
            type(slab[0]) if slab is not None else None,
            chunk,
        )
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = offload_plan(
                sizes,
                self.store if copy else None,
                chunk,
                caller_event is not None,
                slab[1] if slab is not None else None,
            )
        t = GroupTransfer(self, "offload", plan, list(storages), list(sizes), copy, token, caller_event, slab)
        self._released = list(zip(storages, sizes))
        self.offloaded = True
        self._transfer = t
        return t

    def start_onload(
        self,
        users: Optional[list[list[tuple[int, int, int]]]] = None,
        token: Optional[Hashable] = None,
        paced: bool = False,
    ) -> "GroupTransfer":
        """Start the regrow and copy back (or zeroing) of the released storages: the group is
        resident from now on (its target state); submit and settle as :meth:`start_offload`.

        Args:
            users: Optional use order: ``users[u]`` lists the ``(storage key, first byte, end byte)``
                ranges that user ``u`` (a module) reads, users in the order they run. The copies
                are queued in that order and :meth:`GroupTransfer.user_fence` gives the fence after
                which user ``u`` may read (R4); bytes no user reads follow.
            token: Describes the contents once restored (the host copy's): recorded when the
                onload is settled, so that an offload before any write skips the copy.
            paced: This onload's regrows follow another group's releases (a swap, R8): its steps
                stay at ``copy_chunk_bytes`` (see :meth:`_step_sizes`).
        """
        assert self.offloaded, f"{self.name} is not offloaded"
        assert self._transfer is None, f"{self.name} has a transition in flight"
        storages = [s for s, _ in self._released]
        sizes = tuple(n for _, n in self._released)
        index = {storage_id(s): i for i, s in enumerate(storages)} if users else {}
        use = tuple(tuple((index[k], a, b) for k, a, b in ranges if k in index) for ranges in users or ())
        slab = self._slab_for_onload(storages)
        chunk, divisor = self._step_sizes(storages, slab, bool(use), paced)
        kind = type(slab[0]) if slab is not None else None
        key = ("onload", sizes, id(self.store) if self.keep_contents else None, use, kind, divisor, chunk)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 8:  # sizes or users changed many times: keep the cache small
                self._plans.clear()
            plan = self._plans[key] = onload_plan(
                sizes,
                self.store if self.keep_contents else None,
                chunk,
                use,
                slab[1] if slab is not None else None,
                divisor,
            )
        t = GroupTransfer(self, "onload", plan, storages, list(sizes), self.keep_contents, token, None, slab)
        self.offloaded = False
        self._transfer = t
        return t

    def offload(self, storages: list[torch.UntypedStorage], token: Optional[Hashable] = None) -> TransferStats:
        """Copy (if needed) and release ``storages``, and wait (:meth:`start_offload`).

        Raises:
            Whatever the host allocation or a copy raises; then nothing has been released.
        """
        t = self.start_offload(storages, token, CopyEngine.for_device(device_of(storages)).caller_event())
        return t.run_blocking()

    def onload(self) -> TransferStats:
        """Reallocate the released storages, restore their contents (or zeros) and wait.

        Raises:
            Whatever a device allocation or copy raises; then every storage grown so far is
            released again, the group stays offloaded and the host copy is untouched.
        """
        return self.start_onload().run_blocking()

    @property
    def transfer(self) -> Optional["GroupTransfer"]:
        """The transition in flight (submitted, not yet settled), or None."""
        return self._transfer

    # -- what a GroupTransfer asks and reports (group_transfer.py) ---------------------------
    @property
    def config(self) -> MemoryConfig:
        """Bucket size, pinning, copy chunk and the CPU release settings of this group."""
        return self._config

    def park(self, key: int, block: Block) -> None:
        """Keep the memory storage ``key`` was released with (CPU) for its regrow."""
        self._parked[key] = block

    @property
    def parked_count(self) -> int:
        """How many released storages' memory the group keeps for their next onload (CPU device)."""
        return len(self._parked)

    def drop_parked(self) -> None:
        """Give up the memory kept for released storages: their next onload allocates anew."""
        self._parked.clear()

    def parked(self, key: int, huge_pages: bool) -> Optional[Block]:
        """The memory to regrow storage ``key`` into: the block its release kept, or None (none
        kept, or it is the storage's first allocation and ``huge_pages``: map fresh memory, once)."""
        block = self._parked.get(key)
        if block is not None and self._mapped.get(key) != block.address and huge_pages:
            return None  # torch's first allocation (4 KiB pages, maybe): map huge pages instead, once
        return block

    def regrown(self, key: int, address: Optional[int]) -> None:
        """Storage ``key`` was regrown, at ``address`` (CPU; None on CUDA): its kept block is used."""
        self._parked.pop(key, None)  # only once grown: a failed regrow keeps the block
        if address is not None:
            self._mapped[key] = address

    def transfer_cancelled(self, direction: str) -> None:
        """A transition started and never submitted was undone: back where the group was."""
        if direction == "offload":
            self._released = []
            self.offloaded = False
        else:
            self.offloaded = True
        self._transfer = None

    def transfer_succeeded(
        self, direction: str, storages: list[torch.UntypedStorage], copied: bool, token: Optional[Hashable]
    ) -> None:
        """Every step ran: record the host copy (offload, when ``copied``) or the restored state."""
        if direction == "offload":
            if copied:
                self._host_token = token
                self._host_keys = tuple(storage_key(s) for s in storages)
        else:
            self._released = []
            self._parked.clear()  # every block went back into its storage; nothing else is kept
            self.set_host_token(token)
        self._transfer = None

    def onload_rolled_back(self) -> None:
        """A failed onload released what it regrew: the group is offloaded, its host copy intact."""
        self.offloaded = True

    def offload_rolled_back(self, still_released: list[tuple[torch.UntypedStorage, int]], offloaded: bool) -> None:
        """A failed offload regrew what it could: ``still_released`` stay released (with complete
        host copies); the host copy describes no device contents any more."""
        self._released = list(still_released)
        self.offloaded = offloaded
        self._host_token = None

    def transfer_ended(self) -> None:
        """The transition in flight is settled (a failure once rolled back)."""
        self._transfer = None
