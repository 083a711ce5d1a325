"""What every loop shares: :class:`LoopConfig` (the policy, its layout, the rollout engine, the task,
memory, Ray, checkpoints, output, trackers) and its sections, and :func:`load_config`."""

from __future__ import annotations

import os
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import ClassVar, Literal, Optional, Sequence, TypeVar, Union

from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from chatlearn_mem import MemoryConfig
from chatlearn_mem_config_files import load_config as _load
from chatlearn_mem_ray.config.model import TrainerModelConfig, checkpoint_decides
from chatlearn_mem_ray.config.output import ExportConfig, TrackerConfig
from chatlearn_mem_ray.config.section import Section
from chatlearn_mem_ray.inputs.tasks import TaskConfig

__all__ = [
    "CheckpointConfig",
    "LoopConfig",
    "MemoryPolicy",
    "ParallelConfig",
    "RayConfig",
    "RolloutConfig",
    "load_config",
    "moved",
]


class RayConfig(Section):
    """Where the actors run."""

    address: Optional[str] = None
    """Which Ray cluster the run uses (see :func:`chatlearn_mem_ray.actors.connect.resolve_address`):

    - None (default): the cluster in ``RAY_ADDRESS`` when that is set (as ``ray job submit``
      does), else a new local cluster started for the run and stopped afterwards; a head
      started with ``ray start`` on this machine is not joined.
    - ``"local"``: always a new local cluster, whatever ``RAY_ADDRESS`` says.
    - ``"auto"``: ``RAY_ADDRESS``, else the head the latest ``ray start`` on this machine recorded;
      an error when there is none.
    - ``"host:port"`` (a head's GCS port, 6379 by default) or ``"ray://host:10001"`` (Ray client).

    Joining never passes resource counts (``num_cpus``); the cluster's own resources are checked."""
    num_cpus: Optional[int] = Field(None, ge=1)
    """CPUs of a local cluster (default: all of this machine). Ignored, with a note, when the run
    joins an existing cluster."""
    connect_timeout_s: float = Field(20.0, gt=0)
    """Longest wait to reach an existing cluster's address before the run stops with an error
    naming it (a wrong address otherwise retries for many minutes)."""
    cpus_per_rank: float = Field(1.0, gt=0)
    """CPUs in each placement-group bundle (one bundle per trainer rank); the actors colocated
    on a bundle share them."""
    placement: Literal["pack", "spread"] = "pack"
    """How the trainer ranks go over the cluster's nodes. Each tensor-parallel group is one
    placement group on one node (``STRICT_PACK``); ``pack`` puts the groups on as few nodes as
    fit them, ``spread`` one group per node round-robin (fewer ranks per machine: more host memory
    and PCIe per rank). Each rank's colocated models share its bundle in both."""
    use_gpu: Literal["auto", True, False] = "auto"
    """Put one GPU in each bundle. ``auto``: when this machine (or the cluster) has GPUs."""
    phase_timeout_s: float = Field(600.0, gt=0)
    """Longest a phase may take before the run stops with an error naming the actors it waits for."""
    node_wait_s: float = Field(300.0, ge=0)
    """After a restart (``checkpoint.max_restarts``): longest the run waits for the cluster to have
    room for every rank again (a replacement for a lost node joining) before it stops, or, with
    ``checkpoint.elastic``, goes on with fewer data-parallel ranks. Keep it above the time Ray
    takes to declare a lost node dead (its health checks: about 15-30 s by default), or a lost
    node's resources still count when the wait ends."""


class ParallelConfig(Section):
    """Ranks of each trainer (policy and critic use the same layout)."""

    world_size: int = Field(1, ge=1)
    """Trainer ranks: one policy actor and one critic actor per rank."""
    tensor_model_parallel_size: int = Field(1, ge=1)
    """Tensor-parallel ranks; must divide world_size. The rest is data parallel."""

    @model_validator(mode="after")
    def _tp_divides_world(self) -> "ParallelConfig":
        if self.world_size % self.tensor_model_parallel_size:
            raise ValueError(
                f"tensor_model_parallel_size ({self.tensor_model_parallel_size}) must "
                f"divide world_size ({self.world_size})"
            )
        return self

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.tensor_model_parallel_size


class MemoryPolicy(Section):
    """What the memory manager does between phases."""

    enabled: bool = True
    """Offload every model when its phase ends. False keeps every model resident (the baseline)."""
    compare_iterations: int = Field(1, ge=0)
    """After the run, this many more iterations with the manager switched off, measured the same
    way, so the log holds both figures. They are numbered on their own, from 1 (``iter manager off
    1/1`` on the console; ``manager_on`` false in ``log.json``). Ignored when ``enabled`` is false."""
    audit: bool = True
    """Run the manager's audit after every onload and stop the run if it finds a problem."""
    verify_sync: bool = True
    """Prove every weight sync bit for bit before the rollout samples: the megatron rollout's
    tensors against the policy's shards (a SHA-256 of each), a vLLM engine's parameters as loaded
    against the stream the policy exported (a digest of each, merged as the engine merges them);
    a difference stops the run with ``WeightSyncError``. Costs a pass over the weights on both
    sides."""
    manager: MemoryConfig = Field(default_factory=MemoryConfig)
    """Host store settings of every manager."""
    device_budget_mb: Union[None, float, Literal["auto"]] = None
    """Device memory (MiB per device) the models may hold at once. None: each phase onloads the
    models it needs and offloads them when it ends (all or nothing). A number: the run plans, once
    it has measured every model's parts, which parts stay resident across the phases that do not
    need them so that the fewest bytes move per iteration within this budget
    (:func:`chatlearn_mem.plan_residency`; see ``docs/residency_planner.md``). ``auto`` (GPUs only):
    what ``torch.cuda.mem_get_info`` reports free on each device once every model is asleep, less
    ``device_budget_margin_mb``. A budget below what one phase needs stops the run before it starts."""
    device_budget_margin_mb: float = Field(2048.0, ge=0)
    """With ``device_budget_mb=auto``: MiB per device left out of the budget for what the plan does
    not see (activations, the rollout's caches, allocator fragmentation, communication buffers)."""
    prefetch: bool = True
    """With a budget: run transitions non-blocking and overlap them with compute. A phase's models
    start loading before the phase when the device has room for them beside the current phase's
    (each module of a forward pass waits only for its own weights), and moves out that are not
    needed for room run behind the next phase. False: every move completes before the phase."""

    @field_validator("device_budget_mb", mode="before")
    @classmethod
    def _budget_value(cls, v):
        if v is None or v == "auto" or isinstance(v, (int, float)) and not isinstance(v, bool):
            return v
        try:
            return float(v)
        except (TypeError, ValueError):
            raise ValueError(f"must be a number of MiB, 'auto' or null, got {v!r}") from None

    @model_validator(mode="after")
    def _budget_needs_the_manager(self) -> "MemoryPolicy":
        if self.device_budget_mb is not None and not self.enabled:
            raise ValueError(
                "memory.device_budget_mb plans what the memory manager keeps resident: it needs "
                "memory.enabled=true (or set memory.device_budget_mb=null)"
            )
        if isinstance(self.device_budget_mb, float) and self.device_budget_mb <= 0:
            raise ValueError(f"memory.device_budget_mb must be > 0 MiB, got {self.device_budget_mb:g}")
        return self


class CheckpointConfig(Section):
    """Checkpoints of the run, resuming it, and restarting dead actors.

    A run checkpoint is a directory ``iter_<N>`` (N: iterations completed) under
    :attr:`directory` holding every trainer's state (megatron-core ``dist_checkpointing``, written
    from the host store while the trainer sleeps, see :mod:`chatlearn_mem.checkpoint`) and the
    run's own state (``run.json``: the iteration counter, the log and memory timeline so far),
    written last; then an atomic rename makes it complete. Anything else is ignored on resume."""

    directory: Optional[Path] = None
    """Where run checkpoints go (default: ``<output_dir>/checkpoints``). With more than one node it
    must be a filesystem every node sees. Checked writable, with room for ``keep_last + 1``
    checkpoints, before the first iteration."""
    every: int = Field(0, ge=0)
    """Save after every this many iterations, and after the last one (0: no checkpoints). The
    comparison iterations (``memory.compare_iterations``) are never saved."""
    keep_last: int = Field(2, ge=1)
    """Complete checkpoints kept; older ones are deleted once a newer one is complete."""
    async_save: bool = True
    """Write a checkpoint in the trainers' background while the next iteration's generate,
    reference and values phases run; it is completed (and becomes the newest) before the critic
    trains again. False: the iteration waits for the write."""
    resharding: bool = True
    """Save the distributed optimizer in megatron's ``fully_reshardable`` format, so that a resume
    may change the tensor- and data-parallel split. It copies the optimizer state into
    model-space tensors before the save returns, so an asynchronous save blocks for that copy.
    False: ``dp_reshardable``, written straight from the host store (the save returns at once),
    resumable with another data-parallel size only (megatron-core 0.14+)."""
    resume: Union[bool, Literal["auto"]] = False
    """``true`` (``--resume``): continue from the newest complete checkpoint, an error when there is
    none. ``auto``: the same, or a fresh start (said so) when there is none. ``false``: a fresh
    start; checkpoints of an earlier run in :attr:`directory` stop it unless
    ``output_dir_exists=overwrite`` (which deletes them)."""
    max_restarts: int = Field(0, ge=0)
    """When an actor process dies or a phase times out, tear every actor down, start them again
    and continue from the newest checkpoint (from the start when there is none yet), up to this
    many times per run; past that the run stops naming the actor and the phase. An exception
    raised by an actor's code (which would recur) is never retried."""
    elastic: bool = False
    """When a restart finds fewer resources than the run needs, even after ``ray.node_wait_s``:
    go on with the largest data-parallel size the cluster still holds (the checkpoint resharded to
    it; the results then differ from those of the original layout, and the run says so). False:
    stop, naming what is missing."""
    on_sigterm: bool = True
    """On SIGTERM (what a scheduler sends before it preempts a job), with checkpoints on: once the
    current iteration ends, save a checkpoint of the iterations done (unless the newest already
    holds them) before stopping, when the previous save took less than :attr:`sigterm_grace_s`.
    The run then exits 143 saying how far it got and how to resume. False: stop without saving."""
    sigterm_grace_s: float = Field(30.0, gt=0)
    """Seconds a scheduler leaves between SIGTERM and SIGKILL (30 is both Kubernetes' and Slurm's
    default). The SIGTERM checkpoint is skipped, and the line says so, when the previous save took
    longer than what is left of it."""


class RolloutConfig(Section):
    """Which engine generates the rollouts."""

    engine: Literal["megatron", "vllm"] = "megatron"
    """``megatron``: an inference copy of the policy under a memory manager, sampled token by token.
    ``vllm``: a vLLM engine started from the policy's Hugging Face checkpoint (``policy.from_hf``),
    its weights replaced from the policy's host store before every generate phase that follows a
    train phase, streamed in buckets of ``sync_bucket_mb`` and verified bit for bit (see
    docs/vllm.md; vLLM is installed apart)."""
    sync_bucket_mb: float = Field(512.0, gt=0)
    """vllm: the most bytes of converted weights in one bucket of the stream from the policy to the
    engine (each policy rank has at most two buckets in flight)."""
    kv_cache_gib: int = Field(1, ge=1)
    """vllm on a CPU-only machine: the engine's KV cache."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """vllm on CUDA: the share of the GPU the engine may take for its weights and KV cache. The
    engine starts with every trainer asleep, so it measures the room it will have beside them."""
    max_model_len: Optional[int] = Field(None, ge=1)
    """vllm: the longest prompt plus response the engine serves (None: ``policy.seq_length``)."""
    enforce_eager: bool = True
    """vllm on CUDA: no CUDA graphs (they pin memory the engine's sleep cannot release, and take
    seconds to capture); False lets vLLM capture them."""
    sync_baseline: bool = False
    """vllm: after each weight sync, time a plain copy of the same weights from the policy's host
    store through one bucket-sized host buffer (no second copy of the weights is held), the sync's
    baseline (``log.json``: each iteration's ``weight_sync``, and ``summary.weight_sync``)."""
    mismatch_warn: Optional[float] = Field(None, gt=0)
    """vllm: warn when the policy's and the engine's log-probs of the same sampled tokens differ by
    more than this (max absolute difference; every iteration's is in ``log.json``); more than 10x
    this (or not a number) stops the run. None: by the policy's precision, a tenth of the bound
    measured for it (``chatlearn_mem.engines.vllm_rollout.MISMATCH_BOUNDS``: fp32 1e-4, bf16 0.15)."""


def _default_policy() -> TrainerModelConfig:
    return TrainerModelConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=64, seq_length=16, lr=1e-3
    )


C = TypeVar("C", bound="LoopConfig")


class LoopConfig(Section):
    """What every loop on the colocation service shares: the policy, its parallel layout, the
    rollout engine, the task, the memory policy, Ray, checkpoints and the output directory.

    A loop's own config subclasses it with one section of its own (``ppo``, ``grpo``, ...) named
    by :attr:`loop_section`; that section holds at least ``iterations`` and ``seed``. Subclasses
    add models (PPO's ``critic``) and cross-field checks (:meth:`_problems`)."""

    loop_section: ClassVar[str] = "loop"
    """The name of the loop's own section."""
    model_sections: ClassVar[tuple[str, ...]] = ("policy",)
    """Sections that hold a :class:`TrainerModelConfig` (``{output_dir}`` is filled in each)."""
    presets: ClassVar[Optional[Traversable]] = None
    """Where the loop's shipped presets are (a package's resources); None: a YAML path only."""

    policy: TrainerModelConfig = Field(default_factory=_default_policy)
    """The policy trainer; the rollout (and a reference) are inference copies of it."""
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    memory: MemoryPolicy = Field(default_factory=MemoryPolicy)
    ray: RayConfig = Field(default_factory=RayConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    logger: list[Literal["console", "tensorboard", "wandb", "mlflow"]] = Field(default_factory=lambda: ["console"])
    """Where each iteration's metrics go, any of ``console`` (the line per iteration), ``tensorboard``,
    ``wandb``, ``mlflow`` (the ``[tensorboard]``, ``[wandb]``, ``[mlflow]`` extras); ``log.json`` is
    always written."""
    trackers: TrackerConfig = Field(default_factory=TrackerConfig)
    output_dir: Path = Path("runs/loop")
    """Where the JSON log and the memory timeline PNG go. Checked writable before Ray starts;
    ``log.json`` is rewritten (atomically) after every iteration."""
    output_dir_exists: Literal["error", "overwrite"] = "error"
    """When ``output_dir`` already holds another run's ``log.json`` with at least one iteration:
    ``error`` stops before anything starts; ``overwrite`` replaces that run's log and picture (and
    deletes its checkpoints). Resuming (``checkpoint.resume``) continues the log instead."""

    @property
    def loop(self):
        """The loop's own section (``self.ppo``, ``self.grpo``, ...)."""
        return getattr(self, self.loop_section)

    @property
    def checkpoint_dir(self) -> Path:
        """``checkpoint.directory``, or ``<output_dir>/checkpoints``."""
        return (
            Path(self.checkpoint.directory)
            if self.checkpoint.directory is not None
            else (Path(self.output_dir) / "checkpoints")
        )

    _architecture_notes: list[str] = PrivateAttr(default_factory=list)

    @property
    def architecture_notes(self) -> list[str]:
        """One line per model whose ``from_hf`` checkpoint decided architecture fields over the preset's."""
        return list(self._architecture_notes)

    @model_validator(mode="before")
    @classmethod
    def _checkpoint_paths(cls, data, info: ValidationInfo):
        if not isinstance(data, dict):
            return data
        out_dir = str(data.get("output_dir", cls.model_fields["output_dir"].default))
        data = dict(data)
        for role in cls.model_sections:
            if isinstance(data.get(role), dict) and "{output_dir}" in str(data[role].get("from_hf") or ""):
                data[role] = {**data[role], "from_hf": str(data[role]["from_hf"]).replace("{output_dir}", out_dir)}
        data = cls._derive(data)
        context = info.context if isinstance(info.context, dict) else None
        user_keys = context.get("user_keys") if context is not None else None
        data, notes = checkpoint_decides(data, cls.model_sections, user_keys)
        if context is not None:
            context["architecture_notes"] = notes
        return data

    @model_validator(mode="after")
    def _notes(self, info: ValidationInfo) -> "LoopConfig":
        if isinstance(info.context, dict):
            self._architecture_notes = list(info.context.get("architecture_notes", []))
        return self

    @classmethod
    def _derive(cls, data: dict) -> dict:
        """Fill in what one section derives from another (before validation)."""
        return data

    @model_validator(mode="after")
    def _consistent(self) -> "LoopConfig":
        problems = self._problems()
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _problems(self) -> list[str]:
        """Every cross-field problem, each one sentence naming the keys and values."""
        problems = []
        p, loop = self.policy, self.loop
        prompt_key, prompt_tokens = self._prompt_tokens()
        total = prompt_tokens + loop.response_length
        s = self.loop_section
        for name in self.model_sections:
            m = getattr(self, name)
            if total > m.seq_length:
                problems.append(
                    f"{prompt_key} + {s}.response_length ({total}) exceeds {name}.seq_length ({m.seq_length})"
                )
            tp = self.parallel.tensor_model_parallel_size
            if m.backend == "torch" and tp > 1:
                problems.append(
                    f"{name}.backend is torch, which trains in data parallel only; "
                    f"parallel.tensor_model_parallel_size must be 1, got {tp}"
                )
            elif m.num_attention_heads % tp or m.vocab_size % tp:
                problems.append(
                    f"parallel.tensor_model_parallel_size ({tp}) must divide "
                    f"{name}.num_attention_heads ({m.num_attention_heads}) and "
                    f"{name}.vocab_size ({m.vocab_size})"
                )
        problems += self._model_problems()
        if self.task.target_high > p.vocab_size:
            problems.append(f"task.target_high ({self.task.target_high}) exceeds policy.vocab_size ({p.vocab_size})")
        problems += self._batch_problems()
        if self.export.hf_every:
            from chatlearn_mem_ray.config.model import export_problem

            why = export_problem(p)
            if why:
                problems.append(
                    f"export.hf_every={self.export.hf_every}: {why}; set policy.from_hf to a Llama or Qwen2 "
                    "checkpoint, or export.hf_every=0"
                )
        if self.rollout.engine == "vllm":
            if p.from_hf is None:
                problems.append(
                    "rollout.engine: vllm starts the engine from the policy's Hugging Face checkpoint: set policy.from_hf"
                )
        return problems

    @property
    def mismatch_warn(self) -> float:
        """``rollout.mismatch_warn``, or a tenth of the bound measured for the policy's precision."""
        if self.rollout.mismatch_warn is not None:
            return self.rollout.mismatch_warn
        from chatlearn_mem.engines.vllm_rollout import mismatch_bound

        return mismatch_bound(self.policy.precision).max_abs / 10

    def _prompt_tokens(self) -> tuple[str, int]:
        """The longest prompt, in tokens, and the key that says so."""
        return f"{self.loop_section}.prompt_length", self.loop.prompt_length

    def _model_problems(self) -> list[str]:
        return []

    def _batch_problems(self) -> list[str]:
        return []


def load_config(
    source: Optional[str | os.PathLike] = None, overrides: Sequence[str] = (), schema: Optional[type[C]] = None
) -> C:
    """Build a loop's config from a preset name or YAML path, then dotted ``key=value`` overrides.

    Args:
        source: A preset name of ``schema`` (its :attr:`LoopConfig.presets`: ``cpu_tiny``, ``gpu``
            for PPO) or the path of a YAML file; None starts from the defaults.
        overrides: ``ppo.iterations=5``, ``memory.enabled=false``, ...; values are parsed as YAML.
        schema: The loop's config class: :class:`~chatlearn_mem_ray.loops.ppo.RunConfig` (PPO),
            :class:`~chatlearn_mem_ray.loops.grpo.config.GRPORunConfig`, or your own
            :class:`LoopConfig` subclass. None: PPO's, with a ``DeprecationWarning`` (name the
            schema, or call ``chatlearn_mem_ray.load_config``, whose default is PPO's).

    Raises:
        ConfigError: The source is missing or not a YAML mapping, an override is malformed, or
            the result is invalid; the message lists every problem with its dotted key.
        TypeError: ``schema`` is not a :class:`LoopConfig` subclass.
    """
    if schema is None:
        schema = moved("RunConfig", "load_config without a schema: pass chatlearn_mem_ray.RunConfig")
    if not (isinstance(schema, type) and issubclass(schema, LoopConfig)):
        raise TypeError(
            f"schema must be the loop's LoopConfig subclass (chatlearn_mem_ray.RunConfig for PPO, "
            f"GRPORunConfig, or your own), got {schema!r}"
        )
    return _load(schema, source, overrides, presets=schema.presets)


_MOVED = {
    "RunConfig": "chatlearn_mem_ray.loops.ppo",
    "PPOConfig": "chatlearn_mem_ray.loops.ppo",
    "PRESETS": "chatlearn_mem_ray.loops.ppo",
    "DEFAULT_PRESET": "chatlearn_mem_ray.loops.ppo",
    "GRPORunConfig": "chatlearn_mem_ray.loops.grpo.config",
    "GRPOConfig": "chatlearn_mem_ray.loops.grpo.config",
    "ReferenceConfig": "chatlearn_mem_ray.loops.grpo.config",
    "GRPO_PRESETS": "chatlearn_mem_ray.loops.grpo.config",
    "DEFAULT_GRPO_PRESET": "chatlearn_mem_ray.loops.grpo.config",
    "load_grpo_config": "chatlearn_mem_ray.loops.grpo.config",
    "TokenizerConfig": "chatlearn_mem_ray.inputs.data",
    "RewardConfig": "chatlearn_mem_ray.inputs.rewards",
}


def moved(name: str, what: str = ""):
    """A loop's own config name that moved next to its recipe, from where it lives now, with a
    ``DeprecationWarning`` saying ``what`` moved (a redirect, not a dependency: the layering test
    lets this function and a module's ``__getattr__`` import from above).

    Raises:
        AttributeError: ``name`` never lived in ``chatlearn_mem_ray.config``."""
    if name not in _MOVED:
        raise AttributeError(f"module 'chatlearn_mem_ray.config' has no attribute {name!r}")
    what = what or f"chatlearn_mem_ray.config.{name} moved to {_MOVED[name]}.{name}"
    import importlib
    import warnings

    warnings.warn(f"{what} (or import it from chatlearn_mem_ray)", DeprecationWarning, stacklevel=3)
    return getattr(importlib.import_module(_MOVED[name]), name)
