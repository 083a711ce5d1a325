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
communicators). With NVML (``pynvml``, see :mod:`chatlearn_mem.process_memory`) those are this
process's own bytes; without it, the device's (every process on the GPU). What the walk cannot
see (the CUDA context, NCCL's buffers, cuBLAS workspaces) is split out when the caller measured it
(``measured=``). On CPU the walk is the whole report, and the driver's view says "not measured
here: no CUDA". :data:`WHY_IT_STAYS` says, per holder, why it is still there after a full offload.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence

import torch

from chatlearn_mem import process_memory
from chatlearn_mem.device_memory import storage_key
from chatlearn_mem.mcore import transient
from chatlearn_mem.torchnative import layout

__all__ = ["DeviceReport", "HOLDERS", "MEASURED", "WHY_IT_STAYS", "device_report", "reachable_tensors"]

MANAGER_RESIDUE = "manager_residue"
GLOBAL_MEMORY_BUFFER = "megatron_global_memory_buffer"
TRANSFORMER_ENGINE = "transformer_engine"
MOE_DISPATCHER = "moe_dispatcher"
MODEL_OTHER = "model_other"
OTHER_ALLOCATED = "other_allocated"
CUBLAS_WORKSPACES = "cublas_workspaces"
ALLOCATOR_CACHE = "allocator_cache"
NCCL_COMMUNICATORS = "nccl_communicators"
CUDA_CONTEXT = "cuda_context"
OUTSIDE_ALLOCATOR = "outside_allocator"

MEASURED = (CUDA_CONTEXT, NCCL_COMMUNICATORS, CUBLAS_WORKSPACES)
"""Holders the walk cannot see, which :func:`device_report` splits out when the caller measured them
(``measured={name: bytes}``): ``cuda_context`` out of ``outside_allocator`` (the process's NVML
bytes once CUDA started, before anything was allocated), ``nccl_communicators`` out of
``outside_allocator`` (what the first collective added outside the allocator), ``cublas_workspaces``
out of ``other_allocated`` (what :func:`chatlearn_mem.process_memory.release_idle_memory` freed)."""

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
    CUBLAS_WORKSPACES: "(CUDA) cuBLAS/cuBLASLt workspaces torch keeps per handle and stream (32 MiB "
    "each on Hopper), allocated but reachable from no model; measured by what "
    "release_idle_memory freed",
    NCCL_COMMUNICATORS: "(CUDA) NCCL communicators' buffers, outside the allocator (about 1 GiB per rank at "
    "TP4 reported; measured as what the first collective added)",
    CUDA_CONTEXT: "(CUDA) the CUDA context of this process: driver state and the kernels loaded "
    "when CUDA started (measured before anything was allocated)",
    OUTSIDE_ALLOCATOR: "(CUDA) device memory outside PyTorch's allocator (NVML's bytes for this process minus "
    "reserved; without NVML the device's, other processes on this GPU included) not "
    "split out above: the CUDA context, kernels loaded lazily since, NCCL communicators "
    "(often GBs per rank; destroy process groups no longer needed), libraries' own "
    "allocations",
}
"""Every holder the report names, with what it is and what to do about it."""

WHY_IT_STAYS = {
    MANAGER_RESIDUE: "a part that is not offloaded: nothing stays of an offloaded part",
    GLOBAL_MEMORY_BUFFER: "megatron owns it and hands out views of it; the manager does not drop "
    "another library's scratch space (megatron would allocate it again at its next use)",
    TRANSFORMER_ENGINE: "Transformer Engine's own workspaces and FP8 state, kept by TE for the process's life",
    MOE_DISPATCHER: "the last batch's routing tensors, held by the dispatcher until the next forward",
    MODEL_OTHER: "tensors user code or the optimizer attached to the model, outside every part",
    OTHER_ALLOCATED: "tensors this process still references outside the model (activations, outputs, "
    "other models); cuBLAS workspaces count here unless measured",
    CUBLAS_WORKSPACES: "not released: offload(release_idle_memory=False), a partial offload, or a thread "
    "that made them since (a full offload on CUDA clears them, see release_idle_memory)",
    ALLOCATOR_CACHE: "fragmentation: free blocks in segments that still hold a live block cannot go back "
    "to the driver (a full offload empties the cache: MemoryConfig.empty_cache)",
    NCCL_COMMUNICATORS: "NCCL keeps a communicator's buffers while its process group lives; megatron's "
    "groups are held by DDP and the optimizer, so destroying and re-creating them is "
    "not transparent (NCCL 2.29's ncclCommSuspend could release them; torch does not "
    "expose it)",
    CUDA_CONTEXT: "the process's CUDA context lives as long as the process",
    OUTSIDE_ALLOCATOR: "the CUDA context's growth since start (kernels loaded lazily at first use), "
    "libraries' own allocations; without NVML, other processes on the GPU",
}
"""Per holder, why its bytes are still on the device after a full offload (and what could free them)."""

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
        process: On CUDA this process's view
            (:meth:`chatlearn_mem.process_memory.ProcessMemory.to_dict`: NVML's bytes for this
            process when it could be read, ``nvml_note`` says how or why not); None on CPU.
        measured: The bytes the caller measured for holders the walk cannot see (:data:`MEASURED`).
    """

    device: str
    total_bytes: int
    by_holder: dict = field(default_factory=dict)
    largest: dict = field(default_factory=dict)
    cuda: Optional[dict] = None
    process: Optional[dict] = None
    measured: dict = field(default_factory=dict)

    @property
    def per_process(self) -> bool:
        """Whether ``total_bytes`` is this process's own (NVML) rather than the device's or the walk's."""
        return bool(self.process and self.process.get("per_process"))

    def to_dict(self) -> dict:
        """A JSON-ready dict of every field."""
        return {
            "device": self.device,
            "total_bytes": self.total_bytes,
            "by_holder": dict(self.by_holder),
            "largest": {k: [list(x) for x in v] for k, v in self.largest.items()},
            "cuda": self.cuda,
            "process": self.process,
            "per_process": self.per_process,
            "measured": dict(self.measured),
        }

    def remains(self) -> list[tuple[str, int, str]]:
        """``(holder, bytes, why it stays)`` for every holder still holding bytes, largest first."""
        held = sorted(((h, n) for h, n in self.by_holder.items() if n), key=lambda x: -x[1])
        return [(h, n, WHY_IT_STAYS[h]) for h, n in held]

    def format(self) -> str:
        """A readable table: bytes and share per holder, the largest tensors, what each holder is and
        why what remains stays."""
        whose = "this process (NVML)" if self.per_process else "the device" if self.cuda else "the walk"
        lines = [f"device memory still held on {self.device}: {_mib(self.total_bytes)} ({whose})"]
        if self.cuda:
            lines.append(
                "  (CUDA: allocated {}, reserved {}, device used {} of {})".format(
                    *(_mib(self.cuda[k]) for k in ("allocated", "reserved", "device_used", "device_total"))
                )
            )
        if self.process:
            nvml = self.process.get("nvml_process_used")
            lines.append(
                f"  (process {self.process['pid']}: "
                + (f"NVML {_mib(nvml)}" if nvml is not None else self.process["nvml_note"])
                + f"; outside the allocator {_mib(self.process['outside_allocator'])})"
            )
        else:
            lines.append(f"  (the driver's view: {process_memory.NOT_MEASURED})")
        if self.measured:
            lines.append("  (measured: " + ", ".join(f"{k} {_mib(v)}" for k, v in self.measured.items()) + ")")
        for holder, n in self.by_holder.items():
            share = f"{100 * n / self.total_bytes:5.1f}%" if self.total_bytes else "    -"
            lines.append(f"  {holder:<31} {_mib(n):>14} {share}")
            for path, nbytes in self.largest.get(holder, []):
                lines.append(f"      {_mib(nbytes):>14}  {path}")
        lines.append("what each holder is:")
        lines += [f"  {h}: {HOLDERS[h]}" for h in self.by_holder]
        remains = self.remains()
        if remains:
            lines.append("why what remains stays:")
            lines += [f"  {h} ({_mib(n)}): {why}" for h, n, why in remains]
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
    it). A tensor's ``main_grad`` and (leaf) ``.grad`` are followed too; a DTensor is reached as its
    local shard (the memory it holds). Objects of the ``skip``
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
            local = layout.local_tensor(obj)
            if local is not obj:  # a DTensor: its memory is its local shard's
                stack.append((f"{path}.to_local()", local, owners))
            else:
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
    *roots: Any,
    managers: Iterable[Any] = (),
    device: Optional[torch.device | str] = None,
    measured: Optional[Mapping[str, int]] = None,
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
        measured: Bytes of holders the walk cannot see, measured by the caller (keys of
            :data:`MEASURED`); each is split out of the holder that contains it, at most all of it.
            Ignored on CPU.

    Returns:
        A :class:`DeviceReport`; ``print(report)`` shows the table.

    Example::

        mm.offload()
        print(device_report(trainer.model, trainer.optimizer, managers=[mm]))
    """
    managers = list(managers)
    measured = dict(measured or {})
    unknown = set(measured) - set(MEASURED)
    if unknown:
        raise ValueError(f"measured takes {', '.join(MEASURED)}; got {', '.join(sorted(unknown))}")
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
    cuda = process = None
    pm = process_memory.process_memory(device) if device.type == "cuda" else None
    if pm is not None:
        attributed = sum(by_holder.values())
        cuda = {
            "allocated": pm.allocated,
            "reserved": pm.reserved,
            "device_used": pm.device_used,
            "device_total": pm.device_total,
        }
        process = pm.to_dict()
        other = max(0, pm.allocated - attributed)
        if CUBLAS_WORKSPACES in measured:
            by_holder[CUBLAS_WORKSPACES] = min(measured[CUBLAS_WORKSPACES], other)
            other -= by_holder[CUBLAS_WORKSPACES]
        by_holder[OTHER_ALLOCATED] = other
        by_holder[ALLOCATOR_CACHE] = pm.cached
        outside = pm.outside_allocator
        for holder in (NCCL_COMMUNICATORS, CUDA_CONTEXT):
            if holder in measured:
                by_holder[holder] = min(measured[holder], outside)
                outside -= by_holder[holder]
        by_holder[OUTSIDE_ALLOCATOR] = outside
    else:
        measured = {}
    return DeviceReport(str(device), sum(by_holder.values()), by_holder, largest, cuda, process, measured)
