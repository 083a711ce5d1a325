"""Release a storage's memory and grow it back in place, on each kind of device.

Every view of a storage survives both: the storage object stays, only its memory changes.

* **CUDA.** ``resize_(0)`` gives the block back to torch's caching allocator (the manager then
  returns it to the driver, ``MemoryConfig.empty_cache``) and ``resize_(n)`` takes one again. A
  part made of many storages can instead live in a :class:`DeviceSlab`
  (``MemoryConfig.cuda_contiguous``): a few large allocations, one per segment of consecutive
  storages, given back as the offload releases the last storage of each.
* **CPU** (megatron-core on :mod:`chatlearn_mem.cpu_backend`, or an inference model on the CPU).
  The storage's memory is moved out whole into a :class:`Block` (``UntypedStorage._swap_data_ptr_``:
  no allocation, no copy), which the storage's group keeps while the part is offloaded and moves
  back in on onload. While it is kept, its pages are handed back to the kernel
  (``MemoryConfig.cpu_release``):

  - ``"lazy"`` (default): ``madvise(MADV_FREE)`` over the storage's whole 2 MiB pages (a partial
    one would split a transparent huge page; what lies outside them, and storages under 2 MiB,
    stay as they are). The kernel takes the pages as soon as anything on the machine needs
    memory, and they count as available memory (``MemAvailable``, cgroup reclaim) from the
    release on. Until it takes them they still appear in the process's RSS
    (as ``LazyFree`` in ``/proc/PID/smaps_rollup``), and an onload that finds them there writes
    into them with no page fault: a copy at the speed of a copy into memory allocated once.
  - ``"eager"``: ``madvise(MADV_DONTNEED)``. RSS falls at once; the onload's first touch of each
    page takes a page fault and the kernel zeroes the page, as for any fresh memory.

  A storage with no kept block gets fresh memory from torch's allocator, with transparent huge
  pages advised over it before its first touch (``cpu_huge_pages``); the manager gives each
  storage such memory at its first onload and keeps moving that same memory out and back from
  then on. The C heap sees no free and no malloc per cycle, so training's own allocations
  between cycles cannot fragment it.

  A part made of many storages (``MemoryConfig.cpu_contiguous``) gets one :class:`Slab` instead:
  at their first onload its storages move into one mapping, at the offsets of the part's host
  store, so that one copy moves many of them and one ``madvise`` hands all their pages back.

Why not ``resize_`` on the CPU as on CUDA: ``resize_(0)`` hands the memory to glibc's ``free``,
which unmaps large blocks (every regrow then faults in fresh, zeroed pages: measured 1.7-2.5x a
plain copy, with a slow tail of 10x when the kernel has to find the pages) and, once its dynamic
mmap threshold has risen, keeps smaller ones on its heap, where the regrows interleave with
training's allocations and the heap grows without end (about 0.3 MiB per cycle, measured).

Where ``_swap_data_ptr_`` does not exist (torch releases before it), the CPU falls back to
``resize_`` and the huge page advice.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import mmap
import operator
import sys
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torch.utils.dlpack import to_dlpack

from chatlearn_mem.errors import ConfigError

_from_dlpack = torch._C._from_dlpack  # a capsule to a tensor (torch.from_dlpack's own path for one)

__all__ = [
    "Block",
    "DeviceSlab",
    "Slab",
    "SlabPlacement",
    "advise_huge_pages",
    "check_device_slab",
    "own_memory",
    "parks_cpu_memory",
    "regrow",
    "release",
    "storage_id",
    "storage_key",
    "trim_host_heap",
]

_PAGE = mmap.PAGESIZE
HUGE_PAGE = 2 * 2**20
"""A transparent huge page (x86-64, arm64 with 4 KiB pages): a :class:`Slab` starts on one, and a
lazy hand-back gives back whole ones only."""
_MADV_DONTNEED = 4  # linux/mman.h
_MADV_FREE = 8
_MADV_HUGEPAGE = 14
_libc_functions: dict = {}  # name -> resolved libc function, or False when unavailable


_CPU = torch.device("cpu")


def _on_cpu(storage: torch.UntypedStorage) -> bool:
    """Whether ``storage`` is a CPU storage (a device comparison: ``storage.device.type`` costs
    several times as much, and this runs once per storage of every transition)."""
    device = storage.device
    return device == _CPU or device.type == "cpu"


storage_id = operator.attrgetter("_cdata")
"""``storage_id(storage)``: :func:`storage_key` of an ``UntypedStorage``, without the test for a
tensor (the loops over every storage or tensor of a part, every call, take it)."""


def storage_key(t: torch.Tensor | torch.UntypedStorage) -> int:
    """Identity of the storage object behind a tensor (stable while it is resized)."""
    return storage_id(t.untyped_storage() if isinstance(t, torch.Tensor) else t)


def _libc_function(name: str, argtypes: list, restype=ctypes.c_int):
    """The C library's ``name`` with its signature set, resolved once; False where there is none
    (another C library, another system)."""
    fn = _libc_functions.get(name)
    if fn is None:
        try:
            fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True), name)
            fn.argtypes, fn.restype = argtypes, restype
        except (OSError, AttributeError):
            fn = False
        _libc_functions[name] = fn
    return fn


def _libc_madvise(address: int, length: int, advice: int) -> int:
    """``madvise(2)`` through libc; returns its result (0 on success, -1 when unavailable)."""
    fn = _libc_function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])
    return fn(address, length, advice) if fn else -1


def advise_huge_pages(storage: torch.UntypedStorage) -> bool:
    """Ask Linux to back the 2 MiB-aligned interior of a CPU storage with transparent huge pages.

    Call it before anything touches the memory: the first write then faults in 2 MiB pages
    instead of 4 KiB ones (512x fewer page faults). Only the aligned range inside the storage is
    advised, so no neighbouring allocation is affected. Returns whether a range was advised;
    storages under 4 MiB, non-CPU storages and non-Linux systems are left alone.
    """
    n = storage.nbytes()
    if n < 2 * HUGE_PAGE or not _on_cpu(storage) or not sys.platform.startswith("linux"):
        return False
    ptr = storage.data_ptr()
    lo = -(-ptr // HUGE_PAGE) * HUGE_PAGE
    hi = (ptr + n) // HUGE_PAGE * HUGE_PAGE
    if hi <= lo:
        return False
    return _libc_madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0


def parks_cpu_memory() -> bool:
    """Whether this torch can move a storage's memory out and back (``UntypedStorage._swap_data_ptr_``;
    else a CPU storage is released by ``resize_``, and no :class:`DeviceSlab` can be laid out)."""
    return hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def check_device_slab(cuda_contiguous: bool, device: torch.device) -> None:
    """Refuse ``MemoryConfig.cuda_contiguous`` for a manager on a CUDA ``device`` when this torch
    cannot put a storage in a :class:`DeviceSlab`'s piece (:func:`parks_cpu_memory`): without the
    refusal the option would do nothing, silently.

    Raises:
        ConfigError: saying which torch lacks what, and the two ways out.
    """
    if cuda_contiguous and torch.device(device).type == "cuda" and not parks_cpu_memory():
        raise ConfigError(
            f"cuda_contiguous=True needs torch.UntypedStorage._swap_data_ptr_, which this torch "
            f"({torch.__version__}) lacks: install a torch that has it (2.13 does; 2.11 does not) or "
            "set MemoryConfig(cuda_contiguous=False)"
        )


@dataclass
class Block:
    """The memory of one released CPU storage, kept while the storage is offloaded.

    Attributes:
        holder: A storage that owns the memory now (dropping it frees the memory).
        nbytes: Its size in bytes.
        address: Where the memory starts (the storage's ``data_ptr()`` before the release).
    """

    holder: torch.UntypedStorage
    nbytes: int
    address: int


def _pages_inside(ptr: int, nbytes: int, unit: int) -> tuple[int, int]:
    """``(address, length)`` of the whole ``unit``-aligned pages inside ``[ptr, ptr + nbytes)``.
    Nothing else lives there: an allocator's chunk headers lie before ``ptr`` or from
    ``ptr + nbytes`` on, and a page shared with a neighbour is not whole."""
    lo = -(-ptr // unit) * unit
    hi = (ptr + nbytes) // unit * unit
    return lo, max(0, hi - lo)


def release(
    storage: torch.UntypedStorage, lazy: bool = True, advise: bool = True, keep: bool = True
) -> Optional[Block]:
    """Release ``storage``'s memory; every view of it stays valid (and empty).

    Args:
        storage: A resident storage (CPU or CUDA). On CUDA the caller has already made the
            allocator wait for the streams that still use it (``record_stream``).
        lazy: CPU only: hand the pages back with ``MADV_FREE`` (True) or ``MADV_DONTNEED``.
        advise: CPU only: hand the pages back now. False for a storage in a :class:`Slab`, whose
            pages :meth:`Slab.hand_back` hands back at once once every storage in it is released.
        keep: CPU only: keep the memory in a :class:`Block` for :func:`regrow`. False drops it
            (a piece of a :class:`DeviceSlab`, whose segment goes once no storage holds a piece).

    Returns:
        CPU (with :func:`parks_cpu_memory`, ``keep``): the :class:`Block` now holding the memory;
        keep it and pass it to :func:`regrow`, or drop it to free the memory. Otherwise None.
    """
    n = storage.nbytes()
    if n and parks_cpu_memory() and (not keep or not (storage.resizable() or _on_cpu(storage))):
        # memory it cannot resize (a DeviceSlab's piece), or memory not to keep: out, and dropped
        storage._swap_data_ptr_(torch.UntypedStorage(0, device=storage.device))
        return None
    if n == 0 or not _on_cpu(storage) or not parks_cpu_memory():
        storage.resize_(0)
        return None
    holder = torch.UntypedStorage(0)
    storage._swap_data_ptr_(holder)  # storage: empty; holder: the memory and its deleter
    if advise:
        _hand_back(holder.data_ptr(), n, lazy)
    return Block(holder, n, holder.data_ptr())


def _hand_back(address: int, nbytes: int, lazy: bool) -> bool:
    """``MADV_FREE`` (lazy) or ``MADV_DONTNEED`` over the whole pages of ``[address, address + nbytes)``;
    whether the kernel took the advice (False elsewhere than on Linux, or with no whole page)."""
    if not sys.platform.startswith("linux"):
        return False
    # lazy: whole 2 MiB pages only. MADV_FREE over part of a transparent huge page splits it
    # into 4 KiB pages, and copies into split pages ran 1.5-2x slower, cycle after cycle
    # (measured on a 135 M-parameter trainer's optimizer states: 4.9 against 8.5 GB/s)
    addr, length = _pages_inside(address, nbytes, HUGE_PAGE if lazy else _PAGE)
    return bool(length) and _libc_madvise(addr, length, _MADV_FREE if lazy else _MADV_DONTNEED) == 0


@dataclass(frozen=True)
class SlabPlacement:
    """Where each storage of a group lies in its slab, for the plans of its transitions.

    Attributes:
        offsets: Each storage's start in the layout (the host store's ``flat_offsets``).
        segments: Each storage's segment: the allocation it lies in (a :class:`Slab` has one).
        starts: Each segment's start in the layout.
        unit: A hand-back covers whole units of the layout: a CPU :class:`Slab`'s huge pages, a
            :class:`DeviceSlab`'s bytes (it frees whole segments).
    """

    offsets: tuple[int, ...]
    segments: tuple[int, ...]
    starts: tuple[int, ...]
    unit: int

    @staticmethod
    def one(offsets: tuple[int, ...], unit: int) -> "SlabPlacement":
        """Every storage in one segment starting at 0."""
        return SlabPlacement(tuple(offsets), (0,) * len(offsets), (0,), unit)


class Slab:
    """One anonymous CPU mapping that holds several storages at fixed offsets.

    A group of many small storages (a trainer's fp32 main weights and optimizer states: hundreds
    of storages of a few MiB) is laid out here in the order and at the offsets of its host store,
    so that the bytes of consecutive storages are consecutive in both and one copy moves many of
    them (on a CPU, a copy of a few MiB runs well below the speed of a large one: see
    docs/transitions.md), and one ``madvise`` hands all their pages back.

    Each storage's memory is a piece of the mapping (:meth:`block`), which keeps the mapping
    alive: the memory goes back to the OS once no storage and no kept block uses any of it. A
    storage holding such a piece cannot be resized (``resize_`` raises): only groups whose
    storages nothing else resizes are laid out here.

    Args:
        nbytes: Bytes of the layout.
        huge_pages: Advise transparent huge pages over the mapping before anything touches it.
    """

    def __init__(self, nbytes: int, huge_pages: bool):
        self.nbytes = int(nbytes)
        # private: a shared anonymous mapping (Python's default) is shmem, where MADV_FREE fails and
        # transparent huge pages are off on most systems; the 2 MiB-aligned start lies inside
        self._map = mmap.mmap(-1, self.nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = torch.frombuffer(self._map, dtype=torch.uint8, count=1).data_ptr()
        self._start = -base % HUGE_PAGE
        self.address = base + self._start
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8, count=self.nbytes, offset=self._start)
        if huge_pages and sys.platform.startswith("linux") and self.nbytes >= HUGE_PAGE:
            _libc_madvise(self.address, self.nbytes // HUGE_PAGE * HUGE_PAGE, _MADV_HUGEPAGE)

    keeps_released = True
    """A released storage's piece is kept (parked by its group) and moved back in by the onload."""

    def placement(self, offsets: tuple[int, ...]) -> SlabPlacement:
        """The storages at ``offsets``, all in the one mapping; hand-backs in whole huge pages."""
        return SlabPlacement.one(offsets, HUGE_PAGE)

    def segment(self, k: int) -> torch.Tensor:
        """The bytes of segment ``k`` (the whole mapping: a slab has one)."""
        assert k == 0, k
        return self.tensor

    def block(self, offset: int, nbytes: int) -> Block:
        """The memory ``[offset, offset + nbytes)`` of the slab, as a :class:`Block` to regrow a storage into."""
        assert 0 <= offset and offset + nbytes <= self.nbytes, (offset, nbytes, self.nbytes)
        holder = torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=self._start + offset)
        return Block(holder.untyped_storage(), nbytes, self.address + offset)

    def holds_all(self, storages: Iterable[torch.UntypedStorage], offsets: Iterable[int]) -> bool:
        """Whether each non-empty storage's memory is the slab's at its offset (one loop: this
        runs over every storage of a part before every offload)."""
        base, end = self.address, self.nbytes
        for s, off in zip(storages, offsets):
            n = s.nbytes()
            if n and (s.data_ptr() != base + off or off + n > end):
                return False
        return True

    def hand_back(self, lazy: bool, start: int = 0, end: Optional[int] = None) -> bool:
        """Hand the whole pages of bytes ``[start, end)`` of the slab (default: all of it) to the
        kernel (see :func:`release`); call it only once every storage there is released. Returns
        whether the kernel took the advice."""
        end = self.nbytes if end is None else min(end, self.nbytes)
        return end > start and _hand_back(self.address + start, end - start, lazy)


class DeviceSlab:
    """A part's storages laid out in a few large allocations ("segments") of torch's allocator on
    their device, at the offsets of the part's host store.

    What a :class:`Slab` does for a CPU device, for any device (CUDA above all): consecutive
    storages are consecutive in memory, so one copy per step moves many of them, and one
    allocation per segment replaces one per storage. A segment holds at least ``segment_bytes``
    of consecutive storages (a larger storage gets one of its own) and starts at a storage.

    Lifetime. Each storage in a segment holds a piece of it, a storage of exactly its bytes that
    keeps the whole segment alive (through DLPack: the piece's deleter holds the segment), so no
    storage can ever point into freed memory. The slab holds each segment from its allocation
    (the onload's first regrow into it) until :meth:`hand_back` drops it (the offload, once every
    storage in it is released); the memory then goes back to the allocator with the last piece.
    A released storage's piece is dropped at once (:attr:`keeps_released` False): the onload
    allocates the segments anew.

    Streams (CUDA). A segment is allocated on the calling thread's current stream (the caller's,
    R3) and recorded on ``streams`` (the copy lanes'), so that the allocator reuses its memory only
    once the copies queued on them before the free are done (R2).

    Args:
        offsets: Each storage's start in the layout (``HostStore.flat_offsets``).
        sizes: Each storage's bytes.
        segment_bytes: Least bytes of a segment (the last one may hold less).
        device: Where to allocate.
        streams: CUDA streams that read or write the segments.
    """

    keeps_released = False

    def __init__(
        self,
        offsets: tuple[int, ...],
        sizes: tuple[int, ...],
        segment_bytes: int,
        device: torch.device,
        streams: tuple = (),
    ):
        # the layout ends where its last storage does (where an offload's last hand-back ends)
        self.nbytes = max((off + n for off, n in zip(offsets, sizes)), default=0)
        self.device, self._streams = device, tuple(streams)
        starts: list[int] = []
        for off, n in sorted(zip(offsets, sizes)):
            if n and (not starts or off - starts[-1] >= segment_bytes):
                starts.append(off)
        starts = starts or [0]
        starts[0] = 0
        self.starts = tuple(starts)
        segments = tuple(max(0, bisect.bisect_right(starts, off) - 1) for off in offsets)
        self._placement = SlabPlacement(tuple(offsets), segments, self.starts, 1)
        self._segments: list[Optional[torch.Tensor]] = [None] * len(starts)

    def placement(self, offsets: tuple[int, ...]) -> SlabPlacement:
        """Where each storage lies (``offsets``: the ones the slab was laid out for)."""
        assert tuple(offsets) == self._placement.offsets, "the layout changed: lay out a new DeviceSlab"
        return self._placement

    def _end(self, k: int) -> int:
        return self.starts[k + 1] if k + 1 < len(self.starts) else self.nbytes

    def segment_nbytes(self, k: int) -> int:
        """Bytes of segment ``k``."""
        return self._end(k) - self.starts[k]

    def nbytes_ending_in(self, start: int, end: int) -> int:
        """Bytes of the segments :meth:`hand_back` drops for ``(start, end]``."""
        return sum(self.segment_nbytes(k) for k in range(len(self.starts)) if start < self._end(k) <= end)

    def segment(self, k: int) -> torch.Tensor:
        """The bytes of segment ``k`` (allocated)."""
        seg = self._segments[k]
        assert seg is not None, f"segment {k} of the slab is not allocated"
        return seg

    @property
    def allocated(self) -> int:
        """Bytes of the segments allocated now."""
        return sum(self.segment_nbytes(k) for k, seg in enumerate(self._segments) if seg is not None)

    def block(self, offset: int, nbytes: int) -> Block:
        """A piece ``[offset, offset + nbytes)`` of the layout, as a :class:`Block` to regrow a
        storage into; allocates its segment first when it has none (on the current stream)."""
        k = bisect.bisect_right(self.starts, offset) - 1
        rel = offset - self.starts[k]
        seg = self._segments[k]
        if seg is None:
            seg = torch.empty(self.segment_nbytes(k), dtype=torch.uint8, device=self.device)
            for stream in self._streams:
                seg.record_stream(stream)
            self._segments[k] = seg
        # internal plumbing on plain tensors: past any torch function mode (a CPU backend's costs
        # about 3 us a call, three times the calls themselves)
        with torch._C.DisableTorchFunction():  # one per call: it keeps the state it restores
            view = seg[rel : rel + nbytes]
            assert view.numel() == nbytes, (offset, nbytes)  # inside its segment
            piece = _from_dlpack(to_dlpack(view)).untyped_storage()  # holds the segment (its deleter)
            return Block(piece, nbytes, seg.data_ptr() + rel)

    def holds_all(self, storages: Iterable[torch.UntypedStorage], offsets: Iterable[int]) -> bool:
        """Whether each non-empty storage's memory is its piece of an allocated segment."""
        place, segs = self._placement, self._segments
        for s, off, k in zip(storages, offsets, place.segments):
            n = s.nbytes()
            if n:
                seg = segs[k]
                if seg is None or s.data_ptr() != seg.data_ptr() + off - place.starts[k]:
                    return False
        return True

    def hand_back(self, lazy: bool = True, start: int = 0, end: Optional[int] = None) -> bool:
        """Drop the segments that end in bytes ``(start, end]`` of the layout (default: all): call
        it once every storage below ``end`` is released, as an offload's hand-backs do (their
        ranges follow one another from 0, so a segment that starts in an earlier range goes with
        the range it ends in; ``lazy`` is the CPU slab's and unused). Returns whether one was
        dropped."""
        end = self.nbytes if end is None else end
        dropped = False
        for k, seg in enumerate(self._segments):
            if seg is not None and start < self._end(k) <= end:
                self._segments[k] = None
                dropped = True
        return dropped


def own_memory(storage: torch.UntypedStorage) -> bool:
    """Give a storage that holds memory it cannot resize (a piece of a :class:`Slab` or a
    :class:`DeviceSlab`) memory of its own from torch's allocator, with the same bytes: every view
    stays valid and ``resize_`` works again. Returns whether it moved (a resizable or empty
    storage is left alone). On CUDA the copy is queued on the current stream."""
    if storage.resizable() or not storage.nbytes() or not parks_cpu_memory():
        return False
    own = torch.UntypedStorage(storage.nbytes(), device=storage.device)
    own.copy_(storage)
    storage._swap_data_ptr_(own)  # storage: its own memory; own: the slab's piece, dropped here
    return True


def _fresh_block(nbytes: int, huge_pages: bool) -> torch.UntypedStorage:
    """A storage of ``nbytes`` from torch's allocator, not touched yet, with transparent huge pages
    advised over its 2 MiB-aligned interior when ``huge_pages`` (it stays resizable: a storage that
    takes its memory can be resized by anyone, megatron's own offload calls included)."""
    holder = torch.UntypedStorage(nbytes)
    if huge_pages:
        advise_huge_pages(holder)
    return holder


def regrow(storage: torch.UntypedStorage, nbytes: int, block: Optional[Block] = None, huge_pages: bool = True) -> None:
    """Give a released ``storage`` ``nbytes`` of memory again (contents undefined: write them).

    Args:
        storage: The storage :func:`release` emptied (any memory it holds now is dropped).
        nbytes: Its size.
        block: CPU: the block :func:`release` returned for it; its memory moves back in (None or a
            block of another size: fresh memory from torch's allocator). Any device: a piece of
            a :class:`DeviceSlab` (:meth:`DeviceSlab.block`).
        huge_pages: CPU: advise transparent huge pages over fresh memory of 4 MiB or more.

    Raises:
        Whatever the allocation raises (``MemoryError``, a device OOM); the storage is unchanged.
    """
    if not _on_cpu(storage) or not parks_cpu_memory():
        if block is not None and nbytes and block.nbytes == nbytes and parks_cpu_memory():
            holder, block.holder = block.holder, torch.UntypedStorage(0, device=storage.device)
            storage._swap_data_ptr_(holder)  # a DeviceSlab's piece, no allocation
            return
        storage.resize_(nbytes)
        if huge_pages:
            advise_huge_pages(storage)
        return
    if nbytes == 0:
        if storage.nbytes():
            storage._swap_data_ptr_(torch.UntypedStorage(0))
        return
    if block is not None and block.nbytes == nbytes:
        holder = block.holder
        block.holder = torch.UntypedStorage(0)  # the block is spent
    else:
        holder = _fresh_block(nbytes, huge_pages)
    storage._swap_data_ptr_(holder)  # holder: what the storage held (nothing, usually); dropped


def trim_host_heap() -> bool:
    """Give the C heap's free pages back to the OS (glibc ``malloc_trim(0)``; elsewhere nothing).

    What an offload on a CPU "device" calls when ``MemoryConfig.empty_cache`` is on, as CUDA's
    ``torch.cuda.empty_cache()``: after an offload the process holds the least it will, and memory
    that training allocated and freed between the cycles is still the heap's (glibc returns only
    the top of its heap on its own, so the RSS of a trainer on the CPU backend grew by 20 MiB per
    train step of a 4-layer model, without end). Returns whether the heap was trimmed.
    """
    fn = _libc_function("malloc_trim", [ctypes.c_size_t])
    if not fn:
        return False
    fn(0)
    return True
