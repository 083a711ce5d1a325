"""What stays on the device: the bytes a process still holds there and, as far as can be told, who holds them.

After a full offload the manager's own parts hold nothing, but a process rarely gets its device
back entirely. Users of RLHF frameworks report what stays (caching-allocator fragmentation, NCCL
communicators, megatron's global memory buffer, Transformer Engine workspaces, MoE dispatcher
tensors) and want to be told who holds it. :func:`device_report` answers with one
:class:`DeviceReport`: bytes per holder, the largest tensors of each with the path they were
reached by, and a hint on what to do about each.

How it is measured: every tensor reachable from the given roots (the model chunks, the optimizer)
through attributes, containers and modules is found by one walk (:func:`reachable_tensors`), plus
megatron's global memory buffer and Transformer Engine's module globals. Each storage is counted
once, under the first holder that claims it, in this order: the managers' parts, megatron's global
memory buffer, Transformer Engine, MoE token dispatchers, anything else reachable. On CUDA the
allocator's own figures complete the picture: allocated bytes the walk did not reach, blocks the
caching allocator keeps reserved, and device memory outside the allocator (CUDA context, NCCL
communicators). On CPU the walk is the whole report.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional, Sequence

import torch

from chatlearn_mem.device_memory import storage_key
from chatlearn_mem.mcore import transient

__all__ = ["DeviceReport", "HOLDERS", "device_report", "reachable_tensors"]

MANAGER_RESIDUE = "manager_residue"
GLOBAL_MEMORY_BUFFER = "megatron_global_memory_buffer"
TRANSFORMER_ENGINE = "transformer_engine"
MOE_DISPATCHER = "moe_dispatcher"
MODEL_OTHER = "model_other"
OTHER_ALLOCATED = "other_allocated"
ALLOCATOR_CACHE = "allocator_cache"
OUTSIDE_ALLOCATOR = "outside_allocator"

HOLDERS = {
    MANAGER_RESIDUE: "parts the memory managers manage that are still on the device: offload them "
    "(mm.offload()); 0 after a full offload",
    GLOBAL_MEMORY_BUFFER: "megatron's global memory buffer (parallel_state), scratch space kept between "
    "steps (sequence-parallel all-gathers); megatron allocates an entry again when "
    "it is next used, so dropping its entries frees this",
    TRANSFORMER_ENGINE: "Transformer Engine: cuBLAS workspaces kept for the process's life, FP8 scales "
    "and amax histories of its modules",
    MOE_DISPATCHER: "megatron's MoE token dispatchers: routing tensors of the last batch, overwritten "
    "by the next forward",
    MODEL_OTHER: "other tensors reachable from the model or optimizer (caches, the optimizer's "
    "scalars, tensors user code attached to a module)",
    OTHER_ALLOCATED: "(CUDA) allocated tensors not reachable from the model or optimizer: activations, "
    "outputs or other models that user code still references",
    ALLOCATOR_CACHE: "(CUDA) freed blocks PyTorch's caching allocator still reserves (reserved minus "
    "allocated): torch.cuda.empty_cache() returns them (MemoryConfig.empty_cache does "
    "after every offload); what stays after it is fragmentation, which "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True reduces",
    OUTSIDE_ALLOCATOR: "(CUDA) device memory outside PyTorch's allocator (device used minus reserved): "
    "the CUDA context, NCCL communicators (often GBs per rank; destroy process "
    "groups no longer needed), libraries' own allocations. Device-wide: other "
    "processes on this GPU count here too",
}
"""Every holder the report names, with what it is and what to do about it."""

_PRIORITY = (MANAGER_RESIDUE, GLOBAL_MEMORY_BUFFER, TRANSFORMER_ENGINE, MOE_DISPATCHER, MODEL_OTHER)
_TOP = 5  # largest tensors listed per holder
_MODULE_DICTS = ("_parameters", "_buffers", "_modules")


@dataclass(frozen=True)
class DeviceReport:
    """Bytes still held on one device, per holder.

    Attributes:
        device: The device reported on (``cuda:0``, ``cpu``).
        total_bytes: The sum of ``by_holder``. On CUDA that is the device memory in use
            (``torch.cuda.mem_get_info``: total minus free, device-wide); on CPU the bytes of
            every storage the walk reached.
        by_holder: Bytes per holder (keys of :data:`HOLDERS`; the CUDA-only ones are absent on CPU).
        largest: Per holder, its largest storages as ``(path, bytes)``, largest first (at most 5),
            the path being how the walk reached them (``root0`` is the first root).
        cuda: On CUDA the allocator's figures in bytes (``allocated``, ``reserved``,
            ``device_used``, ``device_total``); None on CPU.
    """

    device: str
    total_bytes: int
    by_holder: dict = field(default_factory=dict)
    largest: dict = field(default_factory=dict)
    cuda: Optional[dict] = None

    def to_dict(self) -> dict:
        """A JSON-ready dict of every field."""
        return {
            "device": self.device,
            "total_bytes": self.total_bytes,
            "by_holder": dict(self.by_holder),
            "largest": {k: [list(x) for x in v] for k, v in self.largest.items()},
            "cuda": self.cuda,
        }

    def format(self) -> str:
        """A readable table: bytes and share per holder, the largest tensors, what each holder is."""
        lines = [f"device memory still held on {self.device}: {_mib(self.total_bytes)}"]
        if self.cuda:
            lines.append(
                "  (CUDA: allocated {}, reserved {}, device used {} of {})".format(
                    *(_mib(self.cuda[k]) for k in ("allocated", "reserved", "device_used", "device_total"))
                )
            )
        for holder, n in self.by_holder.items():
            share = f"{100 * n / self.total_bytes:5.1f}%" if self.total_bytes else "    -"
            lines.append(f"  {holder:<31} {_mib(n):>14} {share}")
            for path, nbytes in self.largest.get(holder, []):
                lines.append(f"      {_mib(nbytes):>14}  {path}")
        lines.append("what each holder is:")
        lines += [f"  {h}: {HOLDERS[h]}" for h in self.by_holder]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n} B"


def reachable_tensors(
    *roots: Any, names: Optional[Sequence[str]] = None, skip: tuple = ()
) -> Iterator[tuple[str, torch.Tensor, tuple]]:
    """Every tensor reachable from ``roots`` through attributes, containers and modules.

    Yields ``(path, tensor, owners)`` where ``path`` names how it was reached (``root0.module...``,
    or starting with ``names[i]`` when names are given) and ``owners`` are the objects on that path, outermost first (so a caller can tell who holds
    it). A tensor's ``main_grad`` and (leaf) ``.grad`` are followed too. Objects of the ``skip``
    types are not entered, and neither are memory managers (reached through the hooks they
    register; what they hold is their host store), nor their parts' state.
    """
    from chatlearn_mem.manager import MemoryManagerBase
    from chatlearn_mem.parts_state import PartsState

    stop = (
        str,
        bytes,
        int,
        float,
        bool,
        complex,
        type(None),
        types.FunctionType,
        types.BuiltinFunctionType,
        types.ModuleType,
        type,
        torch.dtype,
        torch.device,
        torch.Size,
        MemoryManagerBase,
        PartsState,
        *skip,
    )
    pg = getattr(torch.distributed, "ProcessGroup", None)
    if pg is not None:
        stop += (pg,)
    seen: set[int] = set()
    labels = list(names) if names is not None else [f"root{i}" for i in range(len(roots))]
    stack: list[tuple[str, Any, tuple]] = [(labels[i], r, ()) for i, r in reversed(list(enumerate(roots)))]
    while stack:
        path, obj, owners = stack.pop()
        if isinstance(obj, stop) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            yield path, obj, owners
            for attr in ("main_grad", "grad"):
                t = getattr(obj, attr, None) if attr != "grad" or obj.is_leaf else None
                if isinstance(t, torch.Tensor):
                    stack.append((f"{path}.{attr}", t, owners))
            continue
        inner = owners + (obj,)
        if isinstance(obj, types.MethodType):
            stack.append((f"{path}.__self__", obj.__self__, owners))
            continue
        if isinstance(obj, dict):
            for i, (k, v) in enumerate(obj.items()):
                key = repr(k)[:40] if isinstance(k, (str, int)) else f"<{type(k).__name__} #{i}>"
                stack.append((f"{path}[{key}]", v, owners))
                if isinstance(k, torch.Tensor):
                    stack.append((f"{path}.keys()[{i}]", k, owners))
            continue
        if isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend((f"{path}[{i}]", v, owners) for i, v in enumerate(obj))
            continue
        d = getattr(obj, "__dict__", None)
        if isinstance(d, dict):
            items = list(d.items())
            if isinstance(obj, torch.nn.Module):  # name submodules, params, buffers as attributes
                items = [(k, v) for k, v in items if k not in _MODULE_DICTS]
                items += [(k, v) for name in _MODULE_DICTS for k, v in (d.get(name) or {}).items()]
            stack.extend((f"{path}.{k}", v, inner) for k, v in items)


def _default_device(managers: Sequence[Any], roots: Sequence[Any]) -> torch.device:
    for mm in managers:
        return mm.device
    for _, t, _ in reachable_tensors(*roots):
        if t.device.type != "meta":
            return t.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _holder_of_path(owners: tuple) -> str:
    if any(transient.is_transformer_engine_module(o) for o in owners):
        return TRANSFORMER_ENGINE
    if any(transient.is_moe_token_dispatcher(o) for o in owners):
        return MOE_DISPATCHER
    return MODEL_OTHER


def device_report(
    *roots: Any, managers: Iterable[Any] = (), device: Optional[torch.device | str] = None
) -> DeviceReport:
    """Report the bytes still held on ``device`` and who holds them.

    Call it after a full offload to see what stays (or at any time). Walks every tensor reachable
    from ``roots`` (pass the model chunks and the optimizer), megatron's global memory buffer and
    Transformer Engine's globals; on CUDA adds the allocator's figures. Read-only: nothing is
    moved or freed. A walk of a large model takes a fraction of a second.

    Args:
        roots: The objects to walk: the model (a chunk or a list of chunks), the optimizer, any
            other object whose tensors should be attributed.
        managers: The memory managers of those models (``TrainerMemoryManager`` /
            ``InferenceMemoryManager``); storages of their parts count as ``manager_residue``.
        device: The device to report on; default the managers' device, else the first tensor's,
            else the current CUDA device or the CPU.

    Returns:
        A :class:`DeviceReport`; ``print(report)`` shows the table.

    Example::

        mm.offload()
        print(device_report(trainer.model, trainer.optimizer, managers=[mm]))
    """
    managers = list(managers)
    device = torch.device(device) if device is not None else _default_device(managers, roots)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    found: dict[int, dict] = {}  # storage id -> {"bytes", "holder", "path"}

    def claim(holder: str, path: str, t: torch.Tensor) -> None:
        if t.device != device:
            return
        s = t.untyped_storage()
        entry = found.get(storage_key(s))
        if entry is None:
            found[storage_key(s)] = {"bytes": s.nbytes(), "holder": holder, "path": path}
        elif _PRIORITY.index(holder) < _PRIORITY.index(entry["holder"]):
            entry.update(holder=holder, path=path)

    for i, mm in enumerate(managers):
        for part in mm.parts:
            for t in mm.state.hooks.part_tensors(part):
                if t is not None:
                    claim(MANAGER_RESIDUE, f"manager{i}.{part}", t)
    for path, t in transient.global_memory_buffer_tensors():
        claim(GLOBAL_MEMORY_BUFFER, path, t)
    te_globals = transient.transformer_engine_global_tensors()
    for path, t, _ in reachable_tensors(*(v for _, v in te_globals), names=[k for k, _ in te_globals]):
        claim(TRANSFORMER_ENGINE, path, t)
    for path, t, owners in reachable_tensors(*roots):
        claim(_holder_of_path(owners), path, t)

    by_holder = {h: 0 for h in _PRIORITY}
    largest: dict[str, list] = {h: [] for h in _PRIORITY}
    for entry in found.values():
        by_holder[entry["holder"]] += entry["bytes"]
        if entry["bytes"]:
            largest[entry["holder"]].append((entry["path"], entry["bytes"]))
    largest = {h: sorted(v, key=lambda x: -x[1])[:_TOP] for h, v in largest.items() if v}
    cuda = None
    if device.type == "cuda":
        attributed = sum(by_holder.values())
        allocated = torch.cuda.memory_allocated(device)
        reserved = torch.cuda.memory_reserved(device)
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        cuda = {"allocated": allocated, "reserved": reserved, "device_used": used, "device_total": total}
        by_holder[OTHER_ALLOCATED] = max(0, allocated - attributed)
        by_holder[ALLOCATOR_CACHE] = reserved - allocated
        by_holder[OUTSIDE_ALLOCATOR] = max(0, used - reserved)
    return DeviceReport(str(device), sum(by_holder.values()), by_holder, largest, cuda)
