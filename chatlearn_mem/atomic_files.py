"""Files and directories that appear whole or not at all, even when a process is killed mid-write.

Shared by the checkpoints (:mod:`chatlearn_mem.checkpoint`), the PPO app's run files and the
benchmark's results: :func:`write_json_atomic` replaces a JSON file in one step,
:func:`commit_directory` makes a directory complete in one step, :func:`fsync_dir` makes a
rename or a new entry durable.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

__all__ = ["commit_directory", "fsync_dir", "write_json_atomic"]


def fsync_dir(path: str) -> None:
    """fsync a directory, so that a rename or a new entry in it survives a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file, fsync and ``os.replace``: a reader
    (or a process killed while writing) sees the old file or the new one, never half of one."""
    path = os.fspath(path)
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):  # only left when the dump failed
            os.unlink(tmp)


def commit_directory(tmp: str | os.PathLike, final: str | os.PathLike, marker: str, data: Any) -> None:
    """Make a checkpoint directory complete in one step: write ``data`` as JSON to ``tmp/marker``
    (durably, last), rename ``tmp`` to ``final`` (replacing an earlier ``final`` of the same name,
    e.g. a step saved again) and fsync the parent. Readers that require ``marker`` and ignore
    ``tmp``'s name see the whole directory or none of it."""
    write_json_atomic(os.path.join(tmp, marker), data)
    fsync_dir(tmp)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_dir(os.path.dirname(os.path.abspath(final)))
