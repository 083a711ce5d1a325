"""A trainer out as a Hugging Face directory, read from its host store while it sleeps:
:func:`export_hf` (the service's :meth:`~chatlearn_mem_ray.service.service.Service.export_hf`).

Each tensor-parallel rank of the trainer's first data-parallel group streams its own shards in
buckets (:meth:`~chatlearn_mem_ray.actors.trainer.TrainerActor.megatron_weight_buckets`, the vLLM
sync's stream); the driver merges one bucket of every rank at a time into Hugging Face tensors
(:func:`chatlearn_mem.models.hf.merge_shard_buckets`) and writes them a file at a time
(:func:`chatlearn_mem.models.hf.save_hf_stream`): no device memory, and no process holds a second
copy of the model. The directory is written under a temporary name and renamed whole once complete
(its last file, ``chatlearn_export.json``, says what it holds), so a reader sees it all or not at all.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Protocol, Union

from chatlearn_mem.atomic_files import commit_directory
from chatlearn_mem_ray.errors import ActorFailedError, LoopUsageError
from chatlearn_mem_ray.service.declare import Model


class ExportSource(Protocol):
    """What an export needs of the service (:class:`~chatlearn_mem_ray.service.service.Service`):
    its models, their actors by data-parallel rank, and whether a phase is open."""

    models: Mapping[str, Model]
    open_phase: Optional[str]

    def by_dp_rank(self, model: str) -> list[list[Any]]: ...


__all__ = ["MARKER", "export_hf"]

MARKER = "chatlearn_export.json"
"""Written last into a complete export: the model, the digest of its tensors, the seconds it took."""
_BACKPRESSURE = 2  # buckets in flight per rank


def export_hf(
    svc: ExportSource,
    model: str,
    path: Union[str, os.PathLike],
    tokenizer: Optional[Union[str, os.PathLike]] = None,
    max_shard_bytes: int = 4 * 2**30,
    bucket_bytes: int = 256 * 2**20,
) -> dict:
    """Write trainer ``model`` (an lm head: a Llama or Qwen2) to ``path`` as a Hugging Face directory:
    its weights in its precision, ``config.json`` (its ``from_hf`` checkpoint's other keys kept), the
    tokenizer's files and a ``generation_config.json`` whose EOS, padding and BOS ids are the
    tokenizer's. Call it between phases (the trainer asleep: read from its host store).

    Args:
        tokenizer: The run's tokenizer directory (default: the model's ``from_hf``, when it has one).
        max_shard_bytes: The largest ``*.safetensors`` file.
        bucket_bytes: The most bytes of one rank's shards in one message.

    Returns:
        ``{"path", "files", "tensors", "bytes", "digest", "seconds"}`` (``digest``:
        :func:`chatlearn_mem.models.hf.hf_digest` of the tensors written).

    Raises:
        LoopUsageError: ``model`` is not a trainer with an lm head, or a phase is open.
        ValueError: The model's architecture does not export (only Llama and Qwen2 do).
        ActorFailedError: A rank's process died while it streamed (``died``: the run may restart).
    """
    from ray.exceptions import RayActorError, RayTaskError

    from chatlearn_mem.models import hf
    from chatlearn_mem_ray.actors.weight_stream import hf_weight_stream

    m = svc.models.get(model)
    if m is None or m.kind != "trainer" or m.head != "lm":
        raise LoopUsageError(f"export_hf({model!r}): only a trainer with an lm head exports (a policy)")
    if svc.open_phase is not None:
        raise LoopUsageError(f"export_hf({model!r}) inside phase {svc.open_phase!r}: export between phases")
    config = m.config
    hf.family_of(config)  # before any actor is asked
    t0 = time.perf_counter()
    path = Path(path)
    tmp = path.parent / f".tmp.{path.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    senders = svc.by_dp_rank(model)[0]  # tensor-parallel ranks of data-parallel rank 0

    source = Path(config.from_hf) if config.from_hf is not None else None
    try:
        stream = hf_weight_stream(senders, config, bucket_bytes, _BACKPRESSURE)
        stats = hf.save_hf_stream(stream, config, tmp, source, int(max_shard_bytes))
    except (RayActorError, RayTaskError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        died = isinstance(e, RayActorError)
        raise ActorFailedError(model, "export", f"{type(e).__name__}: {e}", died=died) from None
    tokenizer = Path(tokenizer) if tokenizer is not None else source
    ids = _carry_tokenizer(tokenizer, tmp) if tokenizer is not None else {}
    _generation_config(tmp, ids)
    if ids:  # what an engine stops at and pads with: the tokenizer's, over the source's config
        with open(tmp / "config.json") as f:
            hf_config = json.load(f)
        hf_config.update(ids)
        with open(tmp / "config.json", "w") as f:
            json.dump(hf_config, f, indent=2, sort_keys=True)
    out = {"path": str(path), **stats, "seconds": time.perf_counter() - t0}
    commit_directory(tmp, path, MARKER, {"model": model, **out})
    return out


def _carry_tokenizer(directory: Path, to: Path) -> dict:
    """Copy ``directory``'s tokenizer files to ``to``; its special token ids (``eos_token_id``,
    ``pad_token_id``, ``bos_token_id``, those it has)."""
    from chatlearn_mem.models.hf import TOKENIZER_FILES

    for name in TOKENIZER_FILES:
        if (directory / name).is_file():
            shutil.copyfile(directory / name, to / name)
    if not (directory / "tokenizer.json").is_file() and not (directory / "tokenizer_config.json").is_file():
        return {}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    ids = {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id}
    return {k: v for k, v in ids.items() if v is not None}


def _generation_config(directory: Path, ids: dict) -> None:
    """``generation_config.json``: the source's (carried already, when it had one) with ``ids``."""
    path = directory / "generation_config.json"
    gen = json.loads(path.read_text()) if path.is_file() else {}
    gen.update(ids)
    path.write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
