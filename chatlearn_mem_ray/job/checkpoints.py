"""Checkpoints of a whole run of a loop: every saved model's state plus the run's own, complete or ignored.

Layout under ``checkpoint.directory`` (default ``<output_dir>/checkpoints``), for PPO::

    iter_00000004/                 # complete: 4 iterations done
        policy/step_00000004/      # chatlearn_mem.checkpoint of every policy rank (dist_checkpointing)
        critic/step_00000004/      # the same for the critic
        run.json                   # the run's state (with the loop's own and the saved models' names), written last
    .tmp.iter_00000006/            # a save in progress (or killed): ignored, removed by the next save

Only the trainers are saved (a loop's models with ``saved``): an engine's weights are replaced by
its trainer's at its first generate after a restore, and a reference is rebuilt from its config
(the policy's initial model, which its seed or checkpoint rebuilds bit for bit).

A run checkpoint becomes complete in one step: once every trainer committed its own directory,
the driver writes ``run.json`` (fsynced) into the temporary directory and renames it to
``iter_<N>`` (an atomic ``rename(2)``, then the parent is fsynced). A process killed at any point
before leaves the previous checkpoint the newest.

:class:`RunCheckpointer` does this for :func:`chatlearn_mem_ray.job.run.run_ppo`; the functions
below read and check checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from chatlearn_mem.atomic_files import commit_directory, write_json_atomic
from chatlearn_mem.checkpoint_format import CheckpointDamagedError, CheckpointError, verify_checkpoint
from chatlearn_mem_ray.config import LoopConfig
from chatlearn_mem_ray.errors import ActorFailedError, CheckpointDirError, CheckpointSaveError, ResumeError

__all__ = [
    "RUN_FILE",
    "RunCheckpointer",
    "check_checkpoint_dir",
    "check_room",
    "config_differences",
    "latest_run_checkpoint",
    "list_run_checkpoints",
    "newest_intact_run_checkpoint",
    "read_run_state",
    "remove_temporaries",
    "verify_run_checkpoint",
    "write_json_atomic",
]

RUN_FILE = "run.json"
"""The run's state; written last into a run checkpoint."""
_FORMAT = "chatlearn-mem run checkpoint 1"
_NAME = re.compile(r"^iter_(\d+)$")
_TMP_PREFIX = ".tmp.iter_"
TRAINERS = ("policy", "critic")
"""The saved models of a checkpoint whose ``run.json`` does not list them (written before it did)."""

# Settings of a trainer that the checkpoint's tensors depend on: a difference cannot be resumed.
SHAPE_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "vocab_size",
    "seq_length",
    "precision",
    "use_distributed_optimizer",
    "num_moe_experts",
    "model_class",
    "frozen_params",
    "fp32_accumulation_params",
)
# Settings expected to change between a run and its resumption; not reported.
_FREE = ("checkpoint.", "ray.", "output_dir", "output_dir_exists", "memory.compare_iterations")


def _name(iterations: int) -> str:
    return f"iter_{iterations:08d}"


def list_run_checkpoints(root: os.PathLike) -> list[tuple[int, Path]]:
    """``(iterations done, path)`` of every complete run checkpoint under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = _NAME.match(entry.name)
        if m and (entry / RUN_FILE).is_file():
            found.append((int(m.group(1)), entry))
    return sorted(found)


def latest_run_checkpoint(root: os.PathLike) -> Optional[Path]:
    """The complete run checkpoint with the most iterations under ``root``, or None."""
    found = list_run_checkpoints(root)
    return found[-1][1] if found else None


def read_run_state(path: os.PathLike) -> dict:
    """The ``run.json`` of a complete run checkpoint.

    Raises:
        ResumeError: ``path`` is not a complete run checkpoint of this format.
    """
    path = Path(path)
    try:
        state = json.loads((path / RUN_FILE).read_text())
    except (OSError, ValueError) as e:
        raise ResumeError(f"{path} is not a complete run checkpoint ({type(e).__name__}: {e})") from None
    if state.get("format") != _FORMAT:
        raise ResumeError(f"{path} has format {state.get('format')!r}; this version reads {_FORMAT!r}")
    return state


def verify_run_checkpoint(path: os.PathLike) -> dict:
    """Read a run checkpoint's ``run.json`` and every trainer's checkpoint back against its
    manifest (:func:`chatlearn_mem.checkpoint.verify_checkpoint`); returns the ``run.json``.

    Raises:
        ResumeError: ``run.json`` cannot be read or has another format.
        CheckpointError: A trainer's checkpoint is incomplete or a file of it is damaged
            (:class:`~chatlearn_mem.checkpoint.CheckpointDamagedError` names the file).
    """
    path = Path(path)
    state = read_run_state(path)
    step = f"step_{int(state['iterations_done']):08d}"
    for model in state.get("models", TRAINERS):
        verify_checkpoint(str(path / model / step))
    return state


def newest_intact_run_checkpoint(
    root: os.PathLike, progress: Callable[[str], None] = print
) -> Optional[tuple[Path, dict]]:
    """The newest complete run checkpoint under ``root`` whose files all match their manifests,
    with its ``run.json``; None when there is no complete checkpoint. Each damaged one skipped on
    the way is one line to ``progress`` naming the file.

    Raises:
        ResumeError: There are complete checkpoints but none is intact (each one's damage named).
    """
    found = list_run_checkpoints(root)
    damaged = []
    for _, path in reversed(found):
        try:
            return path, verify_run_checkpoint(path)
        except (ResumeError, CheckpointError) as e:
            if isinstance(e, CheckpointDamagedError):  # the file, named from the run checkpoint down
                reason = f"{Path(e.path).relative_to(path) / e.file} {e.problem}"
            else:
                reason = str(e).replace(f"{path}{os.sep}", "")
            damaged.append(f"{path.name}: {reason}")
            progress(f"checkpoint {path.name} is damaged, skipped: {reason}")
    if damaged:
        raise ResumeError(
            f"no intact checkpoint in {root} to resume from ({'; '.join(damaged)}). Restore the "
            "files from a copy, or start the run anew without --resume in another output_dir"
        )
    return None


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix.rstrip("."): d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}."))
    return out


def config_differences(saved: dict, cfg: LoopConfig, models: Sequence[str] = TRAINERS) -> tuple[list[str], list[str]]:
    """Compare the config a checkpoint was saved with to ``cfg``.

    Args:
        models: The saved models (their config sections hold :data:`SHAPE_FIELDS`).

    Returns:
        ``(blocking, changed)``: differences in what the saved models' tensors depend on (model
        shape, precision, optimizer layout: :data:`SHAPE_FIELDS` of each saved model's section),
        each ``"policy.hidden_size: checkpoint 64, config 128"``; and the other differences, except
        those a resumed run is expected to change (iterations, checkpoint, Ray and output settings).
    """
    old, new = _flatten(saved), _flatten(json.loads(cfg.model_dump_json()))
    free = (*_FREE, f"{cfg.loop_section}.iterations")
    blocking, changed = [], []
    for key in sorted(old.keys() | new.keys()):
        a, b = old.get(key), new.get(key)
        if a == b or key.startswith(free):
            continue
        line = f"{key}: checkpoint {a!r}, config {b!r}"
        role, _, field = key.partition(".")
        (blocking if role in models and field in SHAPE_FIELDS else changed).append(line)
    return blocking, changed


def check_checkpoint_dir(root: os.PathLike) -> None:
    """Create ``root`` and write a probe file into it.

    Raises:
        CheckpointDirError: It cannot be created or written (naming it and the reason).
    """
    root = Path(root)
    probe = root / f".write-test-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"x")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        raise CheckpointDirError(
            f"cannot write checkpoints to {root}: {e.strerror or e} ({type(e).__name__}); "
            "set checkpoint.directory to a writable directory"
        ) from None


def check_room(root: os.PathLike, nbytes: int, keep_last: int, free_bytes: Optional[int] = None) -> None:
    """Check that ``root`` has room for the checkpoints the run will hold at once.

    ``keep_last`` complete ones plus the one being written exist at once; the complete ones
    already there count as written.

    Args:
        nbytes: Bytes of one checkpoint (the trainers' estimate).
        free_bytes: Free bytes (default: what the filesystem of ``root`` reports).

    Raises:
        CheckpointDirError: Saying what is needed, what is free, and what to change.
    """
    existing = len(list_run_checkpoints(root))
    slots = max(1, keep_last + 1 - existing)
    free = shutil.disk_usage(root).free if free_bytes is None else free_bytes
    if free < slots * nbytes:
        raise CheckpointDirError(
            f"checkpoint.directory {root} has {free / 2**30:.2f} GiB free, but {slots} more checkpoint(s) of about "
            f"{nbytes / 2**30:.2f} GiB each ({slots * nbytes / 2**30:.2f} GiB; checkpoint.keep_last={keep_last} "
            f"plus the one being written, {existing} already there) do not fit: free space, lower "
            "checkpoint.keep_last, or choose another checkpoint.directory"
        )


def remove_temporaries(root: os.PathLike) -> list[str]:
    """Delete the temporary directories of saves that never completed; return their names."""
    root = Path(root)
    gone = []
    if root.is_dir():
        for entry in sorted(root.iterdir()):
            if entry.name.startswith(_TMP_PREFIX) and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
                gone.append(entry.name)
    return gone


class RunCheckpointer:
    """Saves run checkpoints through the trainer actors of a :class:`~chatlearn_mem_ray.service.colocation.Colocation`.

    :meth:`save` starts a save (every rank of every saved model writes its own state from its host
    store; the driver keeps the run's state); with ``checkpoint.async_save`` it returns once the
    ranks have planned the write, and :meth:`complete` (called before a phase changes a saved
    model, and at the end) waits for the writes and commits the directory. Without it :meth:`save`
    completes at once.

    Args:
        cfg: The run config (``checkpoint`` section).
        colo: The actors.
        models: The saved models' names (their actors are ``colo.actors_of[name]``).
        progress: Receives a line per committed checkpoint.
        saved: The list :attr:`saved` appends to (default: a new one).
    """

    def __init__(
        self,
        cfg: LoopConfig,
        colo: Any,
        models: Sequence[str],
        progress: Callable[[str], None],
        saved: Optional[list] = None,
    ):
        self.cfg, self.colo, self.models, self.progress = cfg, colo, list(models), progress
        self.root = Path(cfg.checkpoint_dir).absolute()
        self._pending: Optional[tuple[int, Path, dict, float, int]] = None
        self.saved: list[dict] = [] if saved is None else saved  # per committed checkpoint: iterations, s, bytes

    def save(self, iterations: int, run_state: dict, before_calls: Optional[Callable[[Path], None]] = None) -> float:
        """Start saving the checkpoint of ``iterations`` done; ``run_state`` is what ``run.json``
        holds (taken now). Completes the previous save first. Returns the seconds the caller waited.

        Args:
            before_calls: Called with the temporary directory before the trainers are asked to
                write (tests use it to make the save fail).

        Raises:
            CheckpointSaveError: The save failed (not by an actor's death); the previous complete
                checkpoint is intact.
            ActorFailedError: An actor died (``died``): the run may restart.
        """
        t0 = time.perf_counter()
        self.complete()
        tmp = self.root / f"{_TMP_PREFIX}{iterations:08d}"
        c, async_ = self.colo, self.cfg.checkpoint.async_save
        with self._failing(iterations):
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            if before_calls is not None:
                before_calls(tmp)
            meta = {"run_iterations": iterations}
            results = c.call(
                "checkpoint",
                {
                    a: a.save_checkpoint.remote(
                        str(tmp / role), iterations, async_, meta, self.cfg.checkpoint.resharding
                    )
                    for role in self.models
                    for a in c.actors_of[role]
                },
            )
        nbytes = sum(r["nbytes"] for r in results.values())
        self._pending = (iterations, tmp, run_state, t0, nbytes)
        if not async_:
            self.complete()
        return time.perf_counter() - t0

    def complete(self) -> float:
        """Wait for the open save (if any) on every trainer rank, then commit it. Returns the
        seconds waited.

        Raises:
            CheckpointSaveError, ActorFailedError: As :meth:`save`.
        """
        if self._pending is None:
            return 0.0
        t0 = time.perf_counter()
        iterations, tmp, run_state, started, nbytes = self._pending
        c = self.colo
        self._pending = None
        with self._failing(iterations):
            c.call("checkpoint", {a: a.finish_checkpoint.remote() for m in self.models for a in c.actors_of[m]})
            entry = {"iterations_done": iterations, "bytes": nbytes, "seconds": time.perf_counter() - started}
            state = dict(run_state, checkpoints=[*run_state.get("checkpoints", []), entry])  # itself included
            final = self.root / _name(iterations)  # replaced when a redone iteration is saved again
            commit_directory(
                tmp,
                final,
                RUN_FILE,
                {"format": _FORMAT, "iterations_done": iterations, "saved_at": time.time(), **state},
            )
        for _, old in list_run_checkpoints(self.root)[: -self.cfg.checkpoint.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        self.saved.append(entry)
        self.progress(
            f"checkpoint {final.name} complete: {nbytes / 2**20:.1f} MiB in {entry['seconds']:.2f}s "
            f"({'in the background' if self.cfg.checkpoint.async_save else 'waited for'})"
        )
        return time.perf_counter() - t0

    @contextlib.contextmanager
    def _failing(self, iterations: int) -> Iterator[None]:
        """Turn a failed save (not an actor's death) into a :class:`CheckpointSaveError`."""
        try:
            yield
        except (OSError, ActorFailedError) as e:
            if isinstance(e, ActorFailedError) and e.died:
                raise
            newest = latest_run_checkpoint(self.root)
            kept = (
                f"the newest complete checkpoint, {newest.name}, is intact"
                if newest
                else ("no complete checkpoint exists yet")
            )
            raise CheckpointSaveError(
                f"saving the checkpoint after iteration {iterations} to {self.root} failed "
                f"({type(e).__name__}: {e}); the run stopped and {kept}. Check the "
                "directory (space, permissions), then resume with --resume"
            ) from e
