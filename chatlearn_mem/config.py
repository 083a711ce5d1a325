"""The memory managers' configuration, :class:`MemoryConfig`.

Reading configs from YAML files and ``key=value`` overrides is the command line's business
(``chatlearn_mem_config_files``, below the PPO app and the benchmark); the core builds its config from Python only.
"""

from __future__ import annotations

import os
import warnings
from typing import Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field

__all__ = ["DEBUG_GUARD_ENV", "MemoryConfig"]

DEBUG_GUARD_ENV = "CHATLEARN_MEM_DEBUG_GUARD"
"""Environment variable that turns on ``MemoryConfig.debug_guard`` for every manager."""


class MemoryConfig(BaseModel):
    """How the memory managers store offloaded state on the host."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bucket_size_mb: float = Field(256.0, gt=0)
    """Size of one flat host bucket in MiB. It bounds the largest single host allocation (and
    pinned registration) an offload makes; tensors larger than a bucket span several."""

    pin_memory: Optional[bool] = None
    """Page-lock the host store for fast asynchronous copies. Default (None): pin when CUDA is
    available. Ignored, with a warning, when set to True on a machine without CUDA."""

    skip_unchanged_weights: bool = True
    """On offload, do not copy weights to the host again when the host copy is still current
    (nothing wrote to them since they were onloaded). See the managers' docs for how the
    manager knows; call ``mark_weights_dirty()`` after writing through ``param.data``."""

    copy_chunk_mb: float = Field(64.0, gt=0)
    """Largest single copy in MiB of a non-blocking weights onload, which moves the weights in
    pieces of at most this size, in the order the model reads them, so that a forward pass can
    start on the first layers while later ones are still arriving. Smaller pieces start compute
    sooner; each costs one more copy call and event (on a CPU device, 16 MiB pieces copied about
    15% slower than 64 MiB ones, measured). Other transitions, which nothing waits on piece by
    piece, copy each storage in one piece per host bucket; all of them end a step (a fence) about
    every this many bytes, between storages, and release a storage as soon as its own copies are
    done. On a CPU device a part laid out in one slab (``cpu_contiguous``) copies in one piece per
    step, and its steps hold eight times this (``group_transfer.CPU_SLAB_STEP_MULTIPLIER``) except
    in a :func:`~chatlearn_mem.swap`, whose incoming regrows follow the outgoing releases."""

    empty_cache: bool = True
    """After an offload, give freed memory back: on CUDA the caching allocator's free blocks go to
    the driver (``torch.cuda.empty_cache()``), so that reserved memory drops too; on a CPU
    "device" the C heap's free pages go to the OS (glibc ``malloc_trim(0)``), so that what
    training freed between the cycles does not pile up in the process's RSS."""

    cpu_huge_pages: bool = True
    """When the "device" is the CPU (megatron-core on CPU, see ``cpu_backend``), ask Linux for
    transparent huge pages over every storage of 4 MiB or more that an onload has to map afresh
    (``madvise(MADV_HUGEPAGE)``): its first touch then faults in 2 MiB pages, not 4 KiB ones.
    No effect on CUDA storages, on other systems or with THP disabled."""

    cpu_release: Literal["lazy", "eager"] = "lazy"
    """How an offload on a CPU "device" hands a storage's pages back to the kernel; the storage's
    memory is kept aside while the part is offloaded and moved back in by the onload (see
    :mod:`chatlearn_mem.device_memory`). ``lazy``: ``MADV_FREE``, the kernel takes the pages
    whenever anything needs memory and counts them as available from the release on, and an
    onload that finds them still there copies with no page fault (as fast as a copy into memory
    allocated once); the process's RSS keeps showing them (as ``LazyFree``) until taken.
    ``eager``: ``MADV_DONTNEED``, RSS falls at once and the onload pays a page fault (and the
    kernel's zeroing) per page. No effect on CUDA."""

    cpu_contiguous: bool = True
    """On a CPU "device", lay out the storages of a part made of many of them (a trainer's main
    weights and optimizer states, an inference model's weights) in one mapping, at the offsets of
    the part's host store, from their first onload on: one copy then moves many storages and
    one ``madvise`` per step hands their pages back (:class:`~chatlearn_mem.device_memory.Slab`; the
    offload of 447 optimizer-state storages of a 135 M-parameter trainer went from 0.77 to about
    the speed of one copy of its bytes). The price: while such a storage is onloaded, ``resize_``
    on it raises ("Trying to resize storage that is not resizable"); set False where other code
    resizes these storages itself. Megatron's param and grad buffers, which its own offload calls
    resize, are never laid out so. No effect on CUDA."""

    cuda_contiguous: bool = False
    """On CUDA, lay out the storages of a part made of many of them (as ``cpu_contiguous``) in a few
    allocations of at least ``copy_chunk_mb`` each, at the offsets of the part's host store
    (:class:`~chatlearn_mem.device_memory.DeviceSlab`): an onload then allocates once per segment
    instead of once per storage, and one copy per step moves many storages, so the host's work
    per call no longer grows with allocations, stream records and copy launches per tensor (one
    pointer move per storage is left). The same price as ``cpu_contiguous``: while onloaded,
    ``resize_`` on such a storage raises. Needs ``torch.UntypedStorage._swap_data_ptr_`` (torch
    2.13 has it, 2.11 does not): a manager on CUDA refuses it (``ConfigError``) where it is
    missing. Off by default until it has been validated on a GPU (``scripts/gpu_validate.sh`` runs
    the GPU tests with it on; they skip on a torch without it)."""

    debug_guard: bool = False
    """Turn any torch operation on a released tensor into an ``OffloadedError`` naming the tensor,
    while anything is offloaded (a ``TorchFunctionMode`` on the thread that offloaded). Costs a
    Python call per torch operation on that thread while a part is offloaded (see the README for
    the measured cost); nothing while everything is resident. ``CHATLEARN_MEM_DEBUG_GUARD=1`` in
    the environment turns it on for every manager."""

    check_host_memory: bool = True
    """Refuse, before anything changes, an offload whose new host buffers would not fit in the host
    memory the process can use (the cgroup limit where there is one, else ``MemAvailable``)
    minus ``host_memory_margin_mb``."""

    host_memory_margin_mb: float = Field(1024.0, ge=0)
    """Host memory in MiB to leave free when checking that an offload's host buffers fit."""

    @property
    def bucket_size_bytes(self) -> int:
        """``bucket_size_mb`` in bytes, rounded down to a multiple of 512."""
        return max(512, int(self.bucket_size_mb * 2**20) // 512 * 512)

    @property
    def copy_chunk_bytes(self) -> int:
        """``copy_chunk_mb`` in bytes, rounded down to a multiple of 512 (at least 512)."""
        return max(512, int(self.copy_chunk_mb * 2**20) // 512 * 512)

    @property
    def host_memory_margin_bytes(self) -> int:
        """``host_memory_margin_mb`` in bytes."""
        return int(self.host_memory_margin_mb * 2**20)

    def resolved_debug_guard(self) -> bool:
        """Whether the debug guard is on: ``debug_guard`` or ``CHATLEARN_MEM_DEBUG_GUARD`` set to
        1/true/yes/on in the environment (read when a manager is created)."""
        env = os.environ.get(DEBUG_GUARD_ENV, "").strip().lower()
        return self.debug_guard or env in ("1", "true", "yes", "on")

    def resolved_pin_memory(self) -> bool:
        """Whether the host store is pinned on this machine."""
        cuda = torch.cuda.is_available()
        if self.pin_memory and not cuda:
            warnings.warn(
                "MemoryConfig.pin_memory=True is ignored: CUDA is not available, so the "
                "host store uses ordinary memory.",
                stacklevel=3,
            )
            return False
        return cuda if self.pin_memory is None else self.pin_memory
