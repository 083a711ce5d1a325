"""Configuration of the memory managers."""

from __future__ import annotations

import warnings
from typing import Optional

import torch
from pydantic import BaseModel, ConfigDict, Field

__all__ = ["MemoryConfig"]


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

    empty_cache: bool = True
    """Return freed blocks to the CUDA driver after an offload (``torch.cuda.empty_cache()``), so
    that reserved memory drops too. No effect without CUDA."""

    cpu_huge_pages: bool = True
    """When the "device" is the CPU (megatron-core on CPU, see ``cpu_backend``), ask Linux for
    transparent huge pages over every storage of 4 MiB or more that onload regrows
    (``madvise(MADV_HUGEPAGE)``). A released storage's memory goes back to the OS; growing it
    again costs one page fault per 4 KiB page on first touch, which made a CPU onload 3x slower
    than the copy itself. No effect on CUDA storages, on other systems or with THP disabled."""

    @property
    def bucket_size_bytes(self) -> int:
        """``bucket_size_mb`` in bytes, rounded down to a multiple of 512."""
        return max(512, int(self.bucket_size_mb * 2**20) // 512 * 512)

    def resolved_pin_memory(self) -> bool:
        """Whether the host store is pinned on this machine."""
        cuda = torch.cuda.is_available()
        if self.pin_memory and not cuda:
            warnings.warn("MemoryConfig.pin_memory=True is ignored: CUDA is not available, so the "
                          "host store uses ordinary memory.", stacklevel=3)
            return False
        return cuda if self.pin_memory is None else self.pin_memory
