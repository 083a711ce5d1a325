"""Checkpoints of a trainer, written straight from the host store while it sleeps.

A checkpoint holds the trainer's whole state: the model weights, the optimizers' fp32 main
weights, their states and step counts, and the random number generators. A megatron-core
trainer's is megatron's ``sharded_state_dict`` of the model and the optimizer, in megatron-core's
own ``dist_checkpointing`` format, so it loads under another tensor- or data-parallel split, with
torch's CPU and CUDA generators and megatron's tensor-parallel RNG tracker. A plain PyTorch
trainer's is in ``torch.distributed.checkpoint``'s format (the weights and optimizer state by
parameter name, FSDP2's shards as DTensors, ZeroRedundancyOptimizer's partitions by their
owners), so it loads under another data-parallel size (see
:mod:`chatlearn_mem.torchnative.checkpointing`). Which one is the trainer backend's choice
(``manager.backend.checkpoint_io()``); a checkpoint of one is refused by the other. ::

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
:mod:`chatlearn_mem.checkpoint_serving`, megatron's calls in :mod:`chatlearn_mem.mcore.checkpointing`,
torch's in :mod:`chatlearn_mem.torchnative.checkpointing`,
the guard against orphaned writer processes in :mod:`chatlearn_mem.writer_processes`; this module
saves (plan, snapshot from the host copies, write, commit) and loads, and re-exports the names
users import from here.

Format choice for megatron-core: its own ``dist_checkpointing`` (``torch_dist`` backend) works on
the CPU backend (gloo, CPU-only torch), and megatron's sharded state dicts need it. The distributed
optimizer is saved in a format that reshards across tensor- and data-parallel sizes by default
(``resharding=False``: a cheaper one that reshards data parallel only; see
``checkpointing.distrib_optimizer_sharding``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from chatlearn_mem.atomic_files import commit_directory, fsync_dir, write_json_atomic
from chatlearn_mem.checkpoint_format import (
    FORMAT,
    METADATA_FILE,
    CheckpointDamagedError,
    CheckpointError,
    check_files,
    check_writable,
    full_manifest,
    latest_checkpoint,
    list_checkpoints,
    own_files,
    read_metadata,
    step_dirname,
    verify_checkpoint,
)
from chatlearn_mem.checkpoint_serving import HostCopies, after_load, checkpoint_io, prepare_load, with_host_copies
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


def estimate_checkpoint_nbytes(manager: Any, resharding: bool = True) -> int:
    """About how many bytes :func:`save_checkpoint` writes for this rank, before any save (and
    before the optimizer's first step): the model's weights, plus fp32 main weights and Adam's
    two fp32 moments for the parameters this rank's optimizer owns (a data-parallel shard with
    megatron's distributed optimizer).

    Raises:
        UnsupportedLayoutError: ``resharding=False`` and this megatron-core cannot save that format
            (what :func:`save_checkpoint` would raise, found before anything runs).
    """
    return checkpoint_io(manager).estimate_nbytes(resharding)


# -- saving: plan, snapshot (host copies served), write, commit ------------------------------------------
@dataclass(frozen=True)
class _SavePlan:
    """Where and how a save writes, fixed before anything is written."""

    io: Any  # the backend's checkpoint calls
    root: str
    step: int
    final: str  # the checkpoint's directory once committed
    tmp: str  # where every rank writes until the commit
    rank: int
    sharding: Optional[str]  # the distributed optimizer's format (megatron; None: torch's)
    metadata: Optional[dict]
    keep_last: Optional[int]
    started: float  # time.perf_counter() when the save was called


@dataclass
class SaveHandle:
    """A checkpoint save in progress (or done), and the owner of its state from the write to the
    commit. Call :meth:`wait` on every rank."""

    path: str
    """The directory the checkpoint has once complete."""
    step: int
    nbytes: int
    """Tensor bytes this rank writes."""
    _plan: _SavePlan = field(repr=False)
    _request: Any = field(repr=False)  # the writer's; it holds what it writes
    _readers: contextlib.ExitStack = field(repr=False)  # the host stores the write reads
    _shapes: dict = field(repr=False)  # the model's tensors, for the metadata file
    seconds: float = 0.0
    """Wall time from the call to the commit (set by :meth:`wait`)."""
    manifest_seconds: float = 0.0
    """Of which this rank spent checksumming files for the manifest."""
    _thread: Optional[threading.Thread] = None
    _error: Optional[BaseException] = None
    _manifest: Optional[dict] = None
    _committed: bool = False

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
            self._commit()
            self._committed = True
        return self.path

    def _write_in_background(self) -> None:
        self._thread = threading.Thread(target=self._write, name=f"chatlearn-ckpt-{self.step}", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        """Write this rank's tensors, then checksum its files for the manifest while they are still
        in the page cache; an error is kept for :meth:`wait` (this may run in the save's thread)."""
        with writers_die_with_this_thread():
            try:
                with self._readers:  # the host stores are read until the tensors are written
                    self._plan.io.write_save(self._request)
                t = time.perf_counter()
                self._manifest = own_files(self._plan.tmp, self._plan.rank)
                self.manifest_seconds = time.perf_counter() - t
            except BaseException as e:  # noqa: BLE001 - reported by wait()
                self._error = e

    def _commit(self) -> None:
        """Finish megatron's save and gather the manifests (collectives); rank 0 writes the metadata
        file last, renames the directory into place and drops checkpoints beyond ``keep_last``."""
        plan = self._plan
        _barrier()
        plan.io.finalize_save(self._request)
        manifests = _gather(self._manifest)
        if plan.rank == 0:
            t = time.perf_counter()
            files = full_manifest(plan.tmp, manifests)
            self.manifest_seconds += time.perf_counter() - t
            meta = {
                "format": FORMAT,
                "step": plan.step,
                "backend": plan.io.name,
                **plan.io.versions(),
                "parallel": plan.io.split_sizes(),
                "tensors": self._shapes,
                "distrib_optimizer_sharding": plan.sharding,
                "metadata": plan.metadata,
                "files": files,
            }
            commit_directory(plan.tmp, self.path, METADATA_FILE, meta)
            if plan.keep_last is not None:
                for old in list_checkpoints(plan.root)[: -plan.keep_last]:
                    shutil.rmtree(old, ignore_errors=True)
        _barrier()
        self.seconds = time.perf_counter() - plan.started


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
    plan = _plan_save(manager, root, step, metadata, keep_last, resharding)
    state, readers = with_host_copies(manager, lambda host: _snapshot(plan, host))
    handle = _start_write(plan, state, readers)
    del state  # the request holds what it writes
    if async_:
        handle._write_in_background()
    else:
        handle._write()
        handle.wait()
    return handle


def _plan_save(
    manager: Any, root: str, step: int, metadata: Optional[dict], keep_last: Optional[int], resharding: bool
) -> _SavePlan:
    """Check the arguments and the directory and choose the optimizer's format; nothing is written.

    Raises:
        What :func:`save_checkpoint` raises before anything is written (not the optimizer's step).
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (or None to keep all), got {keep_last}")
    try:
        json.dumps(metadata)
    except (TypeError, ValueError) as e:
        raise ValueError(f"metadata must be JSON-serialisable: {e}") from e
    started = time.perf_counter()
    install_parent_death_signal()
    root = os.path.abspath(root)
    check_writable(root)
    io = checkpoint_io(manager)
    sharding = io.sharding(resharding)
    final = os.path.join(root, step_dirname(step))
    tmp = os.path.join(root, ".tmp." + step_dirname(step))
    return _SavePlan(io, root, step, final, tmp, _rank(), sharding, metadata, keep_last, started)


def _snapshot(plan: _SavePlan, host: HostCopies) -> dict:
    """The state to save, independent of the trainer; :func:`with_host_copies` runs it while the
    offloaded tensors can be read from their host copies.

    Raises:
        CheckpointError: The trainer cannot be saved yet (megatron: before the optimizer's first step).
    """
    try:
        return plan.io.snapshot(plan.sharding, host)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def _start_write(plan: _SavePlan, state: dict, readers: contextlib.ExitStack) -> SaveHandle:
    """Make the temporary directory and let megatron plan the write of ``state`` (a collective);
    the returned handle owns the save from here. On a failure the host stores are let go."""
    try:
        if plan.rank == 0:
            shutil.rmtree(plan.tmp, ignore_errors=True)  # left by a save that was killed
            os.makedirs(plan.tmp)
        _barrier()
        shapes = plan.io.tensor_shapes(state)
        nbytes = plan.io.tensor_nbytes(state)
        request = plan.io.start_save(state, plan.tmp)
    except BaseException:
        readers.close()
        raise
    return SaveHandle(plan.final, plan.step, nbytes, plan, request, readers, shapes)


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
    meta = read_metadata(path)
    io = checkpoint_io(manager)
    written_by = meta.get("backend", "megatron-core")  # checkpoints before torch's have no "backend"
    if written_by != io.name:
        raise CheckpointError(
            f"checkpoint {path!r} holds a {written_by} trainer, and this manager's trainer is a {io.name} one; "
            f"load it into a {written_by} trainer (each writes its own format)"
        )
    if verify and meta.get("files") is not None:
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_initialized() else 1
        mine = check_files(path, meta["files"], sorted(meta["files"])[_rank() :: world])
        found = [e for e in _gather(None if mine is None else (mine.file, mine.problem)) if e is not None]
        if found:
            raise CheckpointDamagedError(path, *found[0])
    prepare_load(manager)
    same_split = io.split_sizes() == meta["parallel"]
    state = io.loading_state(meta)
    problems = _shape_differences(meta["tensors"], io.tensor_shapes(state))
    if problems:
        raise CheckpointError(
            f"checkpoint {path!r} does not fit this model: "
            + "; ".join(problems)
            + ". Build the trainer with the model shape the checkpoint was saved with"
        )
    io.load(state, path, same_split)
    after_load(manager)
    return meta
