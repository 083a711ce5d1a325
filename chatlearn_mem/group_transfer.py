"""One storage group's offload or onload: its plan of copy steps, and the runner a copy lane calls.

:meth:`StorageGroup.start_offload <chatlearn_mem.storage.StorageGroup.start_offload>` and
``start_onload`` build a :class:`GroupTransfer`; the caller submits its :attr:`~GroupTransfer.batch`
to the :class:`~chatlearn_mem.copy_engine.CopyEngine`, and :meth:`GroupTransfer.finish` settles
the group once the batch is done, or rolls it back to where it was. The plans (which bytes are
copied in which step, where each storage is released or regrown) are built once per layout and
reused.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Hashable, Iterable, Optional, Protocol

import torch

from chatlearn_mem import device_memory
from chatlearn_mem.config import MemoryConfig
from chatlearn_mem.copy_engine import Batch, CopyEngine, Fence, Job
from chatlearn_mem.device_memory import Block, DeviceSlab, Slab, SlabPlacement, storage_id
from chatlearn_mem.errors import TransferError
from chatlearn_mem.host_store import ALIGN, HostStore

__all__ = ["GroupTransfer", "MovedGroup", "TransferStats", "device_of", "offload_plan", "onload_plan"]

logger = logging.getLogger("chatlearn_mem")


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


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
    steps: int = 0  # the lane's steps (one fence each)
    actions: int = 0  # copies, releases, regrows, zeroings... in them: the per-call work of the lane
    host_seconds: float = 0.0  # the host's time running them (CUDA: issuing them; CPU: the copies too)

    @property
    def gb_per_s(self) -> float:
        """Copy throughput in GB/s (0 when nothing was copied)."""
        return self.copied_bytes / self.seconds / 1e9 if self.copied_bytes and self.seconds else 0.0


def device_of(storages: Iterable[torch.UntypedStorage]) -> torch.device:
    """The device of the first storage; the CPU when there is none."""
    return next((s.device for s in storages), torch.device("cpu"))


def _run_blocking(t: "GroupTransfer") -> TransferStats:
    """Submit ``t``'s batch, wait for it and settle the transfer (:meth:`GroupTransfer.run_blocking`)."""
    job = Job()
    t.engine.submit(job, [t.batch])
    job.wait()
    return t.finish()


# -- plans: the actions of one group's transition, built once per layout and reused ----------------
# An action is a tuple of ints (nothing for the garbage collector to track):
WAIT, COPY_OUT, RELEASE, GROW, COPY_IN, ZERO, HAND_BACK = range(7)
#   (WAIT,)                                  CUDA: the d2h stream waits for the caller's event (R1)
#   (COPY_OUT, i, bucket, bucket offset, storage offset, bytes)    device -> host store
#   (RELEASE, i)                             resize storage i to 0 (after its copies, R2)
#   (GROW, i)                                regrow storage i (on the caller's stream on CUDA, R3)
#   (COPY_IN, i, bucket, bucket offset, storage offset, bytes)     host store -> device
#   (ZERO, i)                                zero storage i (grads)
#   (HAND_BACK, lo, hi)                      bytes [lo, hi) of a slab's layout back: a CPU Slab's whole
#                                            pages to the kernel, a DeviceSlab's whole segments to the
#                                            allocator (after the releases of every storage there)
# A group laid out in a slab (device_memory.Slab, DeviceSlab) copies through it: i is SLAB - k for
# segment k and the storage offset is the segment's, so that the copies of consecutive storages
# merge into one (within a segment).
SLAB = -1
_WHOLE = 1 << 62
"""The copy size of a transition no one waits on piece by piece (an offload, an onload without a
use order): each storage's bytes in one copy per host bucket. Split into 64 MiB copies, the bench's
258 MiB weights offload took 35.8-43.6 ms on a 2-core CPU against 30.0-32.1 ms in one piece (three
runs each, alternating; a plain copy of the bytes: 28-30 ms); a release still follows its storage's
copies, and steps still end every ``copy_chunk_bytes`` between storages."""
USER_STEP_DIVISOR = 8
"""An onload with a use order ends a step where a user's bytes end once the step holds
``copy_chunk_bytes // USER_STEP_DIVISOR``: the forward's first modules wait for their own bytes,
not for a whole chunk of the next ones'. Within its first ``copy_chunk_bytes`` the step ends
there once it holds ``copy_chunk_bytes // FIRST_CHUNK_STEP_DIVISOR``: there the forward has done
next to nothing yet and waits for each step whole (the position embeddings of the bench's CPU
trainer, 0.2 MB, waited 2.2 ms for a step carrying 8 MiB of the first layer's weights)."""
CPU_USER_STEP_DIVISOR = 2
""":data:`USER_STEP_DIVISOR` on a CPU device: there a lane is a thread, which after each step
waits for the GIL that the forward's Python holds between its torch calls (about 0.2 ms a step on
a 2-core CPU). The bench's 258 MiB weights onload beside its forward copied in 35.8-37.4 ms in 23
steps (8 MiB), 33.0-33.2 ms in 11 (32 MiB), against about 31 ms for the same schedule with plain
copies (docs/transitions.md, "Where the rest of the CPU gap goes"). On a GPU the caller's thread
queues the steps and nothing waits for a lock between them, so steps stay fine there."""
CPU_SLAB_STEP_MULTIPLIER = 8
"""On a CPU device, the steps of a group laid out in a slab (:class:`~chatlearn_mem.device_memory.Slab`)
hold up to this many times ``copy_chunk_bytes`` when nothing paces them or waits on them piece by
piece (an offload, an onload without a use order; not a swap, whose regrows follow the releases,
R8). A slab's copies merge within a step, so its steps are its copy calls, and each costs a
two-thread copy's fork and join: on a 2-core CPU, the bench's 517 MiB of main weights offloaded in
47.4-48.6 ms in 512 MiB steps against 61.7-63.4 ms in 64 MiB ones, onloaded in 47.4-47.6 against
55.3-60.7 ms, the full offload in 183-184 ms against 195-198 ms (medians of 15, two processes each,
alternating; docs/transitions.md, "Many small storages: one slab")."""
FIRST_CHUNK_STEP_DIVISOR = 64
"""1 MiB steps of the default 64 MiB chunk in the first chunk: a wait of 0.2 ms at a CPU copy's
5 GB/s (20 us on a GPU), about what a step costs the host; at most 64 such steps per onload, so
that a model of many small modules does not take a step per module."""


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
        self.total = 0  # copied bytes in every step so far
        self._cut = False

    def cut(self, min_bytes: int) -> None:
        """End the current step here if it already holds ``min_bytes`` copied bytes."""
        if self.bytes >= min_bytes:
            self._cut = True

    def add(self, action: tuple, nbytes: int = 0) -> tuple[int, int]:
        if not self.steps or self._cut or self.bytes + nbytes > self.step_bytes:
            self.steps.append([])
            self.bytes = 0
            self._cut = False
        self.steps[-1].append(action)
        self.bytes += nbytes
        self.total += nbytes
        return len(self.steps) - 1, len(self.steps[-1]) - 1

    def finish(self) -> list:
        """The steps, each step's copies of adjacent bytes (in the storage and in its host bucket)
        merged into one: a step is waited for as a whole, so the order inside it is free, and few
        large copies run faster than many small ones (the weights come in the order the model
        reads them, a buffer laid out in reverse: the pieces of a step are adjacent, descending)."""
        return [_coalesce(step) for step in self.steps]


def _coalesce(step: list) -> list:
    """Merge the step's COPY_OUT / COPY_IN actions that continue one another (same storage, same
    bucket, same offset between the two) into one; every other action keeps its place. Through a
    slab, copies of different storages merge too, across the alignment padding between them
    (less than ``host_store.ALIGN`` bytes: the slab holds it as the bucket does)."""
    copies = [a for a in step if a[0] in (COPY_OUT, COPY_IN)]
    if len(copies) < 2:
        return step
    merged: list[tuple] = []
    for a in sorted(copies, key=lambda a: (a[0], a[1], a[2], a[4])):
        last = merged[-1] if merged else None
        gap = a[4] - (last[4] + last[5]) if last is not None else -1
        if (
            last is not None
            and last[:3] == a[:3]
            and (gap == 0 or (a[1] <= SLAB and 0 < gap < ALIGN))
            and last[3] - last[4] == a[3] - a[4]
        ):
            merged[-1] = (*last[:5], a[4] + a[5] - last[4])
        else:
            merged.append(a)
    # what must come first (the wait for the caller, the regrows: R1, R3), then the copies, then the
    # releases and zeroings (a release after its storage's copies: R2), then a slab's hand-back
    first = [a for a in step if a[0] in (WAIT, GROW)]
    rest = [a for a in step if a[0] in (RELEASE, ZERO, HAND_BACK)]
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


def _copy(op: int, i: int, b: int, bo: int, so: int, size: int, slab: Optional[SlabPlacement]) -> tuple:
    """A copy action of bytes ``[so, so + size)`` of storage ``i``; through its slab segment when
    the group is laid out in a slab (``slab``: where each storage lies there)."""
    if slab is None:
        return (op, i, b, bo, so, size)
    k = slab.segments[i]
    return (op, SLAB - k, b, bo, slab.offsets[i] - slab.starts[k] + so, size)


def offload_plan(
    sizes: tuple[int, ...],
    store: Optional[HostStore],
    chunk: int,
    wait: bool,
    slab: Optional[SlabPlacement] = None,
) -> _Plan:
    """The steps of an offload. ``slab``: where each storage lies in the group's slab, when every
    storage lives there (copies merge across storages, hand-backs as the releases progress)."""
    pack = _Packer(chunk)
    if wait:
        pack.add((WAIT,))
    release = {}
    for i, n in enumerate(sizes):
        if store is not None:
            for b, bo, so, size in _spans(store, i, 0, n, _WHOLE):
                pack.add(_copy(COPY_OUT, i, b, bo, so, size, slab), size)
        release[i] = pack.add((RELEASE, i))[0]
    if slab is not None:
        _hand_back_per_step(pack.steps, sizes, slab)
    return _Plan(pack.finish(), release, {}, ())


def _hand_back_per_step(steps: list, sizes: tuple[int, ...], slab: SlabPlacement) -> None:
    """End each step of a slab's offload with a ``(HAND_BACK, lo, hi)`` of the slab's bytes that
    no storage still holds once the step's releases ran: from the previous hand-back's end to the
    lowest offset a storage not yet released starts at, rounded down to the slab's unit (a CPU
    slab's huge page; the last one: to the end of the layout). So the memory goes back as the
    copies progress, not only at the end, and a swap that paces its regrows on the releases (R8)
    never holds a released storage's memory beyond the next unit (a DeviceSlab: segment)."""
    offsets, unit = slab.offsets, slab.unit
    order = sorted(range(len(sizes)), key=lambda i: offsets[i])  # storages by offset in the slab
    end = max((offsets[i] + sizes[i] for i in order), default=0)
    released: set[int] = set()
    k, lo = 0, 0
    for step in steps:
        released.update(a[1] for a in step if a[0] == RELEASE)
        while k < len(order) and order[k] in released:
            k += 1
        hi = end if k == len(order) else offsets[order[k]] // unit * unit
        if hi > lo:
            step.append((HAND_BACK, lo, hi))
            lo = hi


def onload_plan(
    sizes: tuple[int, ...],
    store: Optional[HostStore],
    chunk: int,
    users: tuple[tuple[tuple[int, int, int], ...], ...],
    slab: Optional[SlabPlacement] = None,
    user_step_divisor: int = USER_STEP_DIVISOR,
) -> _Plan:
    """The steps of an onload, in the users' order. ``slab``: where each storage lies in the
    group's slab, which every regrow puts it in (copies merge across storages).
    ``user_step_divisor``: past the first chunk a step ends at a user's end once it holds
    ``chunk // user_step_divisor`` bytes (:data:`USER_STEP_DIVISOR`, on a CPU device
    :data:`CPU_USER_STEP_DIVISOR`)."""
    pack = _Packer(chunk)
    grow_at: dict[int, tuple[int, int]] = {}
    pieces: dict[int, list[tuple[int, int, int]]] = {}  # storage -> (start, end, step)
    for i, start, end, new_user in _use_order(users, sizes):
        if new_user:
            # the previous user's bytes end here: so does the step, so that that user waits for
            # its own bytes, not for up to a chunk of the next users' (a step holds at least
            # chunk // user_step_divisor bytes, in the first chunk chunk // FIRST_CHUNK_STEP_DIVISOR,
            # so that small modules share one)
            pack.cut(chunk // (FIRST_CHUNK_STEP_DIVISOR if pack.total < chunk else user_step_divisor))
        if i not in grow_at:
            grow_at[i] = pack.add((GROW, i))
        if store is None:
            step = pack.add((ZERO, i), sizes[i])[0]
            pieces.setdefault(i, []).append((0, sizes[i], step))
            continue
        for b, bo, so, size in _spans(store, i, start, end, chunk if users else _WHOLE):
            step = pack.add(_copy(COPY_IN, i, b, bo, so, size, slab), size)[0]
            pieces.setdefault(i, []).append((so, so + size, step))
    for i in range(len(sizes)):  # storages of 0 bytes
        if i not in grow_at:
            grow_at[i] = pack.add((GROW, i))
    return _Plan(pack.finish(), {}, grow_at, _user_steps(users, pieces, grow_at))


_AFTER_ALL = float("inf")  # sorts after every end of a range starting at the same byte


def _use_order(users, sizes: tuple[int, ...]) -> list[tuple[int, int, int, bool]]:
    """``(storage index, start, end, new user)`` byte ranges covering every storage exactly once:
    first the ranges users read, in user order (ranges read earlier are not repeated), then what
    no user reads, per storage in ascending order. ``new user`` marks the first range after
    another user's (or after the last user's: the unread rest). A range that continues the
    previous one upwards is merged with it; one that lies below it is not (megatron lays a buffer
    out in reverse: merged, the first layer's weights would come last)."""
    covered: dict[int, list[tuple[int, int]]] = {}
    order: list[tuple[int, int, int, bool]] = []

    def add(i: int, a: int, b: int, new_user: bool) -> bool:
        for lo, hi in _subtract((a, b), covered.setdefault(i, [])):
            if order and order[-1][0] == i and order[-1][2] == lo:
                order[-1] = (i, order[-1][1], hi, order[-1][3])
            else:
                order.append((i, lo, hi, new_user and bool(order)))
            new_user = False
            _cover(covered[i], lo, hi)
        return new_user

    for ranges in users:
        new_user = True
        for i, a, b in ranges:
            if a < b:
                new_user = add(i, max(0, a), min(sizes[i], b), new_user)
    new_user = True
    for i, n in enumerate(sizes):
        if n:
            new_user = add(i, 0, n, new_user)
    return order


def _cover(taken: list[tuple[int, int]], lo: int, hi: int) -> None:
    """Add ``[lo, hi)``, disjoint from the sorted ranges ``taken``, merging it with the ranges it
    touches: a buffer read in order (or in reverse) stays one range, not one per parameter."""
    k = bisect.bisect_left(taken, (lo, hi))
    if k > 0 and taken[k - 1][1] == lo:
        k -= 1
        lo = taken.pop(k)[0]
    if k < len(taken) and taken[k][0] == hi:
        hi = taken.pop(k)[1]
    taken.insert(k, (lo, hi))


def _subtract(r: tuple[int, int], taken: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``r`` outside the sorted, disjoint ranges ``taken``. Visits only the ranges
    that can overlap ``r`` (found by bisection): a buffer of n parameters costs O(n log n) per
    onload, not O(n^2) (12800 of them took 1.7 s a call)."""
    a, b = r
    out = []
    k = max(0, bisect.bisect_right(taken, (a, _AFTER_ALL)) - 1)  # the last range starting at or before a
    for k in range(k, len(taken)):
        lo, hi = taken[k]
        if lo >= b:
            break
        if hi <= a:
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


class MovedGroup(Protocol):
    """The group a :class:`GroupTransfer` moves, as the transfer sees it
    (:class:`~chatlearn_mem.storage.StorageGroup`): what it reads, and what it reports back."""

    name: str
    keep_contents: bool
    store: Optional[HostStore]

    @property
    def config(self) -> MemoryConfig: ...

    # a CPU release keeps the storage's memory in the group, so that its regrow needs no allocation
    def park(self, key: int, block: Block) -> None: ...
    def parked(self, key: int, huge_pages: bool) -> Optional[Block]: ...
    def regrown(self, key: int, address: Optional[int]) -> None: ...

    # the group's state changes only through these, once the batch is done (or never submitted)
    def transfer_cancelled(self, direction: str) -> None: ...
    def transfer_succeeded(
        self, direction: str, storages: list[torch.UntypedStorage], copied: bool, token: Optional[Hashable]
    ) -> None: ...
    def onload_rolled_back(self) -> None: ...
    def offload_rolled_back(self, still_released: list[tuple[torch.UntypedStorage, int]], offloaded: bool) -> None: ...
    def transfer_ended(self) -> None: ...


class GroupTransfer:
    """One group's offload or onload: the batch a lane runs, and its settling on the host.

    Created by :meth:`StorageGroup.start_offload` / :meth:`StorageGroup.start_onload`; the caller
    submits :attr:`batch` (``CopyEngine.submit``), waits for its job, then calls :meth:`finish`.
    It is also the batch's runner: it runs the plan's actions on its own storages.
    """

    def __init__(
        self,
        group: MovedGroup,
        direction: str,
        plan: _Plan,
        storages: list[torch.UntypedStorage],
        sizes: list[int],
        copy: bool,
        token: Optional[Hashable],
        caller_event,
        slab: Optional[tuple[Slab | DeviceSlab, SlabPlacement]] = None,
    ):
        self.group, self.direction, self.plan = group, direction, plan
        self.storages, self.sizes = storages, sizes
        self.copy, self.token = copy, token
        self.engine = CopyEngine.for_device(device_of(storages))
        self._cuda = self.engine.is_cuda
        self._d2h_stream = self.engine.lanes["d2h"].stream if self._cuda else None
        self._h2d_stream = self.engine.lanes["h2d"].stream if self._cuda else None
        self._caller_event = caller_event
        self._store = group.store
        self._huge_pages = group.config.cpu_huge_pages
        self._lazy = group.config.cpu_release == "lazy"
        # the group's slab and where each storage lies in it, when the plan copies through it
        self._slab, self._placement = slab if slab is not None else (None, None)
        # a DeviceSlab: device memory comes and goes by segments (the first regrow into one, the
        # hand-back after its last release), not by storages; a released storage's piece is dropped
        self._by_segments = self._slab is not None and not self._slab.keeps_released
        # a slab's storages need no stream record of their own: its segments have one (DeviceSlab)
        self._record = self._cuda and self._slab is None
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
            self._store.buckets[b][bo : bo + n].copy_(self._device_bytes(i)[so : so + n], non_blocking=self._cuda)
        elif op == COPY_IN:
            _, i, b, bo, so, n = a
            self._device_bytes(i)[so : so + n].copy_(self._store.buckets[b][bo : bo + n], non_blocking=self._cuda)
        elif op == RELEASE:
            s = self.storages[a[1]]
            if self._record and s.nbytes():
                _byte_view(s).record_stream(self._d2h_stream)  # R2: the allocator waits for the d2h copies
            self._release(a[1])
            self.released.append(a[1])
        elif op == GROW:
            i = a[1]
            self._grow(i)
            self.grown.append(i)
            if self._record and self.sizes[i]:
                # the block lives in the caller's pool (R3) and the h2d stream writes it: were the
                # storage freed before the copy ran, the allocator must wait for that stream too
                _byte_view(self.storages[i]).record_stream(self._h2d_stream)
        elif op == ZERO:
            _byte_view(self.storages[a[1]]).zero_()
        elif op == WAIT:
            self._d2h_stream.wait_event(self._caller_event)
        elif op == HAND_BACK:
            self._slab.hand_back(self._lazy, a[1], a[2])
        else:  # pragma: no cover
            raise AssertionError(f"unknown action {a!r}")

    def _device_bytes(self, i: int) -> torch.Tensor:
        """The bytes a copy action reads or writes on the device: storage ``i``'s, or the slab's."""
        return self._slab.segment(SLAB - i) if i <= SLAB else _byte_view(self.storages[i])

    def _release(self, i: int) -> None:
        """Release storage ``i``; on a CPU device its memory is kept by the group (device_memory).
        In a slab its pages are handed back once, by the plan's last action."""
        s = self.storages[i]
        block = device_memory.release(s, lazy=self._lazy, advise=self._slab is None, keep=not self._by_segments)
        if block is not None:
            self.group.park(storage_id(s), block)

    def _grow(self, i: int) -> None:
        """Regrow storage ``i``: the memory its release kept, where there is one (CPU); in a slab,
        its piece of the slab (the first time, instead of the memory it had)."""
        s = self.storages[i]
        key = storage_id(s)
        if self._slab is None:
            block = self.group.parked(key, self._huge_pages)
        elif self._by_segments:  # a DeviceSlab: a piece of a segment, every time
            block = self._slab.block(self._placement.offsets[i], self.sizes[i]) if self.sizes[i] else None
        else:
            block = self.group.parked(key, False)
            offset = self._placement.offsets[i]
            if self.sizes[i] and (block is None or block.address != self._slab.address + offset):
                block = self._slab.block(offset, self.sizes[i])
        _grow_storage(s, self.sizes[i], block, self._huge_pages)
        self.group.regrown(key, None if self._cuda else s.data_ptr())

    def describe(self, a: tuple) -> str:
        op, name = a[0], self.group.name
        if op in (COPY_OUT, COPY_IN) and a[1] <= SLAB:
            place = self._placement
            lo = place.starts[SLAB - a[1]] + a[4]
            hi = lo + a[5]
            covered = [i for i, off in enumerate(place.offsets) if off < hi and lo < off + self.sizes[i]]
            which = f"{covered[0]}" if len(covered) == 1 else f"{covered[0]}..{covered[-1]}" if covered else ""
            return f"copy {name}[{which}] slab {lo}:{hi}"
        if op in (COPY_OUT, COPY_IN):
            return f"copy {name}[{a[1]}] {a[4]}:{a[4] + a[5]}"
        if op == WAIT:
            return "wait for the caller's stream (R1)"
        if op == HAND_BACK:
            return f"hand {name}'s slab pages {a[1]}:{a[2]} back"
        return f"{('release', 'regrow', '', 'zero')[op - RELEASE]} {name}[{a[1]}]"

    @staticmethod
    def on_caller_stream(a: tuple) -> bool:
        return a[0] == GROW

    # -- for the managers ------------------------------------------------------------------------
    def release_steps(self) -> list[tuple[int, int]]:
        """``(step index, device bytes freed by it)`` in order (offload): each storage's release, or
        with a DeviceSlab each hand-back of the segments whose storages are all released."""
        if not self._by_segments:
            return sorted(((step, self.sizes[i]) for i, step in self.plan.release_step.items()), key=lambda x: x[0])
        slab = self._slab
        return [
            (k, slab.nbytes_ending_in(a[1], a[2]))
            for k, step in enumerate(self.plan.steps)
            for a in step
            if a[0] == HAND_BACK
        ]

    def grow_actions(self) -> list[tuple[tuple[int, int], int]]:
        """``((step, action), device bytes it allocates)`` of each regrow that allocates, in order
        (onload): each storage's, or with a DeviceSlab the first regrow into each segment."""
        order = sorted(self.plan.grow_at.items(), key=lambda x: x[1])
        if not self._by_segments:
            return [(where, self.sizes[i]) for i, where in order]
        seen: set[int] = set()
        out = []
        for i, where in order:
            k = self._placement.segments[i]
            if self.sizes[i] and k not in seen:
                seen.add(k)
                out.append((where, self._slab.segment_nbytes(k)))
        return out

    def user_fence(self, user: int) -> Optional[Fence]:
        """The fence after which user ``user`` of :meth:`StorageGroup.start_onload` may read."""
        steps = self.plan.user_steps
        if not steps:  # queued without a use order (a blocking onload): every user waits for it all
            return self.batch.fence() if self.batch.steps else None
        step = steps[user] if user < len(steps) else None
        return None if step is None else self.batch.fence(step)

    def done(self) -> bool:
        return self.batch.done()

    def run_blocking(self) -> TransferStats:
        """Submit the batch, wait for it and :meth:`finish` (a blocking offload or onload)."""
        return _run_blocking(self)

    def cancel(self) -> None:
        """Undo :meth:`StorageGroup.start_offload` / ``start_onload`` of a transition that was never
        submitted (nothing ran): the group is back where it was."""
        assert not self.batch.submitted, "cancel() is for a transition that was never submitted"
        self.group.transfer_cancelled(self.direction)

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
            self.group.transfer_ended()
        if hasattr(error, "add_note"):
            error.add_note(note)
        self.error = error
        raise error

    def _succeed(self) -> TransferStats:
        group = self.group
        nbytes = sum(self.sizes)
        if self.direction == "offload":
            copied = nbytes if self.copy else 0
        else:
            copied = nbytes if group.keep_contents else 0
        group.transfer_succeeded(self.direction, self.storages, self.copy, self.token)
        self.stats = TransferStats(
            group.name,
            self.direction,
            nbytes,
            copied,
            self.batch.seconds,
            steps=len(self.batch.steps),
            actions=sum(len(s) for s in self.batch.steps),
            host_seconds=self.batch.host_seconds,
        )
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
            if self._by_segments:
                self._slab.hand_back(self._lazy)  # a DeviceSlab's segments: nothing holds a piece now
            group.onload_rolled_back()
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
            _synchronize(device_of(self.storages))
        except BaseException as e:  # noqa: BLE001 - keep what is still released, offloaded
            left = [i for i in self.released if i not in restored]
            group.offload_rolled_back([(self.storages[i], self.sizes[i]) for i in left], offloaded=True)
            return (
                f"chatlearn-mem: the offload of {group.name} failed and could not be fully rolled "
                f"back ({e!r}): {len(left)} storage(s) stay released with complete host copies and the "
                "part counts as offloaded; call onload() once memory is available"
            )
        group.offload_rolled_back([], offloaded=False)
        return (
            f"chatlearn-mem: the offload of {group.name} was rolled back: every storage it had released "
            "was regrown from its complete host copy; the part is resident"
        )
