"""Bucketed flat host memory that offloaded storages are copied into.

A :class:`HostStore` is planned for a list of byte sizes (one per device storage) and allocates
flat ``uint8`` host tensors of at most ``bucket_size`` bytes each, once. Each storage occupies a
contiguous byte range of the concatenated buckets, split at bucket boundaries when it is larger
than what is left of a bucket. The same store is reused for every later offload of the same
sizes, so repeated cycles neither allocate nor grow host memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["HostStore", "Span"]

_ALIGN = 512  # byte alignment of every storage inside the store (vectorised copies, DMA)


@dataclass(frozen=True)
class Span:
    """One contiguous piece of a storage inside one bucket."""

    bucket: int
    bucket_offset: int
    storage_offset: int
    nbytes: int


def _allocate_host_bucket(nbytes: int, pin: bool) -> torch.Tensor:
    """Allocate one flat host bucket. Module-level so tests can inject allocation failures."""
    return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=pin)


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
            used = -(-used // _ALIGN) * _ALIGN
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
        pin: Page-lock the buckets (only meaningful with CUDA).

    Raises:
        MemoryError / RuntimeError: When a bucket cannot be allocated; then nothing is kept.
    """

    def __init__(self, sizes: list[int], bucket_size: int, pin: bool):
        self.sizes = tuple(int(s) for s in sizes)
        self.pinned = pin
        self.spans, bucket_sizes = _plan(self.sizes, bucket_size)
        # All or nothing: a failing allocation drops the buckets made so far.
        self.buckets: list[torch.Tensor] = [_allocate_host_bucket(n, pin) for n in bucket_sizes]

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
        return [(self.buckets[s.bucket][s.bucket_offset:s.bucket_offset + s.nbytes], s.storage_offset)
                for s in self.spans[index]]
