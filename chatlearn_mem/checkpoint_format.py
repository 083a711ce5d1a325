"""The checkpoint directory format: names, completeness, and the manifest that verifies it.

A checkpoint of step N is the directory ``<root>/step_<N>`` (8 digits). It is complete when it
holds :data:`METADATA_FILE`, written last (see :func:`chatlearn_mem.atomic_files.commit_directory`);
directories without it, or with a temporary name (``.tmp.step_<N>``), are ignored by
:func:`list_checkpoints` and :func:`latest_checkpoint`. The metadata file holds the format's name
(:data:`FORMAT`), what the save recorded, and a manifest of every other file (its size and
CRC-32), which :func:`verify_checkpoint` reads every file back against.
"""

from __future__ import annotations

import json
import os
import re
import time
import zlib
from typing import Optional

from chatlearn_mem.errors import ChatlearnMemError

__all__ = [
    "FORMAT",
    "METADATA_FILE",
    "CheckpointDamagedError",
    "CheckpointError",
    "check_files",
    "check_writable",
    "checkpoint_files",
    "file_digest",
    "full_manifest",
    "latest_checkpoint",
    "list_checkpoints",
    "own_files",
    "read_metadata",
    "step_dirname",
    "verify_checkpoint",
]

METADATA_FILE = "chatlearn_checkpoint.json"
"""Written last into a checkpoint directory; a directory without it is incomplete and ignored."""
FORMAT = "chatlearn-mem checkpoint 1"
"""The format the metadata file names; a checkpoint of another format is refused."""
_NAME = re.compile(r"^step_(\d+)$")


class CheckpointError(ChatlearnMemError):
    """A checkpoint cannot be written or does not fit the trainer; the message says what to do."""


class CheckpointDamagedError(CheckpointError):
    """A file of a complete checkpoint is missing or differs from the checkpoint's manifest.

    Attributes:
        path: The checkpoint directory.
        file: The damaged file, relative to ``path``.
        problem: What differs ("has 1024 bytes, the manifest says 4096", ...).
    """

    def __init__(self, path: str, file: str, problem: str):
        self.path, self.file, self.problem = path, file, problem
        super().__init__(f"checkpoint {path} is damaged: {file} {problem}")


# -- the manifest: every file's size and CRC-32 ---------------------------------------------------------
_CHUNK = 8 * 2**20


def file_digest(path: str) -> dict:
    """``{"bytes", "crc32"}`` of one file, read in chunks."""
    crc, n = 0, 0
    with open(path, "rb") as f:
        while True:
            block = f.read(_CHUNK)
            if not block:
                break
            crc, n = zlib.crc32(block, crc), n + len(block)
    return {"bytes": n, "crc32": f"{crc:08x}"}


def checkpoint_files(directory: str) -> list[str]:
    """Every file under ``directory`` but the metadata file, as relative paths, sorted."""
    out = []
    for base, _, names in os.walk(directory):
        for name in names:
            rel = os.path.relpath(os.path.join(base, name), directory)
            if rel != METADATA_FILE:
                out.append(rel)
    return sorted(out)


def own_files(directory: str, rank: int) -> dict[str, dict]:
    """The manifest entries of the tensor files ``rank`` wrote (torch's ``__<rank>_<n>.distcp``)."""
    prefix = f"__{rank}_"
    return {f: file_digest(os.path.join(directory, f)) for f in checkpoint_files(directory) if f.startswith(prefix)}


def full_manifest(directory: str, own: list[dict[str, dict]]) -> dict[str, dict]:
    """The manifest of a whole checkpoint directory: every rank's :func:`own_files`, then an entry
    for every other file (megatron's metadata, any file not named after its rank)."""
    files = {k: v for m in own for k, v in m.items()}
    for name in checkpoint_files(directory):
        if name not in files:
            files[name] = file_digest(os.path.join(directory, name))
    return files


def check_files(path: str, manifest: dict[str, dict], names: list[str]) -> Optional[CheckpointDamagedError]:
    """The error naming the first of ``names`` that is missing or differs from ``manifest`` (not
    raised: the caller may gather it from every rank first), or None when all match."""
    for name in names:
        want = manifest[name]
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            return CheckpointDamagedError(path, name, "is missing")
        size = os.path.getsize(full)
        if size != want["bytes"]:
            return CheckpointDamagedError(path, name, f"has {size} bytes, the manifest says {want['bytes']}")
        got = file_digest(full)
        if got["crc32"] != want["crc32"]:
            return CheckpointDamagedError(
                path,
                name,
                f"has CRC-32 {got['crc32']}, the manifest says {want['crc32']} (same size: the bytes changed)",
            )
    return None


def verify_checkpoint(path: str, rank: int = 0, world_size: int = 1) -> dict:
    """Read every file of a complete checkpoint back against its manifest.

    Args:
        path: A checkpoint directory (from :func:`latest_checkpoint` / :func:`list_checkpoints`).
        rank, world_size: Verify only every ``world_size``-th file starting at ``rank`` (so that
            the ranks of a job share the reading); the defaults verify all.

    Returns:
        ``{"files", "bytes", "seconds", "verified"}``: what was read; ``verified`` is False for a
        checkpoint written before manifests (nothing to compare with: nothing read).

    Raises:
        CheckpointDamagedError: The first file that is missing or differs (named).
        CheckpointError: ``path`` is not a complete checkpoint (no or unreadable metadata).
    """
    t0 = time.perf_counter()
    manifest = read_metadata(path).get("files")
    if manifest is None:
        return {"files": 0, "bytes": 0, "seconds": 0.0, "verified": False}
    names = sorted(manifest)[rank::world_size]
    error = check_files(path, manifest, names)
    if error is not None:
        raise error
    return {
        "files": len(names),
        "bytes": sum(manifest[n]["bytes"] for n in names),
        "seconds": time.perf_counter() - t0,
        "verified": True,
    }


# -- directories ---------------------------------------------------------------------------------------
def step_dirname(step: int) -> str:
    """``step_<step>`` with 8 digits: the name of a complete checkpoint of ``step``."""
    return f"step_{step:08d}"


def list_checkpoints(root: str) -> list[str]:
    """Complete checkpoint directories under ``root``, oldest step first (empty when none or no
    ``root``). Incomplete ones (no :data:`METADATA_FILE`, temporary names) are left out."""
    if not os.path.isdir(root):
        return []
    found = []
    for entry in os.listdir(root):
        m = _NAME.match(entry)
        path = os.path.join(root, entry)
        if m and os.path.isfile(os.path.join(path, METADATA_FILE)):
            found.append((int(m.group(1)), path))
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str) -> Optional[str]:
    """The complete checkpoint with the highest step under ``root``, or None."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def check_writable(root: str) -> None:
    """Raise before anything is written when ``root`` cannot hold a checkpoint."""
    try:
        os.makedirs(root, exist_ok=True)
        probe = os.path.join(root, f".write-test-{os.getpid()}")
        with open(probe, "wb") as f:
            f.write(b"x")
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(
            f"cannot write checkpoints to {root!r}: {e.strerror or e} ({type(e).__name__}). "
            "Choose a writable directory (and check its permissions and free space); "
            "nothing was saved"
        ) from e


def read_metadata(path: str) -> dict:
    """The metadata of the complete checkpoint ``path``.

    Raises:
        CheckpointError: ``path`` has no metadata file, or one of another format.
        CheckpointDamagedError: The metadata file cannot be read.
    """
    meta_path = os.path.join(path, METADATA_FILE)
    if not os.path.isfile(meta_path):
        raise CheckpointError(
            f"{path!r} is not a complete checkpoint (no {METADATA_FILE}); pass a directory "
            "that latest_checkpoint()/list_checkpoints() returned"
        )
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointDamagedError(path, METADATA_FILE, f"cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{path!r} has format {found!r}; this version reads {FORMAT!r}")
    return meta
