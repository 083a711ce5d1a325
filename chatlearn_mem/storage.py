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
import logging
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Hashable, Iterable, Optional

import torch

from chatlearn_mem import device_memory
from chatlearn_mem.config import MemoryConfig
from chatlearn_mem.copy_engine import Batch, CopyEngine, Fence, Job
from chatlearn_mem.device_memory import Block
from chatlearn_mem.errors import TransferError
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


def _grow_storage(
    storage: torch.UntypedStorage, nbytes: int, block: Optional[Block] = None, huge_pages: bool = True
) -> None:
    """Give a released storage its memory again (:func:`device_memory.regrow`). Module-level so
    that tests can inject allocation failures."""
    device_memory.regrow(storage, nbytes, block, huge_pages)


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
        return token is not None and token == self._host_token and tuple(s._cdata for s in storages) == self._host_keys

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
        self.store = HostStore(sizes, self._config.bucket_size_bytes, pin)

    # -- transitions through the copy engine ------------------------------------------------
    def start_offload(
        self, storages: list[torch.UntypedStorage], token: Optional[Hashable] = None, caller_event=None
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
        if _device_of(storages).type != "cuda":
            caller_event = None
        key = ("offload", sizes, copy, id(self.store) if copy else None, caller_event is not None)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _offload_plan(
                sizes, self.store if copy else None, self._config.copy_chunk_bytes, caller_event is not None
            )
        t = GroupTransfer(self, "offload", plan, list(storages), list(sizes), copy, token, caller_event)
        self._released = list(zip(storages, sizes))
        self.offloaded = True
        self._transfer = t
        return t

    def start_onload(
        self, users: Optional[list[list[tuple[int, int, int]]]] = None, token: Optional[Hashable] = None
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
        """
        assert self.offloaded, f"{self.name} is not offloaded"
        assert self._transfer is None, f"{self.name} has a transition in flight"
        storages = [s for s, _ in self._released]
        sizes = tuple(n for _, n in self._released)
        index = {storage_key(s): i for i, s in enumerate(storages)}
        use = tuple(tuple((index[k], a, b) for k, a, b in ranges if k in index) for ranges in users or ())
        key = ("onload", sizes, id(self.store) if self.keep_contents else None, use)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 8:  # sizes or users changed many times: keep the cache small
                self._plans.clear()
            plan = self._plans[key] = _onload_plan(
                sizes, self.store if self.keep_contents else None, self._config.copy_chunk_bytes, use
            )
        t = GroupTransfer(self, "onload", plan, storages, list(sizes), self.keep_contents, token, None)
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


# -- plans: the actions of one group's transition, built once per layout and reused ----------------
# An action is a tuple of ints (nothing for the garbage collector to track):
WAIT, COPY_OUT, RELEASE, GROW, COPY_IN, ZERO = range(6)
#   (WAIT,)                                  CUDA: the d2h stream waits for the caller's event (R1)
#   (COPY_OUT, i, bucket, bucket offset, storage offset, bytes)    device -> host store
#   (RELEASE, i)                             resize storage i to 0 (after its copies, R2)
#   (GROW, i)                                regrow storage i (on the caller's stream on CUDA, R3)
#   (COPY_IN, i, bucket, bucket offset, storage offset, bytes)     host store -> device
#   (ZERO, i)                                zero storage i (grads)


@dataclass(frozen=True)
class _Plan:
    steps: list  # list of lists of actions
    release_step: dict  # storage -> step of its release (offload)
    grow_at: dict  # storage -> (step, action) of its regrow (onload)
    user_steps: tuple  # per user: the last step it reads (onload with users), None if none


class _Packer:
    """Packs actions into steps of at most ``step_bytes`` copied bytes."""

    def __init__(self, step_bytes: int):
        self.step_bytes, self.steps, self.bytes = step_bytes, [], 0

    def add(self, action: tuple, nbytes: int = 0) -> tuple[int, int]:
        if not self.steps or self.bytes + nbytes > self.step_bytes:
            self.steps.append([])
            self.bytes = 0
        self.steps[-1].append(action)
        self.bytes += nbytes
        return len(self.steps) - 1, len(self.steps[-1]) - 1

    def finish(self) -> list:
        """The steps, each step's copies of adjacent bytes (in the storage and in its host bucket)
        merged into one: a step is waited for as a whole, so the order inside it is free, and few
        large copies run faster than many small ones (the weights come in the order the model
        reads them, a buffer laid out in reverse: the pieces of a step are adjacent, descending)."""
        return [_coalesce(step) for step in self.steps]


def _coalesce(step: list) -> list:
    """Merge the step's COPY_OUT / COPY_IN actions that continue one another (same storage, same
    bucket, same offset between the two) into one; every other action keeps its place."""
    copies = [a for a in step if a[0] in (COPY_OUT, COPY_IN)]
    if len(copies) < 2:
        return step
    merged: list[tuple] = []
    for a in sorted(copies, key=lambda a: (a[0], a[1], a[2], a[4])):
        last = merged[-1] if merged else None
        if last is not None and last[:3] == a[:3] and last[4] + last[5] == a[4] and last[3] - last[4] == a[3] - a[4]:
            merged[-1] = (*last[:5], last[5] + a[5])
        else:
            merged.append(a)
    # what must come first (the wait for the caller, the regrows: R1, R3), then the copies, then the
    # releases and zeroings (a release after its storage's copies: R2)
    first = [a for a in step if a[0] in (WAIT, GROW)]
    rest = [a for a in step if a[0] in (RELEASE, ZERO)]
    return first + merged + rest


def _spans(store: HostStore, i: int, start: int, end: int, chunk: int) -> list[tuple[int, int, int, int]]:
    """``(bucket, bucket offset, storage offset, bytes)`` pieces of bytes ``[start, end)`` of storage
    ``i`` in ascending order, each inside one bucket and at most ``chunk`` bytes."""
    out = []
    for span in store.spans[i]:
        lo, hi = max(start, span.storage_offset), min(end, span.storage_offset + span.nbytes)
        while lo < hi:
            n = min(chunk, hi - lo)
            out.append((span.bucket, span.bucket_offset + lo - span.storage_offset, lo, n))
            lo += n
    return out


def _offload_plan(sizes: tuple[int, ...], store: Optional[HostStore], chunk: int, wait: bool) -> _Plan:
    pack = _Packer(chunk)
    if wait:
        pack.add((WAIT,))
    release = {}
    for i, n in enumerate(sizes):
        if store is not None:
            for b, bo, so, size in _spans(store, i, 0, n, chunk):
                pack.add((COPY_OUT, i, b, bo, so, size), size)
        release[i] = pack.add((RELEASE, i))[0]
    return _Plan(pack.finish(), release, {}, ())


def _onload_plan(
    sizes: tuple[int, ...], store: Optional[HostStore], chunk: int, users: tuple[tuple[tuple[int, int, int], ...], ...]
) -> _Plan:
    pack = _Packer(chunk)
    grow_at: dict[int, tuple[int, int]] = {}
    pieces: dict[int, list[tuple[int, int, int]]] = {}  # storage -> (start, end, step)
    for i, start, end in _use_order(users, sizes):
        if i not in grow_at:
            grow_at[i] = pack.add((GROW, i))
        if store is None:
            step = pack.add((ZERO, i), sizes[i])[0]
            pieces.setdefault(i, []).append((0, sizes[i], step))
            continue
        for b, bo, so, size in _spans(store, i, start, end, chunk):
            step = pack.add((COPY_IN, i, b, bo, so, size), size)[0]
            pieces.setdefault(i, []).append((so, so + size, step))
    for i in range(len(sizes)):  # storages of 0 bytes
        if i not in grow_at:
            grow_at[i] = pack.add((GROW, i))
    return _Plan(pack.finish(), {}, grow_at, _user_steps(users, pieces, grow_at))


def _use_order(users, sizes: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """``(storage index, start, end)`` byte ranges covering every storage exactly once: first the
    ranges users read, in user order (ranges read earlier are not repeated), then what no user
    reads, per storage in ascending order. A range that continues the previous one upwards is
    merged with it; one that lies below it is not (megatron lays a buffer out in reverse: merged,
    the first layer's weights would come last)."""
    covered: dict[int, list[tuple[int, int]]] = {}
    order: list[tuple[int, int, int]] = []

    def add(i: int, a: int, b: int) -> None:
        for lo, hi in _subtract((a, b), covered.setdefault(i, [])):
            if order and order[-1][0] == i and order[-1][2] == lo:
                order[-1] = (i, order[-1][1], hi)
            else:
                order.append((i, lo, hi))
            bisect.insort(covered[i], (lo, hi))

    for ranges in users:
        for i, a, b in ranges:
            if a < b:
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


def _user_steps(
    users, pieces: dict[int, list[tuple[int, int, int]]], grow_at: dict[int, tuple[int, int]]
) -> tuple[Optional[int], ...]:
    """For each user, the last step whose bytes it reads (None: it reads nothing of this group)."""
    ordered = {i: sorted(ps) for i, ps in pieces.items()}
    starts = {i: [p[0] for p in ps] for i, ps in ordered.items()}
    out = []
    for ranges in users:
        last = None
        for i, a, b in ranges:
            last = max(-1 if last is None else last, grow_at[i][0])
            ps = ordered.get(i, [])
            k = max(0, bisect.bisect_right(starts.get(i, []), a) - 1)
            while k < len(ps) and ps[k][0] < b:
                if ps[k][1] > a:
                    last = max(last, ps[k][2])
                k += 1
        out.append(last)
    return tuple(out)


class GroupTransfer:
    """One group's offload or onload: the batch a lane runs, and its settling on the host.

    Created by :meth:`StorageGroup.start_offload` / :meth:`StorageGroup.start_onload`; the caller
    submits :attr:`batch` (``CopyEngine.submit``), waits for its job, then calls :meth:`finish`.
    It is also the batch's runner: it runs the plan's actions on its own storages.
    """

    def __init__(
        self,
        group: StorageGroup,
        direction: str,
        plan: _Plan,
        storages: list[torch.UntypedStorage],
        sizes: list[int],
        copy: bool,
        token: Optional[Hashable],
        caller_event,
    ):
        self.group, self.direction, self.plan = group, direction, plan
        self.storages, self.sizes = storages, sizes
        self.copy, self.token = copy, token
        self.engine = CopyEngine.for_device(_device_of(storages))
        self._cuda = self.engine.is_cuda
        self._d2h_stream = self.engine.lanes["d2h"].stream if self._cuda else None
        self._h2d_stream = self.engine.lanes["h2d"].stream if self._cuda else None
        self._caller_event = caller_event
        self._store = group.store
        self._huge_pages = group._config.cpu_huge_pages
        self._lazy = group._config.cpu_release == "lazy"
        self.batch = Batch(
            "d2h" if direction == "offload" else "h2d", f"{direction} {group.name}", steps=plan.steps, runner=self
        )
        self.released: list[int] = []  # offload: indices released so far (R2: after their copies)
        self.grown: list[int] = []  # onload: indices regrown so far
        self.stats: Optional[TransferStats] = None
        self.error: Optional[BaseException] = None

    # -- the runner of the plan's actions (called by the lane) -------------------------------------
    def run(self, a: tuple) -> None:
        op = a[0]
        if op == COPY_OUT:
            _, i, b, bo, so, n = a
            # CUDA: asynchronous into pinned memory (the step's event says when it landed); into
            # pageable memory the driver copies synchronously, slower but as correct
            self._store.buckets[b][bo : bo + n].copy_(
                _byte_view(self.storages[i])[so : so + n], non_blocking=self._cuda
            )
        elif op == COPY_IN:
            _, i, b, bo, so, n = a
            _byte_view(self.storages[i])[so : so + n].copy_(
                self._store.buckets[b][bo : bo + n], non_blocking=self._cuda
            )
        elif op == RELEASE:
            s = self.storages[a[1]]
            if self._cuda and s.nbytes():
                _byte_view(s).record_stream(self._d2h_stream)  # R2: the allocator waits for the d2h copies
            self._release(a[1])
            self.released.append(a[1])
        elif op == GROW:
            i = a[1]
            self._grow(i)
            self.grown.append(i)
            if self._cuda and self.sizes[i]:
                # the block lives in the caller's pool (R3) and the h2d stream writes it: were the
                # storage freed before the copy ran, the allocator must wait for that stream too
                _byte_view(self.storages[i]).record_stream(self._h2d_stream)
        elif op == ZERO:
            _byte_view(self.storages[a[1]]).zero_()
        elif op == WAIT:
            self._d2h_stream.wait_event(self._caller_event)
        else:  # pragma: no cover
            raise AssertionError(f"unknown action {a!r}")

    def _release(self, i: int) -> None:
        """Release storage ``i``; on a CPU device its memory is kept by the group (device_memory)."""
        s = self.storages[i]
        block = device_memory.release(s, lazy=self._lazy)
        if block is not None:
            self.group._parked[storage_key(s)] = block

    def _grow(self, i: int) -> None:
        """Regrow storage ``i``: the memory its release kept, where there is one (CPU)."""
        s = self.storages[i]
        key = storage_key(s)
        group = self.group
        block = group._parked.get(key)
        if block is not None and group._mapped.get(key) != block.address and self._huge_pages:
            block = None  # torch's first allocation (4 KiB pages, maybe): map huge pages instead, once
        _grow_storage(s, self.sizes[i], block, self._huge_pages)
        group._parked.pop(key, None)  # only once grown: a failed regrow keeps the block
        if not self._cuda:
            group._mapped[key] = s.data_ptr()

    def describe(self, a: tuple) -> str:
        op, name = a[0], self.group.name
        if op in (COPY_OUT, COPY_IN):
            return f"copy {name}[{a[1]}] {a[4]}:{a[4] + a[5]}"
        if op == WAIT:
            return "wait for the caller's stream (R1)"
        return f"{('release', 'regrow', '', 'zero')[op - RELEASE]} {name}[{a[1]}]"

    @staticmethod
    def on_caller_stream(a: tuple) -> bool:
        return a[0] == GROW

    # -- for the managers ------------------------------------------------------------------------
    def release_steps(self) -> list[tuple[int, int]]:
        """``(storage index, step index)`` of each release, in order (offload)."""
        return sorted(self.plan.release_step.items(), key=lambda x: x[1])

    def grow_actions(self) -> list[tuple[int, tuple[int, int]]]:
        """``(storage index, (step, action))`` of each regrow, in order (onload)."""
        return sorted(self.plan.grow_at.items(), key=lambda x: x[1])

    def user_fence(self, user: int) -> Optional[Fence]:
        """The fence after which user ``user`` of :meth:`StorageGroup.start_onload` may read."""
        steps = self.plan.user_steps
        if not steps:  # queued without a use order (a blocking onload): every user waits for it all
            return self.batch.fence() if self.batch.steps else None
        step = steps[user] if user < len(steps) else None
        return None if step is None else self.batch.fence(step)

    def done(self) -> bool:
        return self.batch.done()

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

    def finish(self) -> TransferStats:
        """Settle the transition on the host, once its batch is done: record the outcome, or roll
        the group back to where it was (R9) and raise the error (with a note saying so).

        Raises:
            The error of the action that failed (or of an earlier part of the same job).
        """
        assert self.batch.done(), f"{self.batch.label} is still running"
        if self.stats is not None:
            return self.stats
        if self.error is not None:
            raise self.error
        if self.batch.completed == len(self.batch.steps):
            return self._succeed()  # a later part of the same job may have failed: this one is whole
        job = self.batch.job
        error = job.error if job is not None and job.error is not None else TransferError(self.batch.label)
        try:
            note = self._roll_back()
        finally:
            self.group._transfer = None
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
            group._parked.clear()  # every block went back into its storage; nothing else is kept
            copied = nbytes if group.keep_contents else 0
            group.set_host_token(self.token)
        group._transfer = None
        self.stats = TransferStats(group.name, self.direction, nbytes, copied, self.batch.seconds)
        logger.info(
            "%s %s: %.1f MB, %.1f MB copied (%.2f GB/s)",
            self.direction,
            group.name,
            nbytes / 1e6,
            copied / 1e6,
            self.stats.gb_per_s,
        )
        return self.stats

    def _roll_back(self) -> str:
        group = self.group
        if self.direction == "onload":
            for i in self.grown:
                self._release(i)
            group.offloaded = True
            return (
                f"chatlearn-mem: the onload of {group.name} was rolled back: every storage it regrew "
                "was released again; the part is still offloaded and its host copy is intact"
            )
        # offload: the storages released so far have complete host copies (R2): bring them back
        restored = []
        try:
            for i in list(self.released):
                s = self.storages[i]
                self._grow(i)
                dst = _byte_view(s)
                for host, off in group.store.views(i):
                    dst[off : off + host.numel()].copy_(host)
                restored.append(i)
            _synchronize(_device_of(self.storages))
        except BaseException as e:  # noqa: BLE001 - keep what is still released, offloaded
            left = [i for i in self.released if i not in restored]
            group._released = [(self.storages[i], self.sizes[i]) for i in left]
            group.offloaded = True
            group._host_token = None
            return (
                f"chatlearn-mem: the offload of {group.name} failed and could not be fully rolled "
                f"back ({e!r}): {len(left)} storage(s) stay released with complete host copies and the "
                "part counts as offloaded; call onload() once memory is available"
            )
        group._released = []
        group.offloaded = False
        group._host_token = None
        return (
            f"chatlearn-mem: the offload of {group.name} was rolled back: every storage it had released "
            "was regrown from its complete host copy; the part is resident"
        )
