"""Benchmark parameters: a pydantic model and its presets (``configs/bench/*.yaml`` in the repository)."""

from __future__ import annotations

import os
from importlib import resources
from typing import Literal, Optional, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from chatlearn_mem import Part
from chatlearn_mem.models.gpt import GPTTrainerConfig
from chatlearn_mem_config_files import load_config as _load
from chatlearn_mem_config_files import preset_of

__all__ = ["BenchConfig", "COPY_PARTS", "DEFAULT_PRESET", "FULL", "METHODS", "PARTS", "PRESETS", "load_config"]

PRESETS = resources.files("chatlearn_mem_bench.presets")
"""The shipped presets (``configs/bench/*.yaml`` in the repository, installed with the package)."""
DEFAULT_PRESET = "cpu"
"""What ``chatlearn-mem bench`` runs without ``--config`` (about 135 M parameters, minutes on 2 cores)."""

METHODS = (
    "manager",
    "ceiling",
    "per_tensor_new_host",
    "fresh_host_alloc",
    "replace_rebuild",
    "megatron_builtin",
    "torch_memory_saver",
)
"""Every method the benchmark can time; ``manager`` and ``ceiling`` are always run."""

FULL = "full"
"""The pseudo part ``offload()`` / ``onload()`` of everything."""
PARTS = (*Part, FULL)
"""Parts timed, in order."""
COPY_PARTS = (Part.WEIGHTS, Part.MAIN_WEIGHTS, Part.OPTIMIZER_STATES)
"""Parts whose bytes are copied to the host (grads are dropped and rebuilt zeroed)."""


class BenchConfig(BaseModel):
    """Everything one benchmark run depends on (written in full into the results JSON)."""

    model_config = ConfigDict(extra="forbid")

    preset: str = "cpu"
    """Name recorded in the results (the preset the config started from, or ``custom``)."""
    trainer: GPTTrainerConfig = Field(
        default_factory=lambda: GPTTrainerConfig(
            num_layers=12, hidden_size=768, num_attention_heads=12, vocab_size=32768, seq_length=128
        )
    )
    """The megatron-core GPT trainer to build (default: about 135 M parameters, bf16, DistOpt)."""
    batch_size: int = Field(2, ge=1)
    """Batch of the one train step that creates the optimizer states before timing."""
    bucket_size_mb: float = Field(256.0, gt=0)
    """``MemoryConfig.bucket_size_mb`` of the manager."""
    cpu_huge_pages: bool = True
    """``MemoryConfig.cpu_huge_pages`` of the manager (CPU only; false reproduces the 4 KiB-page onloads)."""
    cuda_contiguous: bool = False
    """``MemoryConfig.cuda_contiguous`` of the manager (CUDA only: main weights and optimizer states
    in a DeviceSlab); a run with it and one without, on the same GPU, are its A/B."""
    pin_memory: Optional[bool] = None
    """Pin host buffers (manager store, ceiling, fresh-allocation alternative); None: when CUDA is available."""
    repeats: int = Field(9, ge=3)
    """Timed repeats of every (part, method, direction); median and spread are over these."""
    warmup: int = Field(1, ge=0)
    """Untimed repeats first (the manager allocates its host store on the first offload)."""
    cycles: int = Field(20, ge=2)
    """Full offload/onload cycles of the manager for the time-flat / no-growth check."""
    methods: list[
        Literal["per_tensor_new_host", "fresh_host_alloc", "replace_rebuild", "megatron_builtin", "torch_memory_saver"]
    ] = Field(
        default_factory=lambda: ["per_tensor_new_host", "fresh_host_alloc", "replace_rebuild", "megatron_builtin"]
    )
    """Alternatives to time against the manager (``megatron_builtin`` runs on the parts megatron-core's
    own offload covers, where the installed release has it; ``torch_memory_saver`` on a GPU with
    torch_memory_saver installed, in a worker process of its own, see ``chatlearn_mem_bench.tms``;
    where an alternative cannot run, the results say why and the run goes on without it)."""
    tms_retain_cpu_backup: bool = False
    """``torch_memory_saver``: keep its host backups between pauses (``TMS_RETAIN_CPU_BACKUP``).
    False, TMS's default and how slime runs it, allocates and pins them again on every pause."""
    release_bound: bool = True
    """Time the release bound (a device buffer of each part's size beside the ceiling's, the full
    part's included). False where the device has no room for both (the ``gpu_large`` preset): the
    manager is then compared with the ceiling alone."""
    threads: Optional[int] = Field(None, ge=1)
    """``torch.set_num_threads`` for the run; None keeps torch's default (one per core)."""
    overlap: bool = True
    """Measure the overlap rows (``onload_then_forward``, ``swap``, ``full_cycle``), each against its
    serial counterpart (see ``chatlearn_mem_bench.overlap``); the swap builds a second trainer with
    half the layers."""
    overlap_repeats: Optional[int] = Field(None, ge=3)
    """Timed repeats of each overlap row (None: ``repeats``)."""
    overlap_forward: Union[tuple[int, int], Literal["match_copy"], None] = None
    """The ``onload_then_forward`` row's forward pass: ``[sequences, tokens]`` per sequence;
    ``match_copy``: one sequence, its length chosen at run time so the forward takes about as long as
    the weights' onload (from a timed onload and a timed 16-token forward); None: the benchmark batch
    (``batch_size`` sequences of ``trainer.seq_length``). The row shows whether the copy hides behind
    compute, which only a forward of about the copy's duration can show: a forward six times the copy
    bounds any schedule to 0.86 of serial (each result's ``best_possible_ratio`` is its bound)."""
    overlap_threads: Optional[int] = Field(1, ge=1)
    """Intra-op threads while the overlap rows run on a CPU "device" (both sides alike: a lane copies
    with the threads of the thread that submitted the transition): one gives the compute one core
    and the copy lane the other, the way a GPU's copy engines are hardware of their own. None: the
    run's. Ignored on CUDA."""
    tail_onloads: int = Field(20, ge=0)
    """Blocking weights onloads of the ``onload_tail`` row, each beside a plain copy of the same
    bytes (0 skips the row): the median against the copy, the 90th percentile against the median."""
    soak_cycles: int = Field(60, ge=0)
    """Full cycles of the ``soak`` row, run last, with training between them (0 skips the row):
    RSS (and CUDA reserved memory) must stop growing after the first half."""
    soak_train_every: int = Field(5, ge=1)
    """A train step every this many soak cycles."""
    soak_sample_every: int = Field(10, ge=1)
    """Memory sampled (after ``gc.collect()``) every this many soak cycles."""
    rss_tolerance_mb: float = Field(64.0, ge=0)
    """Process RSS may move this much across cycles without counting as growth (allocator noise)."""
    checkpoint: bool = False
    """The ``checkpoint`` report: ``save_checkpoint`` of the trainer awake, asleep and asynchronous,
    in both optimizer formats, against a plain write of the same bytes, and the manifest's share
    (see ``chatlearn_mem_bench.checkpoint_saves``). Writes about the trainer's state per save."""
    checkpoint_repeats: int = Field(3, ge=1)
    """Repeats of the ``checkpoint`` report's saves (six per repeat); medians over these."""
    checkpoint_dir: Optional[str] = None
    """Where the ``checkpoint`` report writes (its disk is what is measured); None: a temporary
    directory, removed after."""
    torch_native: bool = False
    """The ``torch_native`` report: a Hugging Face Llama of the trainer's shape (fp32, AdamW) put to
    sleep by the manager against verl's per-tensor ``.to("cpu")``, ``model.cpu()`` and the ceiling,
    full and weights-only, and what stays on the device after sleep (see
    ``chatlearn_mem_bench.torch_native``); needs ``transformers``."""
    torch_native_repeats: int = Field(5, ge=1)
    """Timed cycles of each way in the ``torch_native`` report (after ``warmup`` untimed ones)."""
    planner: bool = False
    """The ``planner`` report: the residency planner's time on 64-item x 8-phase schedules against
    its 100 ms target (see ``chatlearn_mem_bench.planner_speed``); needs no trainer."""
    planner_repeats: int = Field(20, ge=1)
    """Timed runs of each plan in the ``planner`` report."""
    planner_seeds: int = Field(3, ge=1)
    """Schedules of each kind in the ``planner`` report (each at 4 budgets)."""
    output_dir: str = "runs/bench"
    """Where the JSON, markdown and PNG go (relative to the working directory). The committed
    results under ``benchmarks/results`` are written only when asked for explicitly."""
    name: Optional[str] = None
    """File stem; default ``<date>_<hardware>`` (e.g. ``2026-11-22_cpu-2core-...``)."""
    overwrite: bool = False
    """Replace results of the same stem (a run of the same day and hardware, or the same
    ``name``). False writes ``<stem>_2.*`` (``_3``, ...) instead and says so: a run never
    silently replaces another, committed results included."""
    plot: bool = True
    """Write the PNG plot (matplotlib)."""
    revision: Optional[str] = None
    """Source revision recorded in the results (e.g. a git hash); None: ``git rev-parse HEAD`` of
    the checkout the package runs from, when it runs from one."""

    @model_validator(mode="after")
    def _check_overlap_forward(self) -> "BenchConfig":
        if isinstance(self.overlap_forward, tuple):
            sequences, tokens = self.overlap_forward
            if sequences < 1 or not 2 <= tokens <= self.trainer.seq_length:
                raise ValueError(
                    f"overlap_forward is (sequences >= 1, tokens within 2..trainer.seq_length = "
                    f"{self.trainer.seq_length}), got {list(self.overlap_forward)}"
                )
        return self


def load_config(source: Optional[str | os.PathLike] = DEFAULT_PRESET, overrides: Sequence[str] = ()) -> BenchConfig:
    """Build a :class:`BenchConfig` from a preset name or YAML path, then ``key=value`` overrides.

    Args:
        source: A preset name (``cpu``, ``gpu``, ``tiny``; see :data:`PRESETS`) or the path of a
            YAML file of :class:`BenchConfig` fields; None starts from the defaults.
        overrides: ``dotted.key=value`` strings; values are parsed as YAML
            (``trainer.num_layers=4``, ``methods=[fresh_host_alloc]``).

    Raises:
        ConfigError: Unknown preset, missing or invalid file, malformed override or invalid
            result; every problem is listed with its dotted key.
    """
    cfg = _load(BenchConfig, source, overrides, presets=PRESETS)
    return cfg.model_copy(update={"preset": preset_of(source, PRESETS) or "custom"})
