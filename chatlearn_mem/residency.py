"""Residency reports: how many bytes a manager's model holds on the device and on the host."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch

from chatlearn_mem.device_memory import storage_key
from chatlearn_mem.parts import OTHER, Part

__all__ = ["Residency", "measure"]

CATEGORIES = (*(p.value for p in Part), OTHER)
"""Residency categories: every :class:`~chatlearn_mem.parts.Part` and ``other``."""


@dataclass(frozen=True)
class Residency:
    """Bytes held by a model and its optimizer.

    Attributes:
        device_bytes: Device memory held by the tracked tensors, each storage counted once. On a
            CPU-only machine "device" means the memory the model computes with.
        host_bytes: Host memory held by the manager's store of offloaded state.
        by_category: Device bytes per category (weights, grads, main_weights,
            optimizer_states, other).
        host_by_category: Host bytes per category.
        resident_by_category: Device bytes each part holds when resident: ``by_category`` for a
            resident part, the bytes its onload would regrow for an offloaded one (what a
            residency plan needs to know whatever the part's state now).
    """

    device_bytes: int
    host_bytes: int
    by_category: dict = field(default_factory=dict)
    host_by_category: dict = field(default_factory=dict)
    resident_by_category: dict = field(default_factory=dict)

    def __str__(self) -> str:
        parts = ", ".join(f"{k}={v / 2**20:.2f}" for k, v in self.by_category.items())
        return f"device {self.device_bytes / 2**20:.2f} MiB ({parts}), host store {self.host_bytes / 2**20:.2f} MiB"


def measure(
    tensors_by_category: Mapping[str, Iterable[torch.Tensor]],
    device: torch.device,
    host_by_category: Mapping[str, int],
    released_by_category: Mapping[str, int] = {},
) -> Residency:
    """Sum storage bytes on ``device`` per category; a storage goes to the first category listing it.

    ``released_by_category``: for each offloaded part, the bytes its storages had (they count in
    ``resident_by_category`` instead of what the released storages hold now, 0)."""
    seen: set[int] = set()
    by_category = {}
    for category, tensors in tensors_by_category.items():
        total = 0
        for t in tensors:
            if t is None or t.device != device:
                continue
            s = t.untyped_storage()
            if storage_key(s) in seen:
                continue
            seen.add(storage_key(s))
            total += s.nbytes()
        by_category[category] = total
    host = dict(host_by_category)
    resident = {c: released_by_category.get(c, n) for c, n in by_category.items()}
    return Residency(sum(by_category.values()), sum(host.values()), by_category, host, resident)
