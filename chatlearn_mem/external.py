"""Changes made to a manager's memory behind its back, for example by megatron-core's own offload calls.

megatron-core ships its own offload (``DistributedDataParallel.offload_grad_buffers`` /
``restore_grad_buffers``, ``_ParamAndGradBuffer.offload_to_cpu`` / ``reload_from_cpu``,
``MegatronOptimizer.offload_to_cpu`` / ``restore_from_cpu``). They release the same storages the
manager releases, or rebind tensors to the host, without telling it. A manager that went on
regardless would restore stale bytes, copy from released memory or report a clean audit of a
broken trainer. After each of its calls the manager records, per part, which storages it left
resident and which tensors lived on its device (:class:`Placement`); before the next call it
compares (:func:`changes`) and refuses with :class:`ExternalChangeError` if anything moved, or
was replaced by new device memory (``restore_from_cpu()`` brings the optimizer's tensors back as new
tensors: an offload would then free the manager's stale storages and leave the live ones resident).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Iterable, Optional

import torch

from chatlearn_mem.device_memory import storage_id
from chatlearn_mem.errors import ExternalChangeError

__all__ = ["ExternalChangeError", "ExternalHints", "MEGATRON_HINTS", "Placement", "changes"]


@dataclass(frozen=True)
class ExternalHints:
    """How a framework's own calls change the memory a manager manages, and what to do: the rest of
    each sentence :func:`changes` writes (regrown while offloaded; released, moved to another
    device, or given new memory while resident)."""

    regrown: str
    short: str
    moved: str
    rebound: str


_BUILT_IN_RELEASE = (
    "megatron-core's own offload released it (DistributedDataParallel.offload_grad_buffers() "
    "or _ParamAndGradBuffer.offload_to_cpu())"
)
_BUILT_IN_RELOAD = (
    "megatron-core's own reload regrew it (restore_grad_buffers() or "
    "_ParamAndGradBuffer.reload_from_cpu(), which copies megatron's own, possibly stale, host copy)"
)
_BUILT_IN_MOVE = (
    "megatron-core's MegatronOptimizer.offload_to_cpu() moves main weights and optimizer "
    "states this way; restore_from_cpu() moves them back as new tensors"
)
_READOPT = (
    "close() this manager and create a new one for the trainer (it takes the tensors as they are "
    "now), and use one offload mechanism per trainer"
)

MEGATRON_HINTS = ExternalHints(
    regrown=f"{_BUILT_IN_RELOAD}. The manager's host copy is the current one: release them again the same way "
    "(offload_grad_buffers() / offload_to_cpu()) and call onload(), and use one offload mechanism per trainer",
    short=f"{_BUILT_IN_RELEASE}. Bring them back with the matching megatron call (restore_grad_buffers() / "
    "reload_from_cpu()) before using the manager, and use one offload mechanism per trainer",
    moved=f"(p.data or an optimizer state rebound to the host); {_BUILT_IN_MOVE}, which breaks the views the "
    "distributed optimizer keeps into the parameters. Call optimizer.restore_from_cpu(), then " + _READOPT,
    rebound="(p.data or an optimizer state replaced since the manager's last call; megatron-core's "
    "MegatronOptimizer.restore_from_cpu() and optimizer.load_state_dict() do this), so an offload would free "
    "the manager's stale copies and leave them on the device; " + _READOPT,
)
"""The words for megatron-core's own offload calls (the default); a backend may give its own."""


@dataclass
class Placement:
    """Where one part's tensors were when the manager last touched the part.

    Attributes:
        on_device: slot -> the identity of its storage (:func:`~chatlearn_mem.device_memory.storage_key`)
            for every tensor slot (a tensor, or an optimizer state entry) that held device memory
            of the manager's device.
    """

    on_device: dict[Hashable, int] = field(default_factory=dict)

    @classmethod
    def of(cls, slots: Iterable[tuple[Hashable, torch.Tensor]], device: torch.device) -> "Placement":
        """Record the slots whose tensor lives on ``device``, with the storage each one uses."""
        return cls({slot: storage_id(t.untyped_storage()) for slot, t in slots if t.device == device})


def _named(slots: list) -> str:
    """`` (param a, param b and 3 more)`` for the slots that are names (a backend's), else ``""``."""
    names = [s for s in slots if isinstance(s, str)]
    if not names:
        return ""
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return f" ({', '.join(names[:3])}{more})"


def changes(
    part: str,
    offloaded: bool,
    released: list[tuple[torch.UntypedStorage, int]],
    slots: Iterable[tuple[Hashable, torch.Tensor]],
    device: torch.device,
    before: Optional[Placement],
    hints: Optional[ExternalHints] = None,
) -> list[str]:
    """One sentence per kind of change made to ``part`` since the manager last touched it.

    Args:
        part: The part's name, for the messages.
        offloaded: Whether the manager holds the part offloaded.
        released: The storages the manager released when it offloaded the part.
        slots: ``(slot, tensor)`` for every tensor of the part now; slots that are strings name
            the tensor in the messages.
        device: The manager's device.
        before: What :meth:`Placement.of` recorded after the manager's last call on the part.
        hints: The rest of each sentence (default: megatron-core's own offload calls).
    """
    h = hints or MEGATRON_HINTS
    out = []
    if offloaded:
        regrown = [(s, n) for s, n in released if s.nbytes() != 0]
        if regrown:
            nbytes = sum(s.nbytes() for s, _ in regrown)
            out.append(
                f"{part}: {len(regrown)} storage(s) the manager released hold {nbytes} bytes on the "
                f"device again although the part is offloaded; {h.regrown}"
            )
        return out
    short, moved, rebound = [], [], []
    on_device = before.on_device if before is not None else {}
    for slot, t in slots:  # every tensor of the part, before every call: one storage lookup each
        seen = on_device.get(slot)
        if t.device == device:
            s = t.untyped_storage()
            if s.nbytes() == 0 and t.numel() > 0:
                # released (resize_(0), what megatron's offload calls do) although it has elements
                # (the audit's residency check also catches partial shrinks)
                short.append(slot)
            elif seen is not None and storage_id(s) != seen:  # another storage than before
                rebound.append(slot)
        elif seen is not None:
            moved.append(slot)
    if short:
        out.append(
            f"{part}: {len(short)} tensor(s){_named(short)} have no device memory although the manager did not "
            f"offload the part; {h.short}"
        )
    if moved:
        out.append(
            f"{part}: {len(moved)} tensor(s){_named(moved)} the manager saw on {device} now live elsewhere {h.moved}"
        )
    if rebound:
        out.append(
            f"{part}: {len(rebound)} tensor(s){_named(rebound)} on {device} use new memory the manager does not "
            f"manage {h.rebound}"
        )
    return out
