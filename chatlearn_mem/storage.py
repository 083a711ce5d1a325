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

import bisect
import ctypes
import ctypes.util
import functools
import logging
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Hashable, Iterable, Optional

import torch

from chatlearn_mem.config import MemoryConfig
from chatlearn_mem.copy_engine import Batch, CopyEngine, Fence, Job
from chatlearn_mem.errors import TransferError
from chatlearn_mem.host_store import HostStore

__all__ = ["GroupTransfer", "StorageGroup", "TransferStats", "advise_huge_pages", "extent", "storage_key",
           "unique_storages"]

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
        self._transfer: Optional[GroupTransfer] = None  # submitted to the copy engine, not yet settled

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
        assert self._transfer is None, f"{self.name} has a transition in flight (R7)"
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
        assert self._transfer is None, f"{self.name} has a transition in flight (R7)"
        self.wait_for_readers()
        pin = self._config.resolved_pin_memory()
        old, self.store = self.store, None
        self._host_token = None
        del old  # free the old buckets before allocating the new ones: no 2x host peak
        self.store = HostStore(sizes, self._config.bucket_size_bytes, pin)

    # -- transitions through the copy engine ------------------------------------------------
    def start_offload(self, storages: list[torch.UntypedStorage], token: Optional[Hashable] = None,
                      caller_event=None) -> "GroupTransfer":
        """Submit the copy (if needed) and release of ``storages`` to the d2h lane; return at once.

        The group is offloaded from now on (its state is the target state); the bytes move in the
        background and :meth:`GroupTransfer.finish` settles it. Submit with ``CopyEngine.submit``.

        Args:
            storages: Resident device storages of this group.
            token: Describes the current device contents; when it equals the token of the host
                copy the copy is skipped. None always copies.
            caller_event: CUDA: an event on the caller's stream the copies wait for (R1).

        Raises:
            Whatever the host allocation raises; then nothing has changed.
        """
        assert not self.offloaded, f"{self.name} is already offloaded"
        assert self._transfer is None, f"{self.name} has a transition in flight"
        engine = CopyEngine.for_device(_device_of(storages))
        copy = self.keep_contents and not self.host_copy_current(token, storages)
        if copy:
            self.wait_for_readers()  # R5: a checkpoint save still reading the store: let it finish
            self.prepare(storages)
            self._host_token = None  # the copy may fail half way
        batch = Batch("d2h", f"offload {self.name}")
        t = GroupTransfer(self, "offload", batch, storages, copy, token)
        if engine.is_cuda:
            lane = engine.lanes["d2h"].stream
            if caller_event is not None:
                batch.add(lambda: lane.wait_event(caller_event), "wait for the caller's stream (R1)")
        else:
            lane = None
        chunk = self._config.copy_chunk_bytes
        for i, s in enumerate(storages):
            if copy:
                for host, off, n in _pieces(self.store.views(i), s.nbytes(), chunk):
                    batch.add(functools.partial(_copy_out, host, s, off, n), f"copy {self.name}[{i}] {off}:{off + n}")
            t._release_step[i] = batch.add(functools.partial(t._release, i, lane), f"release {self.name}[{i}]")
        self._released = [(s, s.nbytes()) for s in storages]
        self.offloaded = True
        self._transfer = t
        return t

    def start_onload(self, users: Optional[list[list[tuple[int, int, int]]]] = None,
                     token: Optional[Hashable] = None) -> "GroupTransfer":
        """Submit the regrow and copy back (or zeroing) of the released storages to the h2d lane.

        Args:
            users: Optional use order: ``users[u]`` lists the ``(storage key, first byte, end byte)``
                ranges that user ``u`` (a module) reads, users in the order they run. The copies
                are queued in that order and :meth:`GroupTransfer.user_fence` gives the fence after
                which user ``u`` may read (R4); bytes no user reads follow.
            token: Describes the contents once restored (the host copy's): recorded when the
                onload is settled, so that an offload before any write skips the copy.
        """
        assert self.offloaded, f"{self.name} is not offloaded"
        assert self._transfer is None, f"{self.name} has a transition in flight"
        released = self._released
        batch = Batch("h2d", f"onload {self.name}")
        t = GroupTransfer(self, "onload", batch, [s for s, _ in released], self.keep_contents, token)
        chunk = self._config.copy_chunk_bytes
        index = {storage_key(s): i for i, (s, _) in enumerate(released)}
        order = _use_order(users or [], index, [n for _, n in released])
        pieces_of: dict[int, list[tuple[int, int, int]]] = {}  # storage -> (start, end, step)
        for i, start, end in order:
            s, n = released[i]
            if i not in t._grow_step:
                t._grow_step[i] = batch.add(functools.partial(t._grow, i, n), f"regrow {self.name}[{i}]",
                                            on_caller_stream=True)
            if not self.keep_contents:
                if start == 0 and end == n and n:
                    step = batch.add(functools.partial(_zero, s), f"zero {self.name}[{i}]")
                    pieces_of.setdefault(i, []).append((0, n, step))
                continue
            for host, off, size in _pieces(self.store.views(i), n, chunk, start, end):
                step = batch.add(functools.partial(_copy_in, s, host, off, size), f"copy {self.name}[{i}] "
                                 f"{off}:{off + size}")
                pieces_of.setdefault(i, []).append((off, off + size, step))
        for i, (s, n) in enumerate(released):  # storages of 0 bytes
            if i not in t._grow_step:
                t._grow_step[i] = batch.add(functools.partial(t._grow, i, n), f"regrow {self.name}[{i}]",
                                            on_caller_stream=True)
        t._user_steps = _user_steps(users or [], index, pieces_of, t._grow_step)
        self.offloaded = False
        self._transfer = t
        return t

    def offload(self, storages: list[torch.UntypedStorage], token: Optional[Hashable] = None) -> TransferStats:
        """Copy (if needed) and release ``storages``, and wait (:meth:`start_offload`).

        Raises:
            Whatever the host allocation or a copy raises; then nothing has been released.
        """
        t = self.start_offload(storages, token, CopyEngine.for_device(_device_of(storages)).caller_event())
        return _run_blocking(t)

    def onload(self) -> TransferStats:
        """Reallocate the released storages, restore their contents (or zeros) and wait.

        Raises:
            Whatever a device allocation or copy raises; then every storage grown so far is
            released again, the group stays offloaded and the host copy is untouched.
        """
        return _run_blocking(self.start_onload())

    @property
    def transfer(self) -> Optional["GroupTransfer"]:
        """The transition in flight (submitted, not yet settled), or None."""
        return self._transfer


def _device_of(storages: Iterable[torch.UntypedStorage]) -> torch.device:
    return next((s.device for s in storages), torch.device("cpu"))


def _run_blocking(t: "GroupTransfer") -> TransferStats:
    job = Job()
    t.engine.submit(job, [t.batch])
    job.wait()
    return t.finish()


def _copy_out(host: torch.Tensor, storage: torch.UntypedStorage, off: int, n: int) -> None:
    # CUDA: asynchronous into pinned memory (the lane's event says when it landed); into pageable
    # memory the driver copies synchronously, which is slower but as correct
    host.copy_(_byte_view(storage)[off:off + n], non_blocking=storage.device.type == "cuda")


def _copy_in(storage: torch.UntypedStorage, host: torch.Tensor, off: int, n: int) -> None:
    _byte_view(storage)[off:off + n].copy_(host, non_blocking=storage.device.type == "cuda")


def _zero(storage: torch.UntypedStorage) -> None:
    _byte_view(storage).zero_()


def _pieces(spans: list[tuple[torch.Tensor, int]], nbytes: int, chunk: int, start: int = 0,
            end: Optional[int] = None) -> list[tuple[torch.Tensor, int, int]]:
    """``(host view, storage offset, bytes)`` pieces covering bytes ``[start, end)`` of a storage
    in ascending order, each inside one host span and at most ``chunk`` bytes."""
    end = nbytes if end is None else end
    out = []
    for host, off in spans:
        lo, hi = max(start, off), min(end, off + host.numel())
        while lo < hi:
            n = min(chunk, hi - lo)
            out.append((host[lo - off:lo - off + n], lo, n))
            lo += n
    return out


def _use_order(users: list[list[tuple[int, int, int]]], index: dict[int, int],
               sizes: list[int]) -> list[tuple[int, int, int]]:
    """``(storage index, start, end)`` byte ranges covering every released storage exactly once:
    first the ranges users read, in user order (ranges read earlier are not repeated), then what
    no user reads, per storage in ascending order. Adjacent ranges of one storage that follow each
    other are merged."""
    covered: dict[int, list[tuple[int, int]]] = {}
    order: list[tuple[int, int, int]] = []

    def add(i: int, a: int, b: int) -> None:
        for lo, hi in _subtract((a, b), covered.setdefault(i, [])):
            if order and order[-1][0] == i and order[-1][2] == lo:
                order[-1] = (i, order[-1][1], hi)
            elif order and order[-1][0] == i and order[-1][1] == hi:
                order[-1] = (i, lo, order[-1][2])
            else:
                order.append((i, lo, hi))
            bisect.insort(covered[i], (lo, hi))

    for ranges in users:
        for key, a, b in ranges:
            i = index.get(key)
            if i is not None and a < b:
                add(i, max(0, a), min(sizes[i], b))
    for i, n in enumerate(sizes):
        if n:
            add(i, 0, n)
    return order


def _subtract(r: tuple[int, int], taken: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``r`` outside the sorted, disjoint ranges ``taken``."""
    a, b = r
    out = []
    for lo, hi in taken:
        if hi <= a or lo >= b:
            continue
        if lo > a:
            out.append((a, lo))
        a = max(a, hi)
    if a < b:
        out.append((a, b))
    return out


def _user_steps(users, index, pieces_of, grow_step) -> list[Optional[int]]:
    """For each user, the last step whose bytes it reads (None: it reads nothing of this group)."""
    starts = {i: [p[0] for p in sorted(ps)] for i, ps in pieces_of.items()}
    ordered = {i: sorted(ps) for i, ps in pieces_of.items()}
    out = []
    for ranges in users:
        last = None
        for key, a, b in ranges:
            i = index.get(key)
            if i is None:
                continue
            last = max(last if last is not None else -1, grow_step[i])
            ps = ordered.get(i, [])
            k = max(0, bisect.bisect_right(starts.get(i, []), a) - 1)
            while k < len(ps) and ps[k][0] < b:
                if ps[k][1] > a:
                    last = max(last, ps[k][2])
                k += 1
        out.append(last)
    return out


class GroupTransfer:
    """One group's offload or onload submitted to the copy engine, settled once on the host.

    Created by :meth:`StorageGroup.start_offload` / :meth:`StorageGroup.start_onload`; the caller
    submits :attr:`batch` (``CopyEngine.submit``), waits for its job, then calls :meth:`finish`.
    """

    def __init__(self, group: StorageGroup, direction: str, batch: Batch, storages: list[torch.UntypedStorage],
                 copy: bool, token: Optional[Hashable]):
        self.group, self.direction, self.batch = group, direction, batch
        self.storages = list(storages)
        self.sizes = [s.nbytes() for s in storages] if direction == "offload" else [n for _, n in group._released]
        self.copy, self.token = copy, token
        self.engine = CopyEngine.for_device(_device_of(storages))
        self.released: list[int] = []  # offload: indices released so far (R2: after their copies)
        self.grown: list[int] = []  # onload: indices regrown so far
        self._grow_step: dict[int, int] = {}
        self._release_step: dict[int, int] = {}
        self._user_steps: list[Optional[int]] = []
        self.stats: Optional[TransferStats] = None
        self.error: Optional[BaseException] = None

    # -- lane steps --------------------------------------------------------------------------
    def _release(self, i: int, stream) -> None:
        s = self.storages[i]
        if stream is not None and s.nbytes():
            _byte_view(s).record_stream(stream)  # R2: the allocator waits for the d2h copies
        s.resize_(0)
        self.released.append(i)

    def _grow(self, i: int, nbytes: int) -> None:
        s = self.storages[i]
        _grow_storage(s, nbytes)
        self.grown.append(i)
        if self.group._config.cpu_huge_pages:
            advise_huge_pages(s)

    # -- for the managers ------------------------------------------------------------------------
    def release_steps(self) -> list[tuple[int, int]]:
        """``(storage index, step index)`` of each release step, in order (offload)."""
        return sorted(self._release_step.items(), key=lambda x: x[1])

    def grow_steps(self) -> list[tuple[int, int]]:
        """``(storage index, step index)`` of each regrow step, in order (onload)."""
        return sorted(self._grow_step.items(), key=lambda x: x[1])

    def cancel(self) -> None:
        """Undo :meth:`StorageGroup.start_offload` / ``start_onload`` of a transition that was never
        submitted (nothing ran): the group is back where it was."""
        assert self.batch._lane is None, "cancel() is for a transition that was never submitted"
        group = self.group
        if self.direction == "offload":
            group._released = []
            group.offloaded = False
        else:
            group.offloaded = True
        group._transfer = None

    def user_fence(self, user: int) -> Optional[Fence]:
        """The fence after which user ``user`` of :meth:`StorageGroup.start_onload` may read."""
        step = self._user_steps[user] if user < len(self._user_steps) else None
        return None if step is None else self.batch.fence(step)

    def done(self) -> bool:
        return self.batch.done()

    def finish(self) -> TransferStats:
        """Settle the transition on the host, once its batch is done: record the outcome, or roll
        the group back to where it was (R9) and raise the step's error (with a note saying so).

        Raises:
            The error of the step that failed (or of an earlier step of the same job).
        """
        assert self.batch.done(), f"{self.batch.label} is still running"
        group = self.group
        if self.stats is not None:
            return self.stats
        if self.error is not None:
            raise self.error
        job = self.batch.job
        if self.batch.completed == len(self.batch.steps):
            return self._succeed()  # a later part of the same job may have failed: this one is whole
        error = job.error if job is not None and job.error is not None else TransferError(self.batch.label)
        try:
            note = self._roll_back()
        finally:
            group._transfer = None
        if hasattr(error, "add_note"):
            error.add_note(note)
        self.error = error
        raise error

    def _succeed(self) -> TransferStats:
        group = self.group
        nbytes = sum(self.sizes)
        if self.direction == "offload":
            if self.copy:
                group._host_token = self.token
                group._host_keys = tuple(s._cdata for s in self.storages)
            copied = nbytes if self.copy else 0
        else:
            group._released = []
            copied = nbytes if group.keep_contents else 0
            group.set_host_token(self.token)
        group._transfer = None
        self.stats = TransferStats(group.name, self.direction, nbytes, copied, self.batch.seconds)
        logger.info("%s %s: %.1f MB, %.1f MB copied (%.2f GB/s)", self.direction, group.name,
                    nbytes / 1e6, copied / 1e6, self.stats.gb_per_s)
        return self.stats

    def _roll_back(self) -> str:
        group = self.group
        if self.direction == "onload":
            for i in self.grown:
                self.storages[i].resize_(0)
            group.offloaded = True
            return (f"chatlearn-mem: the onload of {group.name} was rolled back: every storage it regrew "
                    "was released again; the part is still offloaded and its host copy is intact")
        # offload: the storages released so far have complete host copies (R2): bring them back
        restored = []
        try:
            for i in list(self.released):
                s, n = self.storages[i], self.sizes[i]
                _grow_storage(s, n)
                dst = _byte_view(s)
                for host, off in group.store.views(i):
                    dst[off:off + host.numel()].copy_(host)
                restored.append(i)
            _synchronize(_device_of(self.storages))
        except BaseException as e:  # noqa: BLE001 - keep what is still released, offloaded
            left = [i for i in self.released if i not in restored]
            group._released = [(self.storages[i], self.sizes[i]) for i in left]
            group.offloaded = True
            group._host_token = None
            return (f"chatlearn-mem: the offload of {group.name} failed and could not be fully rolled "
                    f"back ({e!r}): {len(left)} storage(s) stay released with complete host copies and the "
                    "part counts as offloaded; call onload() once memory is available")
        group._released = []
        group.offloaded = False
        group._host_token = None
        return (f"chatlearn-mem: the offload of {group.name} was rolled back: every storage it had released "
                "was regrown from its complete host copy; the part is resident")
