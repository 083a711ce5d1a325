"""Everything chatlearn-mem knows about megatron-core's private structures, in one place.

One function per question ("which buffers hold the params?", "which tensors are the fp32 main
weights?"). The managers and the audit ask these functions and never spell a megatron attribute
themselves, so supporting a new megatron-core release means changing ``mcore/`` only: this module
(the buffers, optimizers and guarded methods), :mod:`~chatlearn_mem.mcore.transient` (what else
megatron keeps on the device) and :mod:`~chatlearn_mem.mcore.checkpointing` (dist_checkpointing).

Supported: megatron-core 0.13 to 0.19 (tested: 0.13.1, 0.14.0, 0.15.3, 0.16.1, 0.17.1, 0.18.2,
0.19.2; 0.17+ need Python 3.12). Facts relied on,
true for all of them:

* ``DistributedDataParallel.buffers`` and ``.expert_parallel_buffers`` hold one
  ``_ParamAndGradBuffer`` per (param dtype, grad dtype). ``grad_data`` is always allocated;
  ``param_data`` only with the distributed optimizer. ``param_index_map[param]`` is
  ``(start, end, bucket_id)`` in elements; ``param.data`` (when ``param_data`` exists) and
  ``param.main_grad`` are views at ``start``. With fp32 local accumulation (0.17+) a matching
  param's ``main_grad`` is a separate fp32 tensor kept in the buffer's ``extra_main_grads`` and its
  view at ``start`` is ``main_grad_copy_in_grad_buffer``.
* Buckets hold ``param_data`` / ``grad_data`` views at ``bucket.offset``. Bucket groups (0.14+)
  cache shard views in ``cached_param_buffer_shard_list`` / ``cached_grad_buffer_shard_list``.
* DDP registers one hook per trainable parameter on ``param.expand_as(param).grad_fn
  .next_functions[0][0]`` and keeps the nodes in ``grad_accs``.
* The public DDP and optimizer methods in ``DDP_METHOD_PARTS`` / ``OPTIMIZER_METHOD_PARTS`` touch
  the storages of the parts listed there; megatron offers no hook before them, so the trainer
  manager wraps them per instance (:func:`chatlearn_mem.guards.guard_methods`) and unwraps them in
  ``close()``.
* ``get_megatron_optimizer`` returns a ``ChainedOptimizer`` of ``DistributedOptimizer``,
  ``Float16OptimizerWithFloat16Params`` or ``FP32Optimizer``; each wraps a torch optimizer in
  ``.optimizer`` whose state is created lazily on the first step.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch

from chatlearn_mem.errors import UnsupportedLayoutError
from chatlearn_mem.parts import Part

__all__ = [
    "SUPPORTED_VERSIONS",
    "TESTED_VERSIONS",
    "INSTALL_HINT",
    "BufferLayout",
    "ShardView",
    "check_supported_version",
    "ddp_chunks",
    "grad_buffer_view",
    "local_main_grad",
    "ddp_buffers",
    "bucket_views",
    "bucket_groups",
    "cached_shard_views",
    "pending_communication",
    "grad_accumulators",
    "grad_accumulator",
    "module_buffers",
    "leaf_optimizers",
    "torch_optimizer",
    "main_weights",
    "expected_param_groups",
    "shard_views",
    "module_buffer_slots",
    "derived_grads",
    "clear_derived_grads",
    "megatron_core_version",
    "megatron_core_release",
    "DDP_METHOD_PARTS",
    "OPTIMIZER_METHOD_PARTS",
    "main_grad",
]

SUPPORTED_VERSIONS = ((0, 13), (0, 19))
"""Inclusive (major, minor) range of megatron-core releases the manager supports."""
TESTED_VERSIONS = ("0.13.1", "0.14.0", "0.15.3", "0.16.1", "0.17.1", "0.18.2", "0.19.2")
"""Releases the suite has passed on; CI runs 0.13.1 and 0.16.1 (Python 3.11) and 0.19.2 (Python 3.12)."""
INSTALL_HINT = "pip install 'megatron-core>=0.13,<0.20' (0.17 and newer need Python 3.12)"


def megatron_core_version() -> str:
    """The installed megatron-core version string."""
    try:
        from megatron.core.package_info import __version__
    except ImportError as e:
        raise UnsupportedLayoutError(f"megatron-core is not installed; install it with: {INSTALL_HINT}") from e
    # 0.19 appends the short hash of the git checkout in the *current directory* ("0.19.2+41a04a1"),
    # which names the user's repository, not megatron's build
    return __version__.split("+")[0]


def megatron_core_release(version: Optional[str] = None) -> tuple[int, int]:
    """``(major, minor)`` of ``version`` (default: the installed megatron-core's), e.g. ``(0, 16)``.

    Raises:
        ValueError: ``version`` does not start with two numbers.
    """
    major, minor = (version or megatron_core_version()).split(".")[:2]
    return int(major), int(minor)


def check_supported_version(version: Optional[str] = None) -> str:
    """Raise :class:`UnsupportedLayoutError` unless megatron-core is in the supported range."""
    version = version or megatron_core_version()
    try:
        major_minor = megatron_core_release(version)
    except ValueError:
        major_minor = None
    lo, hi = SUPPORTED_VERSIONS
    if major_minor is None or not lo <= major_minor <= hi:
        raise UnsupportedLayoutError(
            f"megatron-core {version} is not supported: chatlearn-mem supports megatron-core "
            f"{lo[0]}.{lo[1]} to {hi[0]}.{hi[1]} (tested {', '.join(TESTED_VERSIONS)}). "
            f"Install one with: {INSTALL_HINT}"
        )
    return version


def ddp_chunks(model: Any) -> list[torch.nn.Module]:
    """The megatron DDP-wrapped model chunks of ``model`` (one chunk or a list of them)."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if not chunks:
        raise ValueError("model must be a megatron DistributedDataParallel chunk or a non-empty list of them")
    for i, c in enumerate(chunks):
        if not (hasattr(c, "buffers") and hasattr(c, "grad_accs") and hasattr(c, "module")):
            raise TypeError(
                f"model chunk {i} is a {type(c).__name__}, not megatron.core.distributed."
                "DistributedDataParallel; wrap it with DistributedDataParallel(config, ddp_config, module) "
                "or use InferenceMemoryManager for a model without an optimizer"
            )
    return chunks


@dataclass
class BufferLayout:
    """One ``_ParamAndGradBuffer`` of one chunk, as the audit and managers need it."""

    label: str
    param_data: Optional[torch.Tensor]
    grad_data: torch.Tensor
    param_offsets: dict  # param -> (start, end) in elements
    buffer: Any
    extra_main_grads: list = field(default_factory=list)  # fp32 main_grads outside grad_data (0.17+)


def ddp_buffers(chunk: torch.nn.Module, chunk_index: int = 0) -> list[BufferLayout]:
    """Every param-and-grad buffer of a DDP chunk, dense and expert-parallel."""
    out = []
    for kind in ("buffers", "expert_parallel_buffers"):
        for i, buf in enumerate(getattr(chunk, kind, None) or []):
            offsets = {p: (int(v[0]), int(v[1])) for p, v in buf.param_index_map.items()}
            label = f"chunk{chunk_index}.{kind}[{i}]({_dtype_name(buf.param_dtype)}/{_dtype_name(buf.grad_dtype)})"
            out.append(
                BufferLayout(
                    label,
                    buf.param_data,
                    buf.grad_data,
                    offsets,
                    buf,
                    list(getattr(buf, "extra_main_grads", None) or []),
                )
            )
    return out


def grad_buffer_view(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The view of the grad buffer a param's gradient is reduced in.

    Usually ``param.main_grad``. With DDP's ``param_name_patterns_for_fp32_local_accumulation``
    (0.17+) a matching param accumulates into a separate fp32 ``main_grad`` (listed in the
    buffer's ``extra_main_grads``) and its buffer view is ``main_grad_copy_in_grad_buffer``.
    """
    view = getattr(param, "main_grad_copy_in_grad_buffer", None)
    return view if view is not None else getattr(param, "main_grad", None)


def local_main_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The separate fp32 ``main_grad`` of a param with fp32 local accumulation (0.17+), else None."""
    if getattr(param, "main_grad_copy_in_grad_buffer", None) is None:
        return None
    return getattr(param, "main_grad", None)


def bucket_views(buf: BufferLayout) -> list[tuple[str, torch.Tensor, torch.Tensor, int]]:
    """``(label, view, base, element offset in base)`` of each bucket's param and grad views."""
    out = []
    for b in buf.buffer.buckets:
        if b.param_data is not None and buf.param_data is not None:
            out.append((f"{buf.label}.bucket{b.bucket_id}.param_data", b.param_data, buf.param_data, b.offset))
        out.append((f"{buf.label}.bucket{b.bucket_id}.grad_data", b.grad_data, buf.grad_data, b.offset))
    return out


def bucket_groups(chunks: Iterable[torch.nn.Module], optimizer: Any = None) -> list[Any]:
    """Bucket groups of the DDP chunks and the distributed optimizers' own copies of them."""
    groups = []
    for c in chunks:
        groups += list(getattr(c, "bucket_groups", None) or [])
        groups += list(getattr(c, "expert_parallel_bucket_groups", None) or [])
    for leaf in leaf_optimizers(optimizer) if optimizer is not None else []:
        for gs in (getattr(leaf, "per_model_bucket_groups", None) or {}).values():
            groups += list(gs)
    return groups


def cached_shard_views(group: Any) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(label, cached shard, bucket tensor it must view)`` for the cached shard lists (0.14+)."""
    out = []
    for attr, kind in (
        ("cached_param_buffer_shard_list", "param_data"),
        ("cached_grad_buffer_shard_list", "grad_data"),
    ):
        for bucket, shards in zip(group.buckets, getattr(group, attr, None) or []):
            for r, shard in enumerate(shards or []):
                if shard is not None:
                    out.append((f"bucket{bucket.bucket_id}.{attr}[{r}]", shard, getattr(bucket, kind)))
    return out


def pending_communication(group: Any) -> list[str]:
    """Names of the asynchronous collectives a bucket group still has in flight."""
    return [h for h in ("grad_reduce_handle", "param_gather_handle") if getattr(group, h, None) is not None]


def overlaps_param_gather(chunk: torch.nn.Module) -> bool:
    """Whether a DDP chunk all-gathers its params from forward pre-hooks (``overlap_param_gather``):
    a module's pre-hook then reads and writes whole buckets, other modules' params included."""
    return bool(getattr(getattr(chunk, "ddp_config", None), "overlap_param_gather", False))


def module_buffers(chunk: torch.nn.Module) -> list[torch.Tensor]:
    """Module buffers of a DDP chunk (DDP's own ``buffers`` attribute shadows ``Module.buffers``)."""
    return list(torch.nn.Module.buffers(chunk.module))


def module_buffer_slots(chunk: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """``(module, name)`` of every module buffer of a DDP chunk, found once: read the buffer
    itself with ``getattr(module, name)`` each time, so a buffer a module reassigns is followed
    while the module tree (fixed once DDP wraps the model) is not walked again."""
    return [(m, name) for m in chunk.module.modules() for name, _ in m.named_buffers(recurse=False)]


def grad_accumulators(chunk: torch.nn.Module) -> list[Any]:
    """The grad-accumulator nodes DDP registered its backward hooks on."""
    return list(chunk.grad_accs)


def grad_accumulator(param: torch.Tensor) -> Any:
    """The live grad-accumulator node of a leaf parameter (the node DDP hooks).

    The same node as DDP's ``param.expand_as(param).grad_fn.next_functions[0][0]``, found without
    creating a view, which would fail while the parameter's storage is released.
    """
    from torch.autograd.graph import get_gradient_edge

    return get_gradient_edge(param).node


def grad_hook_slots(chunk: torch.nn.Module) -> list[tuple[torch.nn.Parameter, int]]:
    """``(param, index in DDP's grad_accs)`` of each trainable parameter whose live grad-accumulator
    node is the one DDP hooked: what :func:`rehook_grad_accumulators` repairs later."""
    index = {id(a): i for i, a in enumerate(grad_accumulators(chunk))}
    out = []
    for p in chunk.module.parameters():
        i = index.get(id(grad_accumulator(p))) if p.requires_grad else None
        if i is not None:
            out.append((p, i))
    return out


def rehook_grad_accumulators(chunk: torch.nn.Module, slots: list[tuple[torch.nn.Parameter, int]]) -> int:
    """Register DDP's gradient hook again on each parameter of ``slots`` (:func:`grad_hook_slots`)
    whose grad-accumulator node torch has replaced, and put the new node in ``grad_accs``.

    Torch drops a leaf's accumulator node when its ``.data`` is set to a tensor of another device
    or dtype (``param.data = param.data.cpu()``, as some offload schemes do): DDP's hook stays on the
    dropped node, and the parameter's gradient is then never reduced into its grad buffer.
    Returns how many parameters were hooked again (0: nothing had been dropped)."""
    n = 0
    accs = chunk.grad_accs
    for p, i in slots:
        node = grad_accumulator(p)
        if node is not accs[i]:
            node.register_hook(chunk._make_backward_post_hook(p))
            accs[i] = node
            n += 1
    return n


def leaf_optimizers(optimizer: Any) -> list[Any]:
    """The megatron optimizers inside ``optimizer``, with ChainedOptimizers flattened."""
    if hasattr(optimizer, "chained_optimizers"):
        return [leaf for o in optimizer.chained_optimizers for leaf in leaf_optimizers(o)]
    if not hasattr(optimizer, "optimizer") or not isinstance(optimizer.optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer is a {type(optimizer).__name__}, not a megatron-core optimizer; build it with "
            "megatron.core.optimizer.get_megatron_optimizer(config, model_chunks)"
        )
    return [optimizer]


def torch_optimizer(leaf: Any) -> torch.optim.Optimizer:
    """The torch optimizer a megatron optimizer steps (holds ``param_groups`` and ``state``)."""
    return leaf.optimizer


def main_weights(leaf: Any) -> list[torch.Tensor]:
    """The fp32 main weights a megatron optimizer keeps beside 16-bit model params."""
    groups = getattr(leaf, "shard_fp32_from_float16_groups", None)  # DistributedOptimizer
    if groups is None:
        groups = getattr(leaf, "fp32_from_float16_groups", None)  # Float16OptimizerWithFloat16Params
    return [t for g in groups or [] for t in g]


def expected_param_groups(leaf: Any) -> Optional[list[list[torch.Tensor]]]:
    """The tensors each torch ``param_group`` must hold, group by group (None: model params)."""
    if hasattr(leaf, "shard_fp32_from_float16_groups"):
        return [list(a) + list(b) for a, b in zip(leaf.shard_fp32_groups, leaf.shard_fp32_from_float16_groups)]
    if hasattr(leaf, "fp32_from_float16_groups"):
        return [list(a) + list(b) for a, b in zip(leaf.fp32_from_fp32_groups, leaf.fp32_from_float16_groups)]
    return None


@dataclass
class ShardView:
    """A distributed-optimizer shard that must view a model param at a fixed range."""

    label: str
    shard: torch.Tensor
    param: torch.Tensor
    start: int  # element offset inside the flattened param
    numel: int


def shard_views(leaf: Any) -> list[ShardView]:
    """Every shard tensor of a DistributedOptimizer that views a model param (empty otherwise)."""
    if not hasattr(leaf, "shard_float16_groups"):
        return []
    out = []
    for kind, model_groups, shard_groups in (
        ("shard_float16_groups", leaf.model_float16_groups, leaf.shard_float16_groups),
        ("shard_fp32_groups", leaf.model_fp32_groups, leaf.shard_fp32_groups),
    ):
        for gi, (params, shards) in enumerate(zip(model_groups, shard_groups)):
            for pi, (param, shard) in enumerate(zip(params, shards)):
                gbuf_index, dtype, bucket_index = leaf.model_param_gbuf_map[param]
                rng = leaf.gbuf_ranges[gbuf_index][dtype][bucket_index]["param_map"][param]["param"]
                out.append(ShardView(f"{kind}[{gi}][{pi}]", shard, param, int(rng.start), int(rng.size)))
    return out


def main_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The gradient view megatron's DDP keeps on a parameter (into the grad buffer), or None."""
    return getattr(param, "main_grad", None)


def derived_grads(leaf: Any) -> list[torch.Tensor]:
    """The ``.grad`` tensors the optimizer derived from ``main_grad`` (set before each step)."""
    with warnings.catch_warnings():  # fp32 shards are non-leaf views; reading .grad warns
        warnings.simplefilter("ignore")
        return [t.grad for t in _grad_holders(leaf) if t.grad is not None]


def clear_derived_grads(leaf: Any) -> None:
    """Drop them, as ``optimizer.zero_grad(set_to_none=True)`` does; the next step recreates them."""
    for t in _grad_holders(leaf):
        t.grad = None


def _grad_holders(leaf: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for attr in (
        "shard_fp32_groups",
        "shard_fp32_from_float16_groups",
        "shard_float16_groups",
        "fp32_from_float16_groups",
        "fp32_from_fp32_groups",
        "float16_groups",
    ):
        out += [t for g in getattr(leaf, attr, None) or [] for t in g]
    for group in torch_optimizer(leaf).param_groups:
        out += list(group["params"])
    return out


# -- the megatron calls the trainer manager guards --------------------------------------------------
# megatron offers no hook before these methods; each touches the storages of the parts listed, so
# the manager wraps them per instance (guard_methods) to raise before anything is read or written.
DDP_METHOD_PARTS: dict[str, tuple[Part, ...]] = {
    "zero_grad_buffer": (Part.GRADS,),  # zeroes grad_data
    "start_grad_sync": (Part.GRADS,),  # reduce(-scatter) of grad_data
    "finish_grad_sync": (Part.GRADS,),
    "scale_gradients": (Part.GRADS,),
    "start_param_sync": (Part.WEIGHTS,),  # all-gather into param_data
    "broadcast_params": (Part.WEIGHTS,),
    "sharded_state_dict": (Part.WEIGHTS,),  # dist-checkpointing reads the params when it saves
    "state_dict_for_save_checkpoint": (Part.WEIGHTS,),
}
"""``DistributedDataParallel`` methods (and the model chunk's ``sharded_state_dict``) -> the parts
they touch. ``state_dict`` / ``load_state_dict`` and forward are guarded with torch's own hooks."""

_OPTIMIZER_PARTS = (Part.MAIN_WEIGHTS, Part.OPTIMIZER_STATES)
OPTIMIZER_METHOD_PARTS: dict[str, tuple[Part, ...]] = {
    # prepare_grads reads main_grad and the params, the torch step the states and main weights,
    # then the main weights are copied into the params: all four, before megatron starts
    "step": (Part.MAIN_WEIGHTS, Part.OPTIMIZER_STATES, Part.WEIGHTS, Part.GRADS),
    "state_dict": _OPTIMIZER_PARTS,  # references (Float16) or reads (distributed: step counts) states
    "sharded_state_dict": _OPTIMIZER_PARTS + (Part.WEIGHTS,),
    "load_state_dict": _OPTIMIZER_PARTS + (Part.WEIGHTS,),  # writes states, may reload model params
    # megatron-core's own optimizer offload (0.16+) copies every CUDA param-group and state tensor
    # with .cpu(): from released storages that would read freed memory
    "offload_to_cpu": _OPTIMIZER_PARTS,
    "restore_from_cpu": _OPTIMIZER_PARTS,
}
"""Megatron optimizer methods (outer ``ChainedOptimizer`` or leaf) -> the parts they touch."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
