"""megatron-core's ``dist_checkpointing``, as :mod:`chatlearn_mem.checkpoint` uses it.

What a checkpoint holds (the model's and the optimizer's sharded state dicts, the RNG state, the
optimizer step counts) and how it is detached from the trainer, which distributed-optimizer
format reshards, megatron's asynchronous save in three calls (:func:`start_save`,
:func:`write_save`, :func:`finalize_save`), and the compatibility shims each supported
megatron-core release needs to save and load on torch's Adam (no Apex or Transformer Engine) and
on numpy 2. One function per question, as in :mod:`~chatlearn_mem.mcore.layout`; nothing outside
``mcore/`` spells these names.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch

from chatlearn_mem.errors import UnsupportedLayoutError
from chatlearn_mem.mcore.layout import main_weights, megatron_core_version, module_buffers, shard_views, torch_optimizer

__all__ = [
    "MegatronCheckpointIO",
    "checkpoint_read_tensors",
    "clear_optimizer_states",
    "detached_for_save",
    "dist_checkpointing_numpy2_compat",
    "dist_checkpointing_save_kwargs",
    "distrib_optimizer_sharding",
    "finalize_save",
    "init_optimizer_states",
    "is_distributed_optimizer",
    "load_model_state",
    "loading_optimizer_steps_compat",
    "model_sharded_state_dict",
    "model_tensor_shapes",
    "optimizer_sharded_state_dict",
    "optimizer_steps",
    "parallel_split",
    "rng_state",
    "set_optimizer_steps",
    "set_rng_state",
    "start_save",
    "tensor_nbytes",
    "trainer_sharded_state",
    "use_in_process_write_results_queue",
    "write_save",
]


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
                "use resharding=True"
            )
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


def trainer_sharded_state(
    chunks: list[torch.nn.Module], optimizer: Any, leaves: list[Any], is_loading: bool, sharding: str
) -> dict:
    """What a checkpoint holds, as megatron's sharded state dicts: the model chunks (``"model"``, or
    ``"model0"``, ... with virtual pipeline stages), ``"optimizer"`` (format ``sharding``), ``"rng"``
    (:func:`rng_state`, one per rank of the split) and ``"optimizer_steps"`` (:func:`optimizer_steps`)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    dist_checkpointing_numpy2_compat()
    model = model_sharded_state_dict(chunks)
    split = parallel_split()
    rng = ShardedObject(
        "chatlearn_rng_state",
        rng_state(),
        (split["pp"], split["tp"], split["dp"]),
        (split["pp_rank"], split["tp_rank"], split["dp_rank"]),
        replica_id=0,
    )
    return {
        **model,
        "optimizer": optimizer_sharded_state_dict(optimizer, model, is_loading, sharding),
        "rng": rng,
        "optimizer_steps": optimizer_steps(leaves),
    }


def detached_for_save(state: dict, is_live: Callable[[torch.Tensor], bool]) -> dict:
    """Make a state to save independent of the trainer, in place: tensors detached from parameter
    objects (which follow their ``.data`` back to the device), those ``is_live`` (training state
    on the device) copied to host memory, non-tensor objects deep-copied; host-store views in
    sharded tensors are kept as they are (no copy); plain tensors (megatron pickles them,
    typically step counts) are copied."""
    import copy

    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    def own(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return t.to("cpu", copy=True) if is_live(t) else t

    def fix(x: Any) -> Any:
        if isinstance(x, torch.Tensor):  # pickled into common.pt: a plain copy
            return x.detach().to("cpu", copy=True)
        if isinstance(x, ShardedObject):
            x.data = copy.deepcopy(x.data)
        elif isinstance(getattr(x, "data", None), torch.Tensor):  # ShardedTensor, ShardedTensorFactory
            x.data = own(x.data)
        return x

    return dict_list_map_inplace(fix, state)


def model_tensor_shapes(state: dict) -> dict[str, tuple[list[int], str]]:
    """``key -> (global shape, dtype)`` of the model's sharded tensors in a state."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out = {}
    for name, sub in state.items():
        if not name.startswith("model"):
            continue
        for v in nested_values(sub):
            if isinstance(v, ShardedTensor):
                out[v.key] = (list(v.global_shape), str(v.dtype).replace("torch.", ""))
    return out


def tensor_nbytes(state: dict) -> int:
    """Bytes of the tensors a state holds for this rank (what a save of it writes)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    return sum(
        v.data.numel() * v.data.element_size()
        for v in nested_values(state)
        if isinstance(getattr(v, "data", None), torch.Tensor)
    )


def parallel_split() -> dict[str, int]:
    """This process's place in megatron's model-parallel groups: sizes and ranks."""
    from megatron.core import parallel_state as ps

    return dict(
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
    )


def rng_state() -> dict[str, Any]:
    """The random number generators a training step draws from: torch's CPU generator, the CUDA
    generator (the CPU backend maps it to the CPU one) and megatron's tensor-parallel RNG tracker."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": torch.cuda.get_rng_state(),
        "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
    }


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


def start_save(state: dict, directory: str) -> Any:
    """Plan megatron's save of ``state`` into ``directory`` (its metadata exchange: a collective)
    and return its request, to be run by :func:`write_save` and finished by :func:`finalize_save`.
    The request holds what it writes."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    # One writer process per rank: thread_count files per rank, each a process forked to write.
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
    use_in_process_write_results_queue()
    return dist_checkpointing.save(
        state, directory, sharded_strategy=strategy, async_sharded_save=True, **dist_checkpointing_save_kwargs()
    )


def write_save(request: Any) -> None:
    """Write the tensors of a request from :func:`start_save` (megatron's ``async_fn``, with its
    ``preload_fn`` where the release has one), in the calling thread."""
    args = list(request.async_fn_args)
    preload = getattr(request, "preload_fn", None)
    if preload is not None:
        args[1] = preload()
    if request.async_fn is not None:
        request.async_fn(*args, **getattr(request, "async_fn_kwargs", {}))


def finalize_save(request: Any) -> None:
    """Finish a written save: megatron's finalisation (its metadata; a collective, every rank)."""
    for fn in request.finalize_fns:
        fn()


class MegatronCheckpointIO:
    """megatron-core's ``dist_checkpointing`` as :mod:`chatlearn_mem.checkpoint` uses it, for one
    trainer: what a checkpoint holds, how it is written and loaded (the functions above).

    Args:
        chunks, optimizer, leaves: The trainer's model chunks, optimizer and leaf optimizers.
    """

    name = "megatron-core"
    format_key = "distrib_optimizer_sharding"

    def __init__(self, chunks: list[torch.nn.Module], optimizer: Any, leaves: list[Any]):
        self.chunks, self.optimizer, self.leaves = chunks, optimizer, leaves

    def versions(self) -> dict:
        """What the metadata records of the software that wrote the checkpoint."""
        return {"megatron_core": megatron_core_version()}

    def split_sizes(self) -> dict[str, int]:
        """The parallel split's sizes (no ranks): what a checkpoint records and a load compares."""
        return {k: v for k, v in parallel_split().items() if not k.endswith("_rank")}

    def sharding(self, resharding: bool) -> str:
        """The distributed optimizer's format (:func:`distrib_optimizer_sharding`)."""
        return distrib_optimizer_sharding(self.leaves, resharding)

    def estimate_nbytes(self, resharding: bool) -> int:
        """About how many bytes a save writes for this rank (see ``estimate_checkpoint_nbytes``)."""
        distrib_optimizer_sharding(self.leaves, resharding)
        params = [p for c in self.chunks for p in c.parameters()]
        weights = sum(p.numel() * p.element_size() for p in params)
        owned = sum(p.numel() for p in params if p.requires_grad)
        if any(is_distributed_optimizer(leaf) for leaf in self.leaves):
            owned = -(-owned // max(1, parallel_split()["dp"]))
        return weights + owned * 4 * 3

    def swapped_tensors(self) -> list[torch.Tensor]:
        """The tensors whose ``.data`` point at their host copies while the save's state is built."""
        return checkpoint_read_tensors(self.chunks, self.leaves)

    def snapshot(self, sharding: str, host: Any) -> dict:
        """The state to save, independent of the trainer, built while the offloaded tensors view
        their host copies (``host.is_live(t)``: a tensor still training on the device).

        Raises:
            ValueError: The optimizer has not taken a step yet (``CheckpointError`` by the caller).
        """
        if None in optimizer_steps(self.leaves):  # read here: the states may be offloaded
            raise ValueError(
                "the optimizer has not taken a step yet, so it has no state to save (megatron's "
                "optimizers cannot write a checkpoint before their first step); save after "
                "optimizer.step()"
            )
        state = trainer_sharded_state(self.chunks, self.optimizer, self.leaves, is_loading=False, sharding=sharding)
        return detached_for_save(state, host.is_live)

    tensor_shapes = staticmethod(model_tensor_shapes)
    tensor_nbytes = staticmethod(tensor_nbytes)
    start_save = staticmethod(start_save)
    write_save = staticmethod(write_save)
    finalize_save = staticmethod(finalize_save)

    def prepare_load(self) -> None:
        """Before a load: create the optimizer states a load reads the layout of."""
        init_optimizer_states(self.leaves)

    def loading_state(self, meta: dict) -> dict:
        """The state a load of the checkpoint ``meta`` describes fills."""
        return trainer_sharded_state(
            self.chunks, self.optimizer, self.leaves, is_loading=True, sharding=meta["distrib_optimizer_sharding"]
        )

    def load(self, state: dict, path: str, same_split: bool) -> None:
        """Load ``state`` (from :meth:`loading_state`) from ``path`` into the trainer; the RNG
        states only when the split is the one saved."""
        from megatron.core import dist_checkpointing

        if not same_split:
            del state["rng"]
        loaded = dist_checkpointing.load(state, path)
        clear_optimizer_states(self.leaves)
        load_model_state(self.chunks, loaded)
        with loading_optimizer_steps_compat(self.leaves):
            self.optimizer.load_state_dict(loaded["optimizer"])
        set_optimizer_steps(self.leaves, loaded["optimizer_steps"])
        if same_split:
            set_rng_state(loaded["rng"])
