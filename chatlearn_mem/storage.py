"""Release and restore device storages in place, so that every view of them survives.

A tensor is a view into an ``UntypedStorage``. Megatron's parameters, their ``main_grad``, the
buckets, the bucket groups' cached shards and the optimizer's shard groups are all views into a
few large storages. Resizing such a storage to 0 bytes frees its device memory while every view
keeps pointing at the same storage object; growing it back and copying the bytes in makes every
view valid again, at the same offsets, with nothing to rebuild. :class:`StorageGroup` does this
for one category of state (weights, grads, ...), copying contents through a :class:`HostStore`
when they must survive.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Hashable, Iterable, Optional

import torch

from chatlearn_mem.config import MemoryConfig
from chatlearn_mem.host_store import HostStore

__all__ = ["StorageGroup", "TransferStats", "advise_huge_pages", "extent", "storage_key", "unique_storages"]

logger = logging.getLogger("chatlearn_mem")


def storage_key(t: torch.Tensor | torch.UntypedStorage) -> int:
    """Identity of the storage object behind a tensor (stable while it is resized)."""
    s = t.untyped_storage() if isinstance(t, torch.Tensor) else t
    return s._cdata


def unique_storages(tensors: Iterable[torch.Tensor], device: torch.device) -> list[torch.UntypedStorage]:
    """Distinct storages of ``tensors`` on ``device``, each once, in first-seen order."""
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        if t is None or t.device != device:
            continue
        s = t.untyped_storage()
        seen.setdefault(s._cdata, s)
    return list(seen.values())


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def extent(t: torch.Tensor) -> int:
    """Elements of its storage a tensor reaches past its storage offset (0 when empty)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def _grow_storage(storage: torch.UntypedStorage, nbytes: int) -> None:
    """Reallocate a released storage. Module-level so tests can inject allocation failures."""
    storage.resize_(nbytes)


_HUGE_PAGE = 2 * 2**20
_MADV_HUGEPAGE = 14  # linux/mman.h
_madvise = None  # resolved libc madvise, False when unavailable


def _libc_madvise(address: int, length: int, advice: int) -> int:
    """``madvise(2)`` through libc; returns its result (0 on success, -1 when unavailable)."""
    global _madvise
    if _madvise is None:
        try:
            fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
            _madvise = fn
        except (OSError, AttributeError):
            _madvise = False
    return _madvise(address, length, advice) if _madvise else -1


def advise_huge_pages(storage: torch.UntypedStorage) -> bool:
    """Ask Linux to back the 2 MiB-aligned interior of a CPU storage with transparent huge pages.

    Call it right after growing a released storage, before anything touches it: the first write
    then faults in 2 MiB pages instead of 4 KiB ones (512x fewer page faults), and releasing the
    storage again unmaps far fewer pages. Only the aligned range inside the storage is advised,
    so no neighbouring allocation is affected. Returns whether a range was advised; storages
    under 4 MiB, non-CPU storages and non-Linux systems are left alone.
    """
    n = storage.nbytes()
    if storage.device.type != "cpu" or not sys.platform.startswith("linux") or n < 2 * _HUGE_PAGE:
        return False
    ptr = storage.data_ptr()
    lo = -(-ptr // _HUGE_PAGE) * _HUGE_PAGE
    hi = (ptr + n) // _HUGE_PAGE * _HUGE_PAGE
    if hi <= lo:
        return False
    return _libc_madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


@dataclass(frozen=True)
class TransferStats:
    """What one offload or onload of a group did."""

    group: str
    direction: str  # "offload" or "onload"
    nbytes: int  # bytes released or restored on the device
    copied_bytes: int  # bytes that crossed to or from the host
    seconds: float

    @property
    def gb_per_s(self) -> float:
        """Copy throughput in GB/s (0 when nothing was copied)."""
        return self.copied_bytes / self.seconds / 1e9 if self.copied_bytes and self.seconds else 0.0


class StorageGroup:
    """The storages of one category of state, released and restored together.

    Args:
        name: Category name used in messages ("weights", "grads", ...).
        keep_contents: Copy the bytes to the host before releasing and back after restoring.
            When False the storages are dropped and restored zeroed (gradients).
        config: Bucket size and pinning of the host store.
    """

    def __init__(self, name: str, keep_contents: bool, config: MemoryConfig):
        self.name = name
        self.keep_contents = keep_contents
        self._config = config
        self.store: Optional[HostStore] = None
        self._released: list[tuple[torch.UntypedStorage, int]] = []
        self.offloaded = False
        # Token describing the device contents the host copy holds; None when it holds none.
        self._host_token: Optional[Hashable] = None
        self._host_keys: tuple[int, ...] = ()
        # Readers of the host store outside the manager's lock (an asynchronous checkpoint save):
        # nothing may copy into, reallocate or free the store while one is registered.
        self._readers = 0
        self._readers_done = threading.Condition()

    @property
    def released(self) -> list[tuple[torch.UntypedStorage, int]]:
        """``(storage, size in bytes)`` of each storage released by the last offload."""
        return list(self._released)

    @property
    def host_bytes(self) -> int:
        return self.store.nbytes if self.store is not None else 0

    def host_copy_current(self, token: Optional[Hashable], storages: list[torch.UntypedStorage]) -> bool:
        """Whether the host store already holds exactly these storages' current contents."""
        return (token is not None and token == self._host_token
                and tuple(s._cdata for s in storages) == self._host_keys)

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
                out[lo - start:hi - start].copy_(host[lo - off:hi - off])
        return out.view(t.dtype).as_strided(t.shape, t.stride()).clone()

    def _host_span(self, t: torch.Tensor) -> tuple[int, int, int]:
        """``(index of t's storage in the host store, t's first byte, t's byte count)``."""
        if not (self.offloaded and self.keep_contents and self.store is not None):
            raise ValueError(f"{self.name} hold no host copy to read (offloaded={self.offloaded})")
        try:
            index = self._host_keys.index(storage_key(t))
        except ValueError:
            raise ValueError(f"a tensor of shape {tuple(t.shape)} is not a view of a storage of "
                             f"{self.name}") from None
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
                piece = host[start - off:start - off + nbytes]
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
                logger.info("%s: waiting for %d reader(s) of the host store (a checkpoint save)",
                            self.name, self._readers)
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
        self.wait_for_readers()
        self.store = None
        self._host_token = None
        self._host_keys = ()

    def prepare(self, storages: list[torch.UntypedStorage]) -> None:
        """Allocate (or reuse) the host store for these storages. Changes nothing on failure."""
        if not self.keep_contents:
            return
        sizes = [s.nbytes() for s in storages]
        if self.store is not None and self.store.sizes == tuple(sizes):
            return
        self.wait_for_readers()
        pin = self._config.resolved_pin_memory()
        old, self.store = self.store, None
        self._host_token = None
        del old  # free the old buckets before allocating the new ones: no 2x host peak
        self.store = HostStore(sizes, self._config.bucket_size_bytes, pin)

    def offload(self, storages: list[torch.UntypedStorage], token: Optional[Hashable] = None) -> TransferStats:
        """Copy (if needed) and release ``storages``.

        Args:
            storages: Resident device storages of this group.
            token: Describes the current device contents; when it equals the token of the host
                copy the copy is skipped. None always copies.

        Raises:
            Whatever the host allocation or a copy raises; then nothing has been released.
        """
        assert not self.offloaded, f"{self.name} is already offloaded"
        t0 = time.perf_counter()
        copied = 0
        if self.keep_contents and not self.host_copy_current(token, storages):
            self.wait_for_readers()  # a checkpoint save still reading the store: let it finish
            self.prepare(storages)
            self._host_token = None  # the copy below may fail half way
            device = storages[0].device if storages else torch.device("cpu")
            non_blocking = self.store.pinned
            for i, s in enumerate(storages):
                src = _byte_view(s)
                for host, off in self.store.views(i):
                    host.copy_(src[off:off + host.numel()], non_blocking=non_blocking)
                copied += s.nbytes()
            _synchronize(device)
            self._host_token = token
            self._host_keys = tuple(s._cdata for s in storages)
        released = [(s, s.nbytes()) for s in storages]
        for s, _ in released:
            s.resize_(0)
        self._released = released
        self.offloaded = True
        stats = TransferStats(self.name, "offload", sum(n for _, n in released), copied,
                              time.perf_counter() - t0)
        logger.info("offloaded %s: %.1f MB released, %.1f MB copied (%.2f GB/s)", self.name,
                    stats.nbytes / 1e6, copied / 1e6, stats.gb_per_s)
        return stats

    def onload(self) -> TransferStats:
        """Reallocate the released storages and restore their contents (or zeros).

        Raises:
            Whatever a device allocation raises; then every storage grown so far is released
            again, the group stays offloaded and the host copy is untouched.
        """
        assert self.offloaded, f"{self.name} is not offloaded"
        t0 = time.perf_counter()
        grown: list[torch.UntypedStorage] = []
        try:
            for s, n in self._released:
                _grow_storage(s, n)
                grown.append(s)
                if self._config.cpu_huge_pages:
                    advise_huge_pages(s)
        except BaseException:
            for s in grown:
                s.resize_(0)
            raise
        copied = 0
        device = self._released[0][0].device if self._released else torch.device("cpu")
        if self.keep_contents:
            non_blocking = self.store.pinned
            for i, (s, n) in enumerate(self._released):
                dst = _byte_view(s)
                for host, off in self.store.views(i):
                    dst[off:off + host.numel()].copy_(host, non_blocking=non_blocking)
                copied += n
        else:
            for s, _ in self._released:
                _byte_view(s).zero_()
        _synchronize(device)
        nbytes = sum(n for _, n in self._released)
        self._released = []
        self.offloaded = False
        stats = TransferStats(self.name, "onload", nbytes, copied, time.perf_counter() - t0)
        logger.info("onloaded %s: %.1f MB restored, %.1f MB copied (%.2f GB/s)", self.name,
                    nbytes / 1e6, copied / 1e6, stats.gb_per_s)
        return stats
