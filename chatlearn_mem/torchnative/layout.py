"""Everything chatlearn-mem knows about plain PyTorch trainers' private structures, in one place.

One function per question, as :mod:`chatlearn_mem.mcore.layout` for megatron-core. The backend
(:mod:`~chatlearn_mem.torchnative.backend`), its audit (:mod:`~chatlearn_mem.torchnative.checks`)
and its checkpoints (:mod:`~chatlearn_mem.torchnative.checkpointing`) never spell a private torch
attribute themselves. Facts relied on (torch 2.6 to 2.13; tested on 2.13):

* ``torch.nn.parallel.DistributedDataParallel`` keeps its gradient buckets in its C++ reducer, out
  of Python's reach, and rebuilds them once, in the forward of its second iteration
  (``_has_rebuilt_buckets``). With ``gradient_as_bucket_view=True`` every ``param.grad`` a
  backward leaves is a view into a bucket, which is how the backend finds the buckets' storages;
  without it the buckets are a second copy of the gradients that nothing can release. DDP hooks
  each trainable parameter's grad-accumulator node from C++ (one per parameter, kept alive by the
  reducer); with ``broadcast_buffers`` its forward reads every module buffer before the module runs.
* ``torch.distributed.optim.ZeroRedundancyOptimizer`` partitions the parameters over the ranks
  (``_partition_parameters()``, ``_param_to_rank``) and steps a local optimizer (``optim``) over
  this rank's partition. With ``parameters_as_bucket_view=True``, ``_buckets[device][rank]`` is one
  flat tensor per device and rank and every trainable parameter's ``.data`` a view into it, in
  partition order. With ``overlap_with_ddp=True`` its local optimizer is functional, steps inside
  DDP's comm hook, and the buckets are built lazily once DDP rebuilt its own
  (``_overlap_info.status`` becomes ``INITIALIZED``): ``_bucket_assignments_per_rank[rank][bucket]``
  then holds a flat ``tensor`` that its ``parameters`` view, in order.
* FSDP2 (``torch.distributed.fsdp.fully_shard``): each ``FSDPModule``'s state holds
  ``_fsdp_param_groups``, each ``fsdp_params``; an ``FSDPParam`` keeps the sharded parameter
  ``sharded_param`` (a ``DTensor`` whose ``_local_tensor`` narrows the padded 1-D
  ``_sharded_param_data``) and the unsharded one in ``all_gather_outputs``, which FSDP2 allocates
  for forward and backward and frees itself with ``untyped_storage().resize_(0)``. While a group
  is unsharded its modules hold the unsharded parameters instead of the sharded ones.
* A DTensor's storage cannot be read (a wrapper subclass): its memory is ``_local_tensor``'s.
* Eager torch optimizers (not ``capturable``, not ``fused``) keep ``state["step"]`` on the host
  and read it with ``.item()``: it never moves to the device.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Iterator, Optional

import torch

from chatlearn_mem.device_memory import storage_id

__all__ = [
    "FSDP_METHOD_PARTS",
    "OPTIMIZER_METHOD_PARTS",
    "ZERO_METHOD_PARTS",
    "ZeroBucketView",
    "bucket_storages_seen",
    "ddp_broadcasts_buffers",
    "ddp_rebuilt_buckets",
    "ddp_uses_bucket_views",
    "find_ddp",
    "fsdp_modules",
    "fsdp_param_of",
    "fsdp_params",
    "grad_accumulator",
    "host_scalar_state",
    "is_dtensor",
    "is_fsdp_module",
    "is_torch_ddp",
    "is_zero",
    "local_tensor",
    "megatron_optimizer",
    "optimizer_params",
    "reshard",
    "state_optimizer",
    "unsharded",
    "zero_bucket_tensors",
    "zero_bucket_views",
    "zero_layout_epoch",
    "zero_local_params",
    "zero_overlaps_ddp",
    "zero_partition",
    "zero_pending_broadcasts",
]


# -- what the trainer is -------------------------------------------------------------------------
def is_torch_ddp(model: Any) -> bool:
    """Whether ``model`` is torch's ``DistributedDataParallel``."""
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)


def find_ddp(model: Any) -> Optional[torch.nn.Module]:
    """``model`` when it is torch's DDP, else None."""
    return model if is_torch_ddp(model) else None


def is_fsdp_module(module: Any) -> bool:
    """Whether ``module`` was sharded by FSDP2's ``fully_shard``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(module, FSDPModule)


def is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding ``t``'s memory: a DTensor's local shard, else ``t`` itself."""
    return t._local_tensor if is_dtensor(t) else t


def megatron_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` looks like a megatron-core optimizer (a torch one inside ``.optimizer``)."""
    return not isinstance(optimizer, torch.optim.Optimizer) and isinstance(
        getattr(optimizer, "optimizer", None), torch.optim.Optimizer
    )


# -- torch DistributedDataParallel ------------------------------------------------------------------
def ddp_uses_bucket_views(ddp: torch.nn.Module) -> bool:
    """Whether DDP's ``param.grad`` s are views into its gradient buckets."""
    return bool(ddp.gradient_as_bucket_view)


def ddp_rebuilt_buckets(ddp: torch.nn.Module) -> bool:
    """Whether DDP has rebuilt its buckets (done once, in the forward of its second iteration)."""
    return bool(getattr(ddp, "_has_rebuilt_buckets", False))


def ddp_broadcasts_buffers(ddp: torch.nn.Module) -> bool:
    """Whether DDP's forward reads (broadcasts) the module's buffers before the module runs."""
    return bool(getattr(ddp, "broadcast_buffers", False)) and any(True for _ in ddp.module.buffers())


def ddp_syncs_in_backward(ddp: torch.nn.Module) -> bool:
    """Whether a forward with gradients enabled now makes DDP expect a backward (not in ``no_sync``)."""
    return bool(getattr(ddp, "require_backward_grad_sync", True))


def bucket_storages_seen(params: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The storages of the ``param.grad`` s defined now: DDP's buckets, when they are bucket views."""
    out: dict[int, torch.UntypedStorage] = {}
    for p in params:
        g = p.grad
        if g is not None:
            s = g.untyped_storage()
            out.setdefault(storage_id(s), s)
    return list(out.values())


def grad_accumulator(param: torch.Tensor) -> Any:
    """The live grad-accumulator node of a leaf parameter (the node DDP's reducer hooked)."""
    from torch.autograd.graph import get_gradient_edge

    return get_gradient_edge(param).node


# -- torch.distributed.optim.ZeroRedundancyOptimizer -------------------------------------------------
def is_zero(optimizer: Any) -> bool:
    try:
        from torch.distributed.optim import ZeroRedundancyOptimizer
    except ImportError:
        return False
    return isinstance(optimizer, ZeroRedundancyOptimizer)


def zero_overlaps_ddp(zero: Any) -> bool:
    return bool(zero._overlap_with_ddp)


def _zero_overlap_ready(zero: Any) -> bool:
    """Whether an overlapped ZeRO has built its buckets (after DDP's first iterations)."""
    from torch.distributed.optim.zero_redundancy_optimizer import _OverlapStatus

    return zero._overlap_info.status == _OverlapStatus.INITIALIZED


def state_optimizer(optimizer: Any) -> Any:
    """The optimizer whose ``state`` and ``param_groups`` hold this rank's state: ZeRO's local
    optimizer (functional with ``overlap_with_ddp``; none before that is initialized), else the
    optimizer itself."""
    if is_zero(optimizer):
        return getattr(optimizer, "optim", None)
    return optimizer


def optimizer_params(optimizer: Any) -> list[torch.Tensor]:
    """Every parameter the optimizer updates, on any rank (ZeRO: all partitions), each once."""
    seen: dict[int, torch.Tensor] = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            seen.setdefault(id(p), p)
    return list(seen.values())


def zero_partition(zero: Any) -> list[list[torch.Tensor]]:
    """``[rank] -> the parameters that rank's local optimizer updates`` (ZeRO's partition)."""
    return [[p for g in groups for p in g["params"]] for groups in zero._partition_parameters()]


def zero_local_params(zero: Any) -> Optional[list[torch.Tensor]]:
    """The parameters ZeRO's local optimizer holds now (None: not built yet, overlap mode)."""
    opt = getattr(zero, "optim", None)
    if opt is None:
        return None
    return [p for g in opt.param_groups for p in g["params"]]


def zero_rank(zero: Any) -> int:
    return int(zero.rank)


class ZeroBucketView:
    """A parameter that must view a ZeRO flat bucket at a fixed element offset."""

    __slots__ = ("label", "param", "bucket", "offset")

    def __init__(self, label: str, param: torch.Tensor, bucket: torch.Tensor, offset: int):
        self.label, self.param, self.bucket, self.offset = label, param, bucket, offset


def zero_bucket_tensors(zero: Any) -> list[tuple[str, torch.Tensor]]:
    """``(label, flat tensor)`` of ZeRO's parameter buckets (both modes), each a weights storage."""
    out = []
    for d, per_rank in enumerate(getattr(zero, "_buckets", None) or []):
        for r, bucket in enumerate(per_rank):
            out.append((f"ZeroRedundancyOptimizer._buckets[{d}][{r}]", bucket))
    if zero_overlaps_ddp(zero) and _zero_overlap_ready(zero):
        for r, assignments in enumerate(zero._bucket_assignments_per_rank):
            for b, a in assignments.items():
                if a.tensor is not None:
                    out.append((f"ZeroRedundancyOptimizer._bucket_assignments_per_rank[{r}][{b}].tensor", a.tensor))
    return out


def zero_bucket_views(zero: Any) -> list[ZeroBucketView]:
    """Every parameter ZeRO made a view of one of its buckets, with the offset it must have:
    ``parameters_as_bucket_view`` (trainable parameters of partition ``r`` on device ``d``, in
    partition order, in ``_buckets[d][r]``) or, overlapped and initialized, each bucket
    assignment's parameters in its ``tensor``."""
    out = []
    buckets = getattr(zero, "_buckets", None) or []
    if zero.parameters_as_bucket_view and not zero_overlaps_ddp(zero) and buckets:
        for d, (device, params_per_rank) in enumerate(zero._device_to_params_per_rank.items()):
            for r, params in enumerate(params_per_rank):
                offset = 0
                for p in params:
                    if not p.requires_grad:
                        continue
                    out.append(ZeroBucketView(f"_buckets[{d}][{r}]", p, buckets[d][r], offset))
                    offset += p.numel()
    if zero_overlaps_ddp(zero) and _zero_overlap_ready(zero):
        for r, assignments in enumerate(zero._bucket_assignments_per_rank):
            for b, a in assignments.items():
                offset = 0
                for p in a.parameters:
                    out.append(ZeroBucketView(f"_bucket_assignments_per_rank[{r}][{b}].tensor", p, a.tensor, offset))
                    offset += p.numel()
    return out


def zero_layout_epoch(zero: Any) -> tuple:
    """Changes when ZeRO rebuilt its buckets: the overlap's lazy build, or ``_build_param_buckets``
    after a change of trainability."""
    ready = zero_overlaps_ddp(zero) and _zero_overlap_ready(zero)
    return (ready, tuple(storage_id(t.untyped_storage()) for _, t in zero_bucket_tensors(zero)))


def zero_pending_broadcasts(zero: Any) -> int:
    """How many parameter broadcasts an overlapped ZeRO still has in flight."""
    if not zero_overlaps_ddp(zero):
        return 0
    return len(getattr(zero._overlap_info, "broadcast_handles", None) or [])


# -- FSDP2 -------------------------------------------------------------------------------------------
def fsdp_modules(root: torch.nn.Module) -> list[torch.nn.Module]:
    """Every module under ``root`` (itself included) that ``fully_shard`` sharded."""
    return [m for m in root.modules() if is_fsdp_module(m)]


def _param_groups_of(module: torch.nn.Module) -> list[Any]:
    return list(module._get_fsdp_state()._fsdp_param_groups)


def fsdp_params(root: torch.nn.Module) -> list[Any]:
    """Every ``FSDPParam`` under ``root``, each once, in module order."""
    out, seen = [], set()
    for m in fsdp_modules(root):
        for g in _param_groups_of(m):
            for fp in g.fsdp_params:
                if id(fp) not in seen:
                    seen.add(id(fp))
                    out.append(fp)
    return out


def fsdp_param_of(fp: Any) -> torch.nn.Parameter:
    """The sharded parameter (a DTensor) of an ``FSDPParam``: what the optimizer updates."""
    return fp.sharded_param


def fsdp_sharded_data(fp: Any) -> torch.Tensor:
    """The padded 1-D local shard an ``FSDPParam``'s sharded parameter narrows."""
    return fp._sharded_param_data


def fsdp_slots(fp: Any) -> list[tuple[torch.nn.Module, str]]:
    """``(module, attribute)`` where an ``FSDPParam``'s parameter is registered (shared ones too)."""
    info = fp._module_info
    return [(info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names)]


def fsdp_unsharded_buffers(fp: Any) -> list[torch.Tensor]:
    """The unsharded parameter's memory (FSDP2 allocates and frees it itself)."""
    return list(fp.all_gather_outputs)


def unsharded(root: torch.nn.Module) -> list[torch.nn.Module]:
    """The FSDP modules whose parameters are unsharded now (all-gathered, FSDP2's memory)."""
    return [m for m in fsdp_modules(root) if any(not g.is_sharded for g in _param_groups_of(m))]


def fsdp_busy(root: torch.nn.Module) -> list[str]:
    """FSDP modules inside a forward or backward (their training state is not idle)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    out = []
    for m in fsdp_modules(root):
        for g in _param_groups_of(m):
            if g._training_state != TrainingState.IDLE:
                out.append(f"{type(m).__name__} in {g._training_state.name}")
    return out


def reshard(modules: Iterable[torch.nn.Module]) -> None:
    """Free FSDP2's unsharded parameters of ``modules`` (its public ``reshard()``)."""
    for m in modules:
        m.reshard()


# -- torch optimizers -------------------------------------------------------------------------------
def host_scalar_state(optimizer: Any, key: str) -> bool:
    """Whether a state entry is one torch keeps on the host by design: ``step`` of an eager
    optimizer (not ``capturable``, not ``fused``), read with ``.item()`` every step. Moving it to
    the device costs a device-to-host sync per parameter per step (UniRL #441)."""
    if key != "step":
        return False
    groups = getattr(optimizer, "param_groups", None) or []
    defaults = getattr(optimizer, "defaults", None) or {}
    return not any(g.get("capturable") or g.get("fused") for g in groups) and not (
        defaults.get("capturable") or defaults.get("fused")
    )


def state_entries(optimizer: Any) -> Iterator[tuple[torch.Tensor, str, torch.Tensor]]:
    """``(parameter, key, tensor)`` of every tensor in the optimizer's state."""
    if optimizer is None:
        return
    for p, state in optimizer.state.items():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                yield p, k, v


OPTIMIZER_METHOD_PARTS = {
    # a state dict references the state tensors (a save then reads them); a load replaces them
    "state_dict": ("optimizer_states",),
    "load_state_dict": ("optimizer_states",),
}
"""torch optimizer methods the manager guards (by part name) -> the parts they read or write."""

ZERO_METHOD_PARTS = {
    "consolidate_state_dict": ("optimizer_states",),  # broadcasts every rank's local state
    "state_dict": ("optimizer_states",),
    "load_state_dict": ("optimizer_states", "weights"),
}
"""ZeroRedundancyOptimizer methods the manager guards -> parts."""

FSDP_METHOD_PARTS = {"unshard": ("weights",)}
"""FSDP2 module methods the manager guards -> parts (``unshard`` all-gathers the sharded weights)."""


def storage_ref(storage: torch.UntypedStorage) -> "weakref.ref[torch.UntypedStorage]":
    """A weak reference to a storage (it dies with the storage: DDP's rebuilt buckets free theirs)."""
    return weakref.ref(storage)
