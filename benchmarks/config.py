"""Benchmark parameters: a pydantic model, presets in ``benchmarks/configs/*.yaml`` and overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field

from chatlearn_mem.gpt import GPTTrainerConfig

__all__ = ["BenchConfig", "CONFIG_DIR", "PRESETS", "METHODS", "COPY_PARTS", "load_config"]

CONFIG_DIR = Path(__file__).parent / "configs"
PRESETS = ("cpu", "gpu", "tiny")
"""Preset names; each is ``benchmarks/configs/<name>.yaml``."""

METHODS = ("manager", "ceiling", "per_tensor_new_host", "fresh_host_alloc", "replace_rebuild")
"""Every method the benchmark can time; ``manager`` and ``ceiling`` are always run."""

COPY_PARTS = ("weights", "main_weights", "optimizer_states")
"""Parts whose bytes are copied to the host (grads are dropped and rebuilt zeroed)."""


class BenchConfig(BaseModel):
    """Everything one benchmark run depends on (written in full into the results JSON)."""

    model_config = ConfigDict(extra="forbid")

    preset: str = "cpu"
    """Name recorded in the results (the preset the config started from, or ``custom``)."""
    trainer: GPTTrainerConfig = Field(default_factory=lambda: GPTTrainerConfig(
        num_layers=12, hidden_size=768, num_attention_heads=12, vocab_size=32768, seq_length=128))
    """The megatron-core GPT trainer to build (default: about 135 M parameters, bf16, DistOpt)."""
    batch_size: int = Field(2, ge=1)
    """Batch of the one train step that creates the optimizer states before timing."""
    bucket_size_mb: float = Field(256.0, gt=0)
    """``MemoryConfig.bucket_size_mb`` of the manager."""
    cpu_huge_pages: bool = True
    """``MemoryConfig.cpu_huge_pages`` of the manager (CPU only; false reproduces the 4 KiB-page onloads)."""
    pin_memory: Optional[bool] = None
    """Pin host buffers (manager store, ceiling, fresh-allocation alternative); None: when CUDA is available."""
    repeats: int = Field(9, ge=3)
    """Timed repeats of every (part, method, direction); median and spread are over these."""
    warmup: int = Field(1, ge=0)
    """Untimed repeats first (the manager allocates its host store on the first offload)."""
    cycles: int = Field(20, ge=2)
    """Full offload/onload cycles of the manager for the time-flat / no-growth check."""
    methods: list[Literal["per_tensor_new_host", "fresh_host_alloc", "replace_rebuild"]] = Field(
        default_factory=lambda: ["per_tensor_new_host", "fresh_host_alloc", "replace_rebuild"])
    """Alternatives to time against the manager."""
    threads: Optional[int] = Field(None, ge=1)
    """``torch.set_num_threads`` for the run; None keeps torch's default (one per core)."""
    rss_tolerance_mb: float = Field(64.0, ge=0)
    """Process RSS may move this much across cycles without counting as growth (allocator noise)."""
    output_dir: str = "benchmarks/results"
    """Where the JSON, markdown and PNG go."""
    name: Optional[str] = None
    """File stem; default ``<date>_<hardware>`` (e.g. ``2026-11-22_cpu-2core-...``)."""
    plot: bool = True
    """Write the PNG plot (matplotlib)."""


def _set_dotted(data: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    for p in parts[:-1]:
        data = data.setdefault(p, {})
    data[parts[-1]] = value


def load_config(preset: Optional[str] = "cpu", path: Optional[str] = None,
                overrides: Optional[list[str]] = None) -> BenchConfig:
    """Build a :class:`BenchConfig` from a preset or a YAML file, then ``key=value`` overrides.

    Args:
        preset: Name of a file in ``benchmarks/configs`` (ignored when ``path`` is given).
        path: A YAML file with :class:`BenchConfig` fields.
        overrides: ``dotted.key=value`` strings; values are parsed as YAML
            (``trainer.num_layers=4``, ``methods=[fresh_host_alloc]``).
    """
    if path is not None:
        data = yaml.safe_load(Path(path).read_text()) or {}
        data.setdefault("preset", "custom")
    else:
        preset = preset or "cpu"
        file = CONFIG_DIR / f"{preset}.yaml"
        if not file.exists():
            raise ValueError(f"unknown preset {preset!r}; presets are {list(PRESETS)}")
        data = yaml.safe_load(file.read_text()) or {}
        data["preset"] = preset
    for item in overrides or []:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not key=value")
        key, value = item.split("=", 1)
        _set_dotted(data, key.strip(), yaml.safe_load(value))
    return BenchConfig.model_validate(data)
