"""Everything chatlearn-mem knows about megatron-core's private structures, in one place.

One function per question ("which buffers hold the params?", "which tensors are the fp32 main
weights?"). The managers and the audit ask these functions and never spell a megatron attribute
themselves, so supporting a new megatron-core release means changing this file only.

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
  manager wraps them per instance (:func:`guard_methods`) and unwraps them in ``close()``.
* ``get_megatron_optimizer`` returns a ``ChainedOptimizer`` of ``DistributedOptimizer``,
  ``Float16OptimizerWithFloat16Params`` or ``FP32Optimizer``; each wraps a torch optimizer in
  ``.optimizer`` whose state is created lazily on the first step.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch

from chatlearn_mem.errors import UnsupportedLayoutError
from chatlearn_mem.parts import Part

__all__ = [
    "SUPPORTED_VERSIONS", "TESTED_VERSIONS", "INSTALL_HINT", "BufferLayout", "ShardView",
    "check_supported_version", "ddp_chunks", "grad_buffer_view", "local_main_grad",
    "ddp_buffers", "bucket_views", "bucket_groups", "cached_shard_views", "pending_communication",
    "grad_accumulators", "grad_accumulator", "module_buffers", "leaf_optimizers", "torch_optimizer", "main_weights",
    "expected_param_groups", "shard_views", "module_buffer_slots", "derived_grads", "clear_derived_grads", "megatron_core_version",
    "pipeline_input_modules", "pipeline_input_tensors", "clear_pipeline_input_tensors", "global_memory_buffer_tensors",
    "is_moe_token_dispatcher", "is_transformer_engine_module", "is_distributed_optimizer", "transformer_engine_global_tensors",
    "DDP_METHOD_PARTS", "OPTIMIZER_METHOD_PARTS", "main_grad", "MethodGuard", "guard_methods", "dist_checkpointing_save_kwargs",
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


def check_supported_version(version: Optional[str] = None) -> str:
    """Raise :class:`UnsupportedLayoutError` unless megatron-core is in the supported range."""
    version = version or megatron_core_version()
    try:
        major_minor = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        major_minor = None
    lo, hi = SUPPORTED_VERSIONS
    if major_minor is None or not lo <= major_minor <= hi:
        raise UnsupportedLayoutError(
            f"megatron-core {version} is not supported: chatlearn-mem supports megatron-core "
            f"{lo[0]}.{lo[1]} to {hi[0]}.{hi[1]} (tested {', '.join(TESTED_VERSIONS)}). "
            f"Install one with: {INSTALL_HINT}")
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
                "or use InferenceMemoryManager for a model without an optimizer")
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
            out.append(BufferLayout(label, buf.param_data, buf.grad_data, offsets, buf,
                                    list(getattr(buf, "extra_main_grads", None) or [])))
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
    for attr, kind in (("cached_param_buffer_shard_list", "param_data"),
                       ("cached_grad_buffer_shard_list", "grad_data")):
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


def leaf_optimizers(optimizer: Any) -> list[Any]:
    """The megatron optimizers inside ``optimizer``, with ChainedOptimizers flattened."""
    if hasattr(optimizer, "chained_optimizers"):
        return [leaf for o in optimizer.chained_optimizers for leaf in leaf_optimizers(o)]
    if not hasattr(optimizer, "optimizer") or not isinstance(optimizer.optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer is a {type(optimizer).__name__}, not a megatron-core optimizer; build it with "
            "megatron.core.optimizer.get_megatron_optimizer(config, model_chunks)")
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
            ("shard_fp32_groups", leaf.model_fp32_groups, leaf.shard_fp32_groups)):
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
    for attr in ("shard_fp32_groups", "shard_fp32_from_float16_groups", "shard_float16_groups",
                 "fp32_from_float16_groups", "fp32_from_fp32_groups", "float16_groups"):
        out += [t for g in getattr(leaf, attr, None) or [] for t in g]
    for group in torch_optimizer(leaf).param_groups:
        out += list(group["params"])
    return out


def pipeline_input_modules(chunk: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of a chunk that can hold an activation from the pipeline schedule: megatron's
    ``TransformerBlock.set_input_tensor`` (called before every forward) stores the previous
    stage's output in ``input_tensor``. Walk the tree once and keep the list (megatron builds no
    modules after DDP wraps the model): a walk costs ~1 ms on a 12-layer model."""
    return [m for m in chunk.modules() if hasattr(m, "set_input_tensor")]


def pipeline_input_tensors(modules: Iterable[torch.nn.Module]) -> list[torch.Tensor]:
    """Activations megatron's pipeline schedule left on a chunk: the last micro batch's input
    from the previous stage (``TransformerBlock.input_tensor``) and its ``.grad``.

    Args:
        modules: What :func:`pipeline_input_modules` returned for the chunk.
    """
    out = []
    for m in modules:
        t = vars(m).get("input_tensor")
        if isinstance(t, torch.Tensor):
            out.append(t)
            if t.grad is not None:
                out.append(t.grad)
    return out


def clear_pipeline_input_tensors(modules: Iterable[torch.nn.Module]) -> None:
    """Drop them (the schedule sets a fresh one before every forward)."""
    for m in modules:
        if "input_tensor" in vars(m):
            m.input_tensor = None


def global_memory_buffer_tensors() -> list[tuple[str, torch.Tensor]]:
    """``(label, tensor)`` of megatron's global memory buffer (``parallel_state``'s
    ``GlobalMemoryBuffer``: scratch space kept between steps, e.g. for sequence-parallel
    all-gathers); empty when megatron is not imported or the buffer was never created."""
    import sys

    ps = sys.modules.get("megatron.core.parallel_state")
    gmb = getattr(ps, "_GLOBAL_MEMORY_BUFFER", None) if ps is not None else None
    entries = getattr(gmb, "buffer", None) or {}
    return [(f"global_memory_buffer[{k!r}]", t) for k, t in entries.items() if isinstance(t, torch.Tensor)]


def is_moe_token_dispatcher(obj: Any) -> bool:
    """Whether ``obj`` is one of megatron's MoE token dispatchers (they keep the last batch's
    routing tensors between forward passes)."""
    import sys

    mod = sys.modules.get("megatron.core.transformer.moe.token_dispatcher")
    base = getattr(mod, "MoETokenDispatcher", None) if mod is not None else None
    return base is not None and isinstance(obj, base)


_TE_MODULES = ("transformer_engine.pytorch.module.base", "transformer_engine.pytorch.fp8",
               "transformer_engine.pytorch.quantization")


def is_transformer_engine_module(obj: Any) -> bool:
    """Whether ``obj`` is a Transformer Engine module (its non-parameter tensors are TE's: FP8
    scales and amax histories, workspaces). False when TE was never imported."""
    import sys

    mod = sys.modules.get("transformer_engine.pytorch.module.base")
    base = getattr(mod, "TransformerEngineBaseModule", None) if mod is not None else None
    return base is not None and isinstance(obj, base)


def transformer_engine_global_tensors() -> list[tuple[str, Any]]:
    """``(label, object)`` of what Transformer Engine keeps in module globals and class attributes
    (the cuBLAS workspaces, FP8 global state); walk them to find their tensors. Empty when TE was
    never imported (it is not imported here: a model that uses TE has imported it already)."""
    import sys

    out = []
    for name in _TE_MODULES:
        mod = sys.modules.get(name)
        if mod is None:
            continue
        for key, value in vars(mod).items():
            if key.startswith("__"):
                continue
            if isinstance(value, type) and value.__module__ == name:  # e.g. FP8GlobalStateManager
                out += [(f"{name}.{key}.{k}", v) for k, v in vars(value).items() if not k.startswith("__")]
            else:
                out.append((f"{name}.{key}", value))
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


class MethodGuard:
    """One method of one object wrapped per instance so that ``check`` runs first.

    The wrapper is stored in the instance's ``__dict__``, where attribute lookup finds it before
    the class's method; :meth:`remove` deletes it again (and restores an instance attribute it
    shadowed). Callers that looked the method up *before* the wrapping (a bound method megatron's
    pipeline config captured) keep calling the original.
    """

    def __init__(self, obj: Any, name: str, check: Callable[[], None]):
        self.obj, self.name = obj, name
        d = vars(obj)
        self._had, self._previous = name in d, d.get(name)
        original = getattr(obj, name)

        @functools.wraps(original)
        def guarded(*args, **kwargs):
            check()
            return original(*args, **kwargs)

        self.wrapper = guarded
        object.__setattr__(obj, name, guarded)

    def remove(self) -> None:
        d = vars(self.obj)
        if d.get(self.name) is not self.wrapper:
            return  # wrapped again by someone else since; the check is a no-op once the manager closes
        if self._had:
            object.__setattr__(self.obj, self.name, self._previous)
        else:
            del d[self.name]


def guard_methods(obj: Any, table: dict[str, tuple[Part, ...]],
                  check: Callable[[str, tuple[Part, ...]], None]) -> list[MethodGuard]:
    """Wrap each method of ``table`` that ``obj`` has so that ``check("Type.method()", parts)``
    runs before it; returns the guards (``remove()`` each to undo)."""
    guards = []
    for name, parts in table.items():
        if not callable(getattr(type(obj), name, None)):
            continue
        what = f"{type(obj).__name__}.{name}()"
        guards.append(MethodGuard(obj, name, functools.partial(check, what, parts)))
    return guards


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# -- checkpoints (megatron-core's dist_checkpointing) -------------------------------------------------
def is_distributed_optimizer(leaf: Any) -> bool:
    """Whether a leaf optimizer is megatron's ``DistributedOptimizer`` (state sharded over data parallel)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(leaf, DistributedOptimizer)


def distrib_optimizer_sharding(leaves: list[Any], resharding: bool = True) -> str:
    """The distributed optimizer's checkpoint format.

    ``resharding=True``: a format that reshards across tensor- and data-parallel sizes:
    ``fully_reshardable`` where megatron-core has it (0.14+; there ``fully_sharded_model_space``
    refuses to save: "ShardedTensor.flattened_range is not supported"), else
    ``fully_sharded_model_space`` (0.13). ``fully_reshardable`` copies (gathers) the whole
    optimizer state into new model-space tensors while the save is planned.

    ``resharding=False``: ``dp_reshardable`` (0.14+): the optimizer's own buffers, no copy, data
    parallel resharding only. megatron-core 0.13's equivalent (``fully_sharded_bucket_space``)
    fails on torch Adam's scalar ``step``, so it is refused there.

    Loading either with torch's Adam needs :func:`loading_optimizer_steps_compat`."""
    if not resharding:
        if not any(hasattr(leaf, "sharded_param_state_dp_reshardable") for leaf in leaves):
            raise UnsupportedLayoutError(
                f"resharding=False needs megatron-core 0.14 or newer (found {megatron_core_version()}); "
                "use resharding=True")
        return "dp_reshardable"
    if any(hasattr(leaf, "sharded_param_state_fully_reshardable") for leaf in leaves):
        return "fully_reshardable"
    return "fully_sharded_model_space"


@contextlib.contextmanager
def loading_optimizer_steps_compat(leaves: list[Any]):
    """While loading a distributed optimizer's checkpoint with torch's Adam (no Apex or
    Transformer Engine, as on the CPU backend): megatron's ``load_state_dict`` puts a ``step``
    entry into every optimizer state, then ``_set_main_param_and_optimizer_states`` copies every
    state key from the checkpoint's per-parameter tensors, which hold no ``step``
    (``KeyError: 'step'``, megatron-core 0.13 to 0.16, every format). Each leaf's method is
    wrapped per instance for the duration to keep the state's own ``step`` (the step counts are
    restored separately, see :func:`set_optimizer_steps`)."""
    guards = []
    for leaf in leaves:
        original = getattr(leaf, "_set_main_param_and_optimizer_states", None)
        if original is None or not hasattr(leaf, "model_param_group_index_map"):
            continue

        def keep_step(model_param, tensors, leaf=leaf, original=original):
            if "step" not in tensors:
                group_index, group_order = leaf.model_param_group_index_map[model_param]
                main_param = leaf.optimizer.param_groups[group_index]["params"][group_order]
                state = leaf.optimizer.state.get(main_param, {})
                if "step" in state:
                    tensors = {**tensors, "step": state["step"]}
            return original(model_param, tensors)

        object.__setattr__(leaf, "_set_main_param_and_optimizer_states", keep_step)
        guards.append(leaf)
    try:
        yield
    finally:
        for leaf in guards:
            del vars(leaf)["_set_main_param_and_optimizer_states"]


def checkpoint_read_tensors(chunks: list[torch.nn.Module], leaves: list[Any]) -> list[torch.Tensor]:
    """Every tensor object megatron reads (or references) while building the model's and the
    optimizers' ``sharded_state_dict``: parameters and module buffers, the optimizers' main
    weights and shard views of the params, the torch ``param_groups`` tensors and the state
    tensors. Each once, in a fixed order."""
    seen: dict[int, torch.Tensor] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor):
            seen.setdefault(id(t), t)

    for c in chunks:
        for p in c.parameters():
            add(p)
        for b in module_buffers(c):
            add(b)
    for leaf in leaves:
        for t in main_weights(leaf):
            add(t)
        for v in shard_views(leaf):
            add(v.shard)
        for attr in ("float16_groups", "fp32_from_fp32_groups", "fp32_from_float16_groups"):
            for g in getattr(leaf, attr, None) or []:
                for t in g:
                    add(t)
        opt = torch_optimizer(leaf)
        for group in opt.param_groups:
            for t in group["params"]:
                add(t)
        for state in opt.state.values():
            for v in state.values():
                add(v)
    return list(seen.values())


def _with_chunks(chunks: list[torch.nn.Module], build: Callable[[torch.nn.Module], Any]) -> dict:
    """``{"model": build(chunk)}``, or ``{"model0": ..., "model1": ...}`` with megatron's virtual
    pipeline rank set per chunk (the naming megatron's own training loop uses)."""
    if len(chunks) == 1:
        return {"model": build(chunks[0])}
    from megatron.core import parallel_state

    out = {}
    previous = parallel_state.get_virtual_pipeline_model_parallel_rank()
    try:
        for i, c in enumerate(chunks):
            parallel_state.set_virtual_pipeline_model_parallel_rank(i)
            out[f"model{i}"] = build(c)
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_rank(previous)
    return out


def model_sharded_state_dict(chunks: list[torch.nn.Module]) -> dict:
    """The model chunks' ``sharded_state_dict()`` under the keys megatron's training loop uses."""
    return _with_chunks(chunks, lambda c: c.module.sharded_state_dict())


def load_model_state(chunks: list[torch.nn.Module], state: dict) -> None:
    """Load what :func:`model_sharded_state_dict` saved (strict) into the chunks."""
    if len(chunks) == 1:
        chunks[0].module.load_state_dict(state["model"], strict=True)
        return
    for i, c in enumerate(chunks):
        c.module.load_state_dict(state[f"model{i}"], strict=True)


def optimizer_sharded_state_dict(optimizer: Any, model_state: dict, is_loading: bool, sharding: str) -> dict:
    """The megatron optimizer's ``sharded_state_dict`` over ``model_state`` (all chunks merged),
    distributed optimizers in format ``sharding`` (:func:`distrib_optimizer_sharding`)."""
    merged: dict = {}
    for v in model_state.values():
        merged.update(v)
    metadata = {"distrib_optim_sharding_type": sharding}
    return optimizer.sharded_state_dict(merged, is_loading=is_loading, metadata=metadata)


def parallel_split() -> dict[str, int]:
    """This process's place in megatron's model-parallel groups: sizes and ranks."""
    from megatron.core import parallel_state as ps

    return dict(tp=ps.get_tensor_model_parallel_world_size(), pp=ps.get_pipeline_model_parallel_world_size(),
                dp=ps.get_data_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
                pp_rank=ps.get_pipeline_model_parallel_rank(), dp_rank=ps.get_data_parallel_rank())


def rng_state() -> dict[str, Any]:
    """The random number generators a training step draws from: torch's CPU generator, the CUDA
    generator (the CPU backend maps it to the CPU one) and megatron's tensor-parallel RNG tracker."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {"torch_cpu": torch.get_rng_state(), "torch_cuda": torch.cuda.get_rng_state(),
            "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["torch_cpu"])
    torch.cuda.set_rng_state(state["torch_cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def init_optimizer_states(leaves: list[Any]) -> None:
    """Create the optimizer states of leaves that have none yet (no step taken), as megatron's
    ``init_state_fn`` does, plus torch Adam's ``step`` counter: megatron's distributed optimizer
    reads every state's ``step`` to build even a loading ``sharded_state_dict`` (an assertion
    error otherwise, with torch's Adam). Loading overwrites them all."""
    for leaf in leaves:
        opt = torch_optimizer(leaf)
        params = [p for g in opt.param_groups for p in g["params"]]
        if all(len(opt.state.get(p, {})) for p in params):
            continue
        init = getattr(leaf, "init_state_fn", None)
        if init is not None:
            init(opt, getattr(leaf, "config", None))
        if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
            for p in params:
                opt.state[p].setdefault("step", torch.zeros((), dtype=torch.float32))


def clear_optimizer_states(leaves: list[Any]) -> None:
    """Empty the torch optimizers' state, so that megatron's ``load_state_dict`` allocates it afresh
    (with torch's Adam, loading into existing states leaves every ``step`` counter at its old value)."""
    for leaf in leaves:
        torch_optimizer(leaf).state.clear()


def optimizer_steps(leaves: list[Any]) -> list[Optional[float]]:
    """Each leaf's Adam step count (None when it has not stepped or keeps no per-state step).

    Saved beside megatron's optimizer state: with torch's Adam (no Apex or Transformer Engine)
    megatron's distributed optimizer takes the per-state ``step`` tensors of a loaded checkpoint
    from the *loading* state dict, so they would come back as they were before the load."""
    out: list[Optional[float]] = []
    for leaf in leaves:
        steps = {float(s["step"]) for s in torch_optimizer(leaf).state.values() if "step" in s}
        out.append(steps.pop() if len(steps) == 1 else None)
    return out


def set_optimizer_steps(leaves: list[Any], steps: list[Optional[float]]) -> None:
    """Restore what :func:`optimizer_steps` returned, one tensor per state: megatron's load puts
    one tensor into every state, which torch's Adam would then increment once per parameter."""
    for leaf, step in zip(leaves, steps):
        if step is None:
            continue
        for s in torch_optimizer(leaf).state.values():
            old = s.get("step")
            if isinstance(old, torch.Tensor):
                s["step"] = torch.full_like(old, step)
            elif "step" in s:
                s["step"] = step


def use_in_process_write_results_queue() -> None:
    """Make megatron's checkpoint writer report its results through an in-process queue.

    By default ``FileSystemWriterAsync`` starts a ``multiprocessing.Manager`` server process (a
    spawned Python, about a second) for that queue on the first save and keeps it for the life of
    the process; when the trainer's process is killed (SIGKILL) that server outlives it. Here the
    writer's entry point runs in a thread of the saving process (its forked writer processes
    report through a queue of their own), so a ``queue.Queue`` serves it; no server is started."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is None:
        filesystem_async._results_queue = queue.Queue()


class _NumpyWithProduct:
    """numpy, with the ``product`` alias numpy 2 removed (``prod``)."""

    def __getattr__(self, name: str) -> Any:
        import numpy

        return getattr(numpy, "prod" if name == "product" else name)


def dist_checkpointing_numpy2_compat() -> None:
    """Let megatron-core 0.13's ``dist_checkpointing`` run with numpy 2: its ``mapping``,
    ``validation`` and ``exchange_utils`` modules call ``np.product`` (removed in numpy 2.0;
    megatron 0.14+ call ``np.prod``). Only those modules' ``np`` is replaced, and only when numpy
    lacks ``product``."""
    import importlib

    import numpy

    if hasattr(numpy, "product"):
        return
    for name in ("mapping", "validation", "exchange_utils"):
        module = importlib.import_module(f"megatron.core.dist_checkpointing.{name}")
        if getattr(module, "np", None) is numpy:
            module.np = _NumpyWithProduct()


def dist_checkpointing_save_kwargs() -> dict:
    """Extra arguments for ``dist_checkpointing.save``: from 0.17 its ``async_strategy`` defaults
    to ``"nvrx"``, which needs the separate ``nvidia-resiliency-ext`` package; megatron's own
    ``"mcore"`` strategy is the one 0.13 to 0.16 always used."""
    import inspect

    from megatron.core import dist_checkpointing

    params = inspect.signature(dist_checkpointing.save).parameters
    return {"async_strategy": "mcore"} if "async_strategy" in params else {}
