"""Checkpoints of a megatron-core trainer, written straight from the host store while it sleeps.

A checkpoint holds the trainer's whole state: the model weights, the optimizers' fp32 main
weights, their states and step counts (megatron's ``sharded_state_dict`` of the model and the
optimizer, in megatron-core's own ``dist_checkpointing`` format, so it loads under another
tensor- or data-parallel split), and the random number generators (torch CPU and CUDA, megatron's
tensor-parallel RNG tracker). ::

    from chatlearn_mem.checkpoint import save_checkpoint, load_checkpoint, latest_checkpoint
    mm.offload()                                           # the trainer sleeps ...
    handle = save_checkpoint(mm, "ckpt", step=10, async_=True)   # ... and is saved from host memory
    ...                                                    # the next phase runs meanwhile
    handle.wait()                                          # every rank; the checkpoint is complete
    load_checkpoint(mm, latest_checkpoint("ckpt"))         # into a resident trainer

While a part is offloaded its tensors are read from the host store (no device allocation, no
onload; see :func:`chatlearn_mem.checkpoint_serving.with_host_copies`). Resident parts are copied to host
memory when the save starts, so training may go on while it writes.

Asynchronous saves: ``save_checkpoint(..., async_=True)`` plans the save (megatron's metadata
exchange between ranks) in the calling thread and returns a :class:`SaveHandle` at once; a
background thread writes the tensors. Until the write is done, an offload that would overwrite
a host store the save still reads **waits** for it (onload, which only reads the store, goes
ahead): waiting rather than refusing keeps a training loop correct without retry code, and the
wait is at most the rest of one save (logged at INFO). ``handle.wait()`` must be called on every
rank (it runs megatron's finalisation, a collective, then commits the directory).

Complete or ignored: every rank writes into ``<root>/.tmp.step_<N>``; after megatron's
metadata, :data:`METADATA_FILE` is written last and rank 0 renames the directory to
``<root>/step_<N>`` (an atomic ``rename(2)``), then fsyncs ``<root>``. :func:`latest_checkpoint`
and :func:`load_checkpoint` ignore directories without the metadata file or with a temporary
name, so a process killed during a save leaves the previous checkpoint as the newest one.

Verified: the metadata file holds a manifest of every other file of the checkpoint (its size and
CRC-32). Each rank checksums the files it wrote (megatron's ``__<rank>_*.distcp``) right after
writing them, in the save's writing thread while they are still in the page cache; rank 0 adds
the files written at the commit (megatron's metadata). :func:`verify_checkpoint` reads every file
back against it, and :func:`load_checkpoint` does so before loading (``verify=True``), so a
truncated or damaged file is one :class:`CheckpointDamagedError` naming it, not an error from
deep inside megatron's reader. Checkpoints written before the manifest load unverified.

Where it lives: the directory format and the manifest in :mod:`chatlearn_mem.checkpoint_format`,
the atomic writes in :mod:`chatlearn_mem.atomic_files`, the trainer's host copies in
:mod:`chatlearn_mem.checkpoint_serving`, the guard against orphaned writer processes in
:mod:`chatlearn_mem.writer_processes`; this module saves and loads (and re-exports the names
users import from here).

Format choice: megatron-core's ``dist_checkpointing`` (``torch_dist`` backend) works on the CPU
backend (gloo, CPU-only torch); ``torch.distributed.checkpoint`` is not needed. The distributed
optimizer is saved in a format that reshards across tensor- and data-parallel sizes by default
(``resharding=False``: a cheaper one that reshards data parallel only; see
``checkpointing.distrib_optimizer_sharding``).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from chatlearn_mem.atomic_files import commit_directory, fsync_dir, write_json_atomic
from chatlearn_mem.checkpoint_format import (
    FORMAT,
    METADATA_FILE,
    CheckpointDamagedError,
    CheckpointError,
    check_files,
    check_writable,
    checkpoint_files,
    file_digest,
    latest_checkpoint,
    list_checkpoints,
    own_files,
    read_metadata,
    step_dirname,
    verify_checkpoint,
)
from chatlearn_mem.checkpoint_serving import after_load, prepare_load, trainer_parts, with_host_copies
from chatlearn_mem.mcore import checkpointing
from chatlearn_mem.writer_processes import install_parent_death_signal, writers_die_with_this_thread

__all__ = [
    "CheckpointDamagedError",
    "CheckpointError",
    "SaveHandle",
    "METADATA_FILE",
    "commit_directory",
    "estimate_checkpoint_nbytes",
    "fsync_dir",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
    "write_json_atomic",
]


# -- ranks ------------------------------------------------------------------------------------------------
def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _gather(obj: Any) -> list:
    """``obj`` of every rank (a list in rank order); ``[obj]`` without a process group."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


# -- building the state ------------------------------------------------------------------------------
def _sharded_state(manager: Any, is_loading: bool, sharding: str) -> dict:
    """``{"model": ..., "optimizer": ..., "rng": ShardedObject}`` (megatron's sharded state dicts)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    chunks, optimizer, leaves = trainer_parts(manager)
    checkpointing.dist_checkpointing_numpy2_compat()
    model = checkpointing.model_sharded_state_dict(chunks)
    split = checkpointing.parallel_split()
    rng = ShardedObject(
        "chatlearn_rng_state",
        checkpointing.rng_state(),
        (split["pp"], split["tp"], split["dp"]),
        (split["pp_rank"], split["tp_rank"], split["dp_rank"]),
        replica_id=0,
    )
    return {
        **model,
        "optimizer": checkpointing.optimizer_sharded_state_dict(optimizer, model, is_loading, sharding),
        "rng": rng,
        "optimizer_steps": checkpointing.optimizer_steps(leaves),
    }


def _detach_for_save(state: dict, is_live) -> dict:
    """Make the state independent of the trainer: tensors detached from parameter objects (which
    follow their ``.data`` back to the device), live training tensors copied to host memory,
    non-tensor objects deep-copied; host-store views in sharded tensors are kept as they are (no
    copy); plain tensors (megatron pickles them, typically step counts) are copied."""
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


def _tensor_shapes(state: dict) -> dict[str, tuple[list[int], str]]:
    """``key -> (global shape, dtype)`` of the model's sharded tensors."""
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


def estimate_checkpoint_nbytes(manager: Any, resharding: bool = True) -> int:
    """About how many bytes :func:`save_checkpoint` writes for this rank, before any save (and
    before the optimizer's first step): the model's weights, plus fp32 main weights and Adam's
    two fp32 moments for the parameters this rank's optimizer owns (a data-parallel shard with
    megatron's distributed optimizer).

    Raises:
        UnsupportedLayoutError: ``resharding=False`` and this megatron-core cannot save that format
            (what :func:`save_checkpoint` would raise, found before anything runs).
    """
    chunks, _, leaves = trainer_parts(manager)
    checkpointing.distrib_optimizer_sharding(leaves, resharding)
    params = [p for c in chunks for p in c.parameters()]
    weights = sum(p.numel() * p.element_size() for p in params)
    owned = sum(p.numel() for p in params if p.requires_grad)
    if any(checkpointing.is_distributed_optimizer(leaf) for leaf in leaves):
        owned = -(-owned // max(1, checkpointing.parallel_split()["dp"]))
    return weights + owned * 4 * 3


# -- saving ----------------------------------------------------------------------------------------------
@dataclass
class SaveHandle:
    """A checkpoint save in progress (or done). Call :meth:`wait` on every rank."""

    path: str
    """The directory the checkpoint has once complete."""
    step: int
    nbytes: int
    """Tensor bytes this rank writes."""
    _thread: Optional[threading.Thread] = None
    _finish: Any = None
    _error: Optional[BaseException] = None
    _committed: bool = False
    _manifest: Optional[dict] = None
    seconds: float = 0.0
    """Wall time from the call to the commit (set by :meth:`wait`)."""
    manifest_seconds: float = 0.0
    """Of which this rank spent checksumming files for the manifest."""

    def done(self) -> bool:
        """Whether the tensors are written (the checkpoint is complete once :meth:`wait` returned)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> str:
        """Wait for the write, finish the save (a collective: call it on every rank) and commit the
        directory atomically. Returns the checkpoint's path; idempotent.

        Raises:
            CheckpointError: The write failed; the previous checkpoints are untouched and the
                temporary directory is left for inspection (a later save of the same step
                replaces it).
        """
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise CheckpointError(f"saving checkpoint {self.path} failed: {self._error}") from self._error
        if not self._committed:
            self._finish()
            self._committed = True
        return self.path


def save_checkpoint(
    manager: Any,
    root: str,
    step: int,
    async_: bool = False,
    metadata: Optional[dict] = None,
    keep_last: Optional[int] = None,
    resharding: bool = True,
) -> SaveHandle:
    """Save the trainer's whole state to ``<root>/step_<step>`` (8 digits), awake or asleep.

    Args:
        manager: The trainer's :class:`~chatlearn_mem.TrainerMemoryManager`. Offloaded parts are
            read from its host store; the trainer is neither woken nor changed.
        root: Directory holding the checkpoints (created if missing).
        step: Training step (or iteration) the state belongs to; names the directory.
        async_: Return once the save is planned and let a background thread write the tensors;
            call ``wait()`` on the handle (every rank) to complete it. Meanwhile an offload
            that would overwrite a host store the save reads waits for it.
        metadata: JSON-serialisable data stored with the checkpoint (returned by
            :func:`load_checkpoint`), e.g. the run's counters.
        keep_last: After the commit, delete all but the newest ``keep_last`` complete
            checkpoints under ``root`` (None: keep all).
        resharding: Write the distributed optimizer in a format that loads under another tensor-
            or data-parallel split (megatron's ``fully_reshardable``: it copies the optimizer
            state into model-space tensors while the call runs, so an asynchronous save returns
            only after that copy). False: megatron's ``dp_reshardable``, written from the
            optimizer's (or the host store's) own memory, resharding across data-parallel sizes
            only (megatron-core 0.14+).

    Returns:
        A :class:`SaveHandle`; with ``async_=False`` it is already complete.

    Raises:
        CheckpointError: ``root`` cannot be written, or the optimizer has not stepped yet
            (both raised before anything is written), or a synchronous write failed.
        UnsupportedLayoutError: ``resharding=False`` with megatron-core 0.13.
        ValueError: ``step`` < 0 or ``keep_last`` < 1.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (or None to keep all), got {keep_last}")
    try:
        json.dumps(metadata)
    except (TypeError, ValueError) as e:
        raise ValueError(f"metadata must be JSON-serialisable: {e}") from e
    t0 = time.perf_counter()
    install_parent_death_signal()
    root = os.path.abspath(root)
    final = os.path.join(root, step_dirname(step))
    tmp = os.path.join(root, ".tmp." + step_dirname(step))
    check_writable(root)
    sharding = checkpointing.distrib_optimizer_sharding(trainer_parts(manager)[2], resharding)

    def build(is_live):
        if None in checkpointing.optimizer_steps(trainer_parts(manager)[2]):  # read here: the states may be offloaded
            raise CheckpointError(
                "the optimizer has not taken a step yet, so it has no state to save (megatron's "
                "optimizers cannot write a checkpoint before their first step); save after "
                "optimizer.step()"
            )
        return _detach_for_save(_sharded_state(manager, is_loading=False, sharding=sharding), is_live)

    state, readers = with_host_copies(manager, build)
    try:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
            os.makedirs(tmp)
        _barrier()
        shapes = _tensor_shapes(state)
        from megatron.core.dist_checkpointing.dict_utils import nested_values

        nbytes = sum(
            v.data.numel() * v.data.element_size()
            for v in nested_values(state)
            if isinstance(getattr(v, "data", None), torch.Tensor)
        )
        # One writer process per rank: thread_count files per rank, each a process forked to write.
        strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
        checkpointing.use_in_process_write_results_queue()
        request = dist_checkpointing.save(
            state,
            tmp,
            sharded_strategy=strategy,
            async_sharded_save=True,
            **checkpointing.dist_checkpointing_save_kwargs(),
        )
    except BaseException:
        readers.close()
        raise
    del state  # the request holds what it writes

    handle = SaveHandle(final, step, nbytes)
    rank = _rank()

    def write():
        with writers_die_with_this_thread():
            try:
                with readers:  # the host stores are read until the tensors are written
                    args = list(request.async_fn_args)
                    preload = getattr(request, "preload_fn", None)
                    if preload is not None:
                        args[1] = preload()
                    if request.async_fn is not None:
                        request.async_fn(*args, **getattr(request, "async_fn_kwargs", {}))
                t = time.perf_counter()
                handle._manifest = own_files(tmp, rank)  # while the files are in the page cache
                handle.manifest_seconds = time.perf_counter() - t
            except BaseException as e:  # noqa: BLE001 - reported by wait()
                handle._error = e

    def finish():
        _barrier()
        for fn in request.finalize_fns:
            fn()
        manifests = _gather(handle._manifest)
        if rank == 0:
            t = time.perf_counter()
            files = {k: v for m in manifests for k, v in m.items()}
            for name in checkpoint_files(tmp):  # megatron's metadata, and any file not named after its rank
                if name not in files:
                    files[name] = file_digest(os.path.join(tmp, name))
            handle.manifest_seconds += time.perf_counter() - t
            meta = {
                "format": FORMAT,
                "step": step,
                "megatron_core": checkpointing.megatron_core_version(),
                "parallel": {k: v for k, v in checkpointing.parallel_split().items() if not k.endswith("_rank")},
                "tensors": shapes,
                "distrib_optimizer_sharding": sharding,
                "metadata": metadata,
                "files": files,
            }
            commit_directory(tmp, final, METADATA_FILE, meta)
            if keep_last is not None:
                for old in list_checkpoints(root)[:-keep_last]:
                    shutil.rmtree(old, ignore_errors=True)
        _barrier()
        handle.seconds = time.perf_counter() - t0

    handle._finish = finish
    if async_:
        handle._thread = threading.Thread(target=write, name=f"chatlearn-ckpt-{step}", daemon=True)
        handle._thread.start()
    else:
        write()
        handle.wait()
    return handle


# -- loading ---------------------------------------------------------------------------------------------
def _shape_differences(saved: dict, current: dict) -> list[str]:
    out = []
    for key in sorted(saved.keys() | current.keys()):
        if key not in current:
            out.append(f"{key} is in the checkpoint but not in the model")
        elif key not in saved:
            out.append(f"{key} is in the model but not in the checkpoint")
        elif list(saved[key][0]) != list(current[key][0]) or saved[key][1] != current[key][1]:
            out.append(
                f"{key}: checkpoint {tuple(saved[key][0])} {saved[key][1]}, "
                f"model {tuple(current[key][0])} {current[key][1]}"
            )
    return out


def load_checkpoint(manager: Any, path: str, verify: bool = True) -> dict:
    """Load a checkpoint saved by :func:`save_checkpoint` into a resident trainer.

    The model shape must match; the tensor- and data-parallel split may differ (megatron reshards).
    RNG states are restored when the split is the one saved (with another split they cannot map
    to the same ranks, and are left as they are).

    Args:
        manager: The trainer's :class:`~chatlearn_mem.TrainerMemoryManager`, every part on the device.
        path: A checkpoint directory (e.g. from :func:`latest_checkpoint`).
        verify: First read every file back against the checkpoint's manifest
            (:func:`verify_checkpoint`), the ranks sharing the files; False when the caller did.

    Returns:
        The checkpoint's metadata: ``step``, ``parallel`` (the split it was saved with),
        ``metadata`` (what the save was given) and more.

    Raises:
        CheckpointDamagedError: A file is missing or differs from the manifest (on every rank, the
            same file named); nothing was loaded.
        CheckpointError: ``path`` is not a complete checkpoint, or its tensors differ in shape or
            dtype from the model's (the message lists each difference).
        OffloadedError: A part of the trainer is offloaded (call ``onload()`` first).
    """
    from megatron.core import dist_checkpointing

    meta = read_metadata(path)
    if verify and meta.get("files") is not None:
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_initialized() else 1
        mine = check_files(path, meta["files"], sorted(meta["files"])[_rank() :: world])
        found = [e for e in _gather(None if mine is None else (mine.file, mine.problem)) if e is not None]
        if found:
            raise CheckpointDamagedError(path, *found[0])
    chunks, optimizer, _ = trainer_parts(manager)
    prepare_load(manager)
    same_split = {k: v for k, v in checkpointing.parallel_split().items() if not k.endswith("_rank")} == meta[
        "parallel"
    ]
    state = _sharded_state(manager, is_loading=True, sharding=meta["distrib_optimizer_sharding"])
    problems = _shape_differences(meta["tensors"], _tensor_shapes(state))
    if problems:
        raise CheckpointError(
            f"checkpoint {path!r} does not fit this model: "
            + "; ".join(problems)
            + ". Build the trainer with the model shape the checkpoint was saved with"
        )
    if not same_split:
        del state["rng"]
    loaded = dist_checkpointing.load(state, path)
    checkpointing.clear_optimizer_states(trainer_parts(manager)[2])
    checkpointing.load_model_state(chunks, loaded)
    with checkpointing.loading_optimizer_steps_compat(trainer_parts(manager)[2]):
        optimizer.load_state_dict(loaded["optimizer"])
    checkpointing.set_optimizer_steps(trainer_parts(manager)[2], loaded["optimizer_steps"])
    if same_split:
        checkpointing.set_rng_state(loaded["rng"])
    after_load(manager)
    return meta
