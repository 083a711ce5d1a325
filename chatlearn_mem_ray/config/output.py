"""What a run gives out besides its ``log.json`` and picture: the trained policy as a Hugging Face
directory (:class:`ExportConfig`, the ``export`` section) and the experiment trackers each
iteration's metrics go to (:data:`LOGGERS`, the ``logger`` key, and :class:`TrackerConfig`, the
``trackers`` section)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from pydantic import Field

from chatlearn_mem_ray.config.section import Section

__all__ = ["ExportConfig", "LOGGERS", "TrackerConfig"]


class ExportConfig(Section):
    """The trained policy out as a Hugging Face directory (``config.json``, the weights in the run's
    precision, the tokenizer's files, ``generation_config.json``) under ``<output_dir>/hf/iter_<K>/``,
    written from the policy's host store while it sleeps (no device memory), atomically, and listed in
    ``log.json``'s ``exports``. Llama and Qwen2 policies export; a tensor-parallel policy's shards are
    merged."""

    hf_every: int = Field(0, ge=0)
    """Export after every this many iterations (0: only at the end)."""
    at_end: bool = True
    """Export after the last iteration, when the policy exports (a Llama or Qwen2); a policy that
    does not is said once and skipped."""
    on_resume: bool = False
    """On ``--resume`` of a run that has no iteration left: export its last iteration (from the
    checkpoint's weights). False: a finished run resumed writes no export again."""
    max_shard_mb: float = Field(4096.0, gt=0)
    """The largest ``*.safetensors`` file; a larger model is split, with ``model.safetensors.index.json``."""


LOGGERS = ("console", "tensorboard", "wandb", "mlflow")
"""Where a run's metrics go (``logger``)."""


class TrackerConfig(Section):
    """The experiment trackers of ``logger`` (each installed apart: the extra of its name)."""

    project: str = "chatlearn-mem"
    """The W&B project / MLflow experiment."""
    run_name: Optional[str] = None
    """The run's name in the trackers (None: ``output_dir``'s name)."""
    tensorboard_dir: Optional[Path] = None
    """Where TensorBoard's event files go (None: ``<output_dir>/tensorboard``)."""
    wandb_mode: Literal["auto", "online", "offline"] = "auto"
    """``auto``: online when ``WANDB_API_KEY`` is set (or ``wandb login`` was run), else offline
    (the run syncs later with ``wandb sync <output_dir>/wandb/offline-run-*``)."""
    wandb_entity: Optional[str] = None
    """The W&B team or user (None: the key's default)."""
    mlflow_tracking_uri: Optional[str] = None
    """An MLflow tracking server or store (None: ``MLFLOW_TRACKING_URI`` when set, else a local file
    store, ``file:<output_dir>/mlruns``)."""
