"""Bucketed flat host memory that offloaded storages are copied into.

A :class:`HostStore` is planned for a list of byte sizes (one per device storage) and allocates
flat ``uint8`` host tensors of at most ``bucket_size`` bytes each, once. Each storage occupies a
contiguous byte range of the concatenated buckets, split at bucket boundaries when it is larger
than what is left of a bucket. The same store is reused for every later offload of the same
sizes, so repeated cycles neither allocate nor grow host memory.
"""

from __future__ import annotations

import mmap
import weakref
from dataclasses import dataclass

import torch

__all__ = ["ALIGN", "HostStore", "Span"]

ALIGN = 512  # byte alignment of every storage inside the store (vectorised copies, DMA)


@dataclass(frozen=True)
class Span:
    """One contiguous piece of a storage inside one bucket."""

    bucket: int
    bucket_offset: int
    storage_offset: int
    nbytes: int


def _allocate_host_bucket(nbytes: int, pin: bool) -> torch.Tensor:
    """Allocate one flat host bucket. Module-level so tests can inject allocation failures.

    A bucket to be pinned is anonymous page-aligned memory of exactly ``nbytes`` (``mmap``), which
    :class:`HostStore` registers with CUDA itself: torch's pinned allocator would round it up to
    a power of two (a 384 MiB bucket takes 512 MiB) and keep it cached for the life of the process
    after it is freed. The mapping is returned to the OS when the last tensor over it goes.
    """
    if pin:
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)
    return torch.empty(nbytes, dtype=torch.uint8, device="cpu")


def _register(bucket: torch.Tensor) -> None:
    """Page-lock a bucket with ``cudaHostRegister`` (portable: usable from every device)."""
    err = int(torch.cuda.cudart().cudaHostRegister(bucket.data_ptr(), bucket.numel(), 1))
    if err:
        raise RuntimeError(
            f"cudaHostRegister of a {bucket.numel()} byte host bucket failed (cudaError {err}); "
            "the locked-memory limit (ulimit -l) may be too low, or set "
            "MemoryConfig(pin_memory=False)"
        )


def _unregister(pointers: list[int]) -> None:
    """Undo :func:`_register` for every pointer (after the device finished any copy from them)."""
    if not pointers:
        return
    torch.cuda.synchronize()  # no copy may still read or write pages being unlocked
    while pointers:
        torch.cuda.cudart().cudaHostUnregister(pointers.pop())


def _plan(sizes: tuple[int, ...], bucket_size: int) -> tuple[list[list[Span]], list[int]]:
    """Place each storage in the buckets: its spans, and the size of every bucket."""
    if bucket_size <= 0:
        raise ValueError(f"bucket_size must be > 0, got {bucket_size}")
    all_spans: list[list[Span]] = []
    bucket_sizes: list[int] = []
    used = bucket_size  # forces a first bucket
    for size in sizes:
        spans: list[Span] = []
        done = 0
        while done < size:
            used = -(-used // ALIGN) * ALIGN
            if used >= bucket_size:
                bucket_sizes.append(0)
                used = 0
            take = min(size - done, bucket_size - used)
            spans.append(Span(len(bucket_sizes) - 1, used, done, take))
            used += take
            done += take
            bucket_sizes[-1] = used
        all_spans.append(spans)
    return all_spans, bucket_sizes


class HostStore:
    """Flat host buckets sized for a fixed list of storages.

    Args:
        sizes: Byte size of each storage, in the order the storages are copied.
        bucket_size: Largest bucket in bytes.
        pin: Page-lock the buckets (only meaningful with CUDA): each bucket is registered with
            ``cudaHostRegister`` at its exact size and unregistered by :meth:`close` (or when the
            store is collected), so the pinned memory goes back to the OS with the store.

    Raises:
        MemoryError / RuntimeError: When a bucket cannot be allocated or pinned; then nothing is kept.
    """

    def __init__(self, sizes: list[int], bucket_size: int, pin: bool):
        self.sizes = tuple(int(s) for s in sizes)
        self.pinned = pin
        self.spans, bucket_sizes = _plan(self.sizes, bucket_size)
        starts = [0]
        for n in bucket_sizes[:-1]:
            starts.append(starts[-1] + n)
        self.flat_offsets = tuple(starts[sp[0].bucket] + sp[0].bucket_offset if sp else 0 for sp in self.spans)
        """Where each storage starts in the buckets laid end to end (0 for a storage of no bytes):
        a device layout with these offsets has the bytes of consecutive storages as consecutive as
        the store (what a :class:`~chatlearn_mem.device_memory.Slab` holds)."""
        self._registered: list[int] = []  # pointers this store registered (emptied by close)
        self._finalizer = weakref.finalize(self, _unregister, self._registered)
        self.buckets: list[torch.Tensor] = []
        try:  # all or nothing: a failing allocation drops the buckets made so far
            for n in bucket_sizes:
                bucket = _allocate_host_bucket(n, pin)
                if pin:
                    _register(bucket)
                    self._registered.append(bucket.data_ptr())
                self.buckets.append(bucket)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Unpin the buckets and drop them: their memory goes back to the OS once no tensor views
        it. The store is empty afterwards. Call it only when no copy to or from it is pending."""
        _unregister(self._registered)
        self.buckets = []

    @staticmethod
    def planned_nbytes(sizes: list[int], bucket_size: int) -> int:
        """Host bytes a store for ``sizes`` would allocate (alignment padding included)."""
        return sum(_plan(tuple(int(s) for s in sizes), bucket_size)[1])

    @property
    def nbytes(self) -> int:
        """Host bytes held by the buckets."""
        return sum(b.numel() for b in self.buckets)

    def views(self, index: int) -> list[tuple[torch.Tensor, int]]:
        """Host byte views of storage ``index``: ``(view, offset inside the storage)`` pairs."""
        return [
            (self.buckets[s.bucket][s.bucket_offset : s.bucket_offset + s.nbytes], s.storage_offset)
            for s in self.spans[index]
        ]
