"""Configuration of a loop on the colocation service: one pydantic model per component, YAML plus overrides.

Every loop shares :class:`LoopConfig` (the policy, its layout, the rollout engine, the task, memory,
Ray, checkpoints, output); a PPO run is a :class:`RunConfig` (adds the critic and ``ppo``), a GRPO
run a :class:`GRPORunConfig` (adds ``reference`` and ``grpo``). :func:`load_config` reads a preset or a YAML file,
applies ``key=value`` overrides (dotted keys, YAML-typed values: ``ppo.iterations=5``,
``memory.enabled=false``) and validates everything at once with the project's one loader
(:func:`chatlearn_mem_config_files.load_config`); its ``ConfigError`` lists every problem, so a bad
run fails before Ray or any model starts.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import ClassVar, Literal, Optional, Sequence, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from chatlearn_mem import MemoryConfig
from chatlearn_mem.models.gpt import GPTTrainerConfig
from chatlearn_mem_config_files import load_config as _load
from chatlearn_mem_ray.data import DataConfig

__all__ = [
    "CheckpointConfig",
    "DEFAULT_GRPO_PRESET",
    "DEFAULT_PRESET",
    "GRPOConfig",
    "GRPORunConfig",
    "GRPO_PRESETS",
    "LoopConfig",
    "MemoryPolicy",
    "PPOConfig",
    "PRESETS",
    "ReferenceConfig",
    "RewardConfig",
    "TokenizerConfig",
    "RolloutConfig",
    "ParallelConfig",
    "RayConfig",
    "RunConfig",
    "TaskConfig",
    "TrainerModelConfig",
    "load_config",
    "load_grpo_config",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RayConfig(_Strict):
    """Where the actors run."""

    address: Optional[str] = None
    """Which Ray cluster the run uses (see :func:`chatlearn_mem_ray.connect.resolve_address`):

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


class ParallelConfig(_Strict):
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


class TaskConfig(_Strict):
    """The rule-based toy task: reward = fraction of response tokens in ``[target_low, target_high)``.

    A randomly initialised policy samples tokens nearly uniformly, so it starts near
    ``(target_high - target_low) / vocab_size``; PPO pushes it towards 1.
    """

    name: Literal["token_range"] = "token_range"
    """Which task (only one is built in; add yours in ``chatlearn_mem_ray.ppo.TASKS``)."""
    target_low: int = Field(0, ge=0)
    """Lowest rewarded token id."""
    target_high: int = Field(16, ge=1)
    """One past the highest rewarded token id."""

    @model_validator(mode="after")
    def _range(self) -> "TaskConfig":
        if self.target_high <= self.target_low:
            raise ValueError(f"target_high ({self.target_high}) must be > target_low ({self.target_low})")
        return self


class PPOConfig(_Strict):
    """PPO hyper-parameters and batch shape."""

    iterations: int = Field(20, ge=1)
    """Rollout + train iterations, numbered 1 to ``iterations`` on the console (``iter 3/20``), in
    ``log.json`` and in the memory picture; the checkpoint ``iter_<K>`` holds iterations 1 to K."""
    prompts_per_iteration: int = Field(32, ge=1)
    """Prompts sampled per iteration (one response each); divided among data-parallel ranks."""
    prompt_length: int = Field(4, ge=1)
    """Tokens per prompt (random ids)."""
    response_length: int = Field(8, ge=1)
    """Tokens generated per prompt (fixed length, no early stop)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature (> 0: greedy decoding has no log-probabilities for PPO to optimise). The
    rollout samples at it, and every log-probability (the policy's ratio, the reference's KL) is
    taken under the same tempered distribution."""
    ppo_epochs: int = Field(2, ge=1)
    """Passes over each iteration's batch."""
    minibatch_size: int = Field(8, ge=1)
    """Sequences per optimizer step on each data-parallel rank."""
    clip_ratio: float = Field(0.2, gt=0)
    """PPO clip range of the probability ratio."""
    value_clip: float = Field(0.2, gt=0)
    """Clip range of the value prediction around the rollout's value."""
    kl_coef: float = Field(0.05, ge=0)
    """Per-token KL penalty towards the reference model, subtracted from the reward."""
    gamma: float = Field(1.0, gt=0, le=1)
    """Discount."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE lambda."""
    seed: int = 0
    """Seed of prompts and sampling."""

    @model_validator(mode="after")
    def _whitening_defined(self) -> "PPOConfig":
        n = self.prompts_per_iteration * self.response_length
        if n < 2:
            raise ValueError(
                f"ppo.prompts_per_iteration x ppo.response_length must be >= 2, got "
                f"{self.prompts_per_iteration} x {self.response_length}: advantages are "
                "whitened by their standard deviation, which one advantage does not have"
            )
        return self


class MemoryPolicy(_Strict):
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


class CheckpointConfig(_Strict):
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


class RolloutConfig(_Strict):
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


class TrainerModelConfig(GPTTrainerConfig):
    """A trainer's :class:`~chatlearn_mem.models.gpt.GPTTrainerConfig`, and the Hugging Face
    checkpoint its weights start from."""

    from_hf: Optional[Path] = None
    """A local Hugging Face Llama or Qwen2 checkpoint directory (``config.json`` and
    ``*.safetensors``) the weights start from instead of a random init; ``{output_dir}`` in it
    stands for the run's ``output_dir``. Its ``config.json`` fills
    the architecture fields left unset here (see ``chatlearn_mem.models.hf.CHECKPOINT_FIELDS``; a
    field set to another value is an error). The rollout and reference models start from the
    policy's checkpoint; the critic takes its trunk (embedding and layers) and a fresh value head.
    With several nodes the directory must be readable on every node."""
    create_hf: bool = False
    """When ``from_hf`` does not exist yet, write a randomly initialised checkpoint of this
    config's architecture there (with ``transformers``: nothing is downloaded) before the actors
    start; the architecture fields must then be given here. Used by the ``cpu_tiny_llama`` preset."""

    @model_validator(mode="before")
    @classmethod
    def _fields_from_checkpoint(cls, data):
        if not isinstance(data, dict) or not data.get("from_hf"):
            return data
        path = Path(data["from_hf"])
        if not path.exists() and data.get("create_hf"):
            return data  # written when the run starts, from the fields given here
        try:
            from chatlearn_mem.models import hf

            found = hf.config_from_hf(path)
        except (FileNotFoundError, ImportError) as e:
            raise ValueError(str(e)) from None
        data = dict(data)
        wrong = []
        for field in (*hf.CHECKPOINT_FIELDS, "precision"):
            value = getattr(found, field)
            if field not in data:
                data[field] = value
            elif field != "precision" and data[field] != value:
                wrong.append(f"{field}={data[field]!r} (config.json: {value!r})")
        if wrong:
            raise ValueError(
                f"the checkpoint {path} says otherwise: {', '.join(wrong)}; drop these keys (from_hf fills them in)"
            )
        return data


_TRUNK_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "vocab_size",
    "seq_length",
    "num_query_groups",
    "ffn_hidden_size",
    "normalization",
    "norm_epsilon",
    "activation",
    "position_embedding",
    "rotary_base",
    "add_bias_linear",
    "add_qkv_bias",
    "share_embeddings_and_output_weights",
    "precision",
)
"""What a critic copies from a policy with ``from_hf``, so that the checkpoint's trunk fits it."""


class GRPOConfig(_Strict):
    """GRPO hyper-parameters and batch shape: ``group_size`` responses per prompt, advantages
    normalised within each prompt's group, no critic (see :mod:`chatlearn_mem_ray.grpo`)."""

    iterations: int = Field(20, ge=1)
    """Rollout + train iterations, numbered 1 to ``iterations`` (as PPO's)."""
    prompts_per_iteration: int = Field(8, ge=1)
    """Prompts per iteration; each is sampled ``group_size`` times, so a batch holds
    ``prompts_per_iteration x group_size`` responses, divided among data-parallel ranks."""
    group_size: int = 4
    """Responses sampled per prompt (8 in slime and ROLL, 16 in NeMo-RL); each response's
    advantage is its reward against the others of its group, so at least 2."""
    prompt_length: int = Field(4, ge=1)
    """Tokens per prompt (random ids on the built-in task)."""
    response_length: int = Field(8, ge=1)
    """Tokens generated per response."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; every log-probability (the ratio, the KL to the reference, the
    entropy) is taken under the same tempered distribution."""
    epochs: int = Field(1, ge=1)
    """Passes over each iteration's batch (1: on-policy, the ratio starts at 1)."""
    minibatch_size: int = Field(8, ge=1)
    """Responses per optimizer step on each data-parallel rank."""
    clip_low: float = Field(0.2, gt=0, lt=1)
    """The ratio's lower clip: ``1 - clip_low``."""
    clip_high: float = Field(0.2, gt=0)
    """The ratio's upper clip: ``1 + clip_high`` (0.28 is DAPO's "clip higher")."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL-to-reference loss term (the k3 estimator ``exp(ref - new) - (ref - new) - 1``,
    per token). 0: no reference model is launched at all."""
    variant: Literal["grpo", "dr_grpo"] = "grpo"
    """``grpo``: advantages ``(r - mean) / (std + 1e-6)`` within a group, each response's token
    losses averaged, then the responses averaged. ``dr_grpo`` (Dr. GRPO): advantages ``r - mean``
    (no division by the std), token losses summed and divided by a constant (the minibatch's
    responses x ``response_length``), so neither a group's spread nor a response's length
    rescales its gradient."""
    seed: int = 0
    """Seed of prompts and sampling."""

    @field_validator("group_size")
    @classmethod
    def _a_group(cls, v: int) -> int:
        if v < 2:
            raise ValueError(
                f"must be >= 2, got {v}: a response's advantage is its reward against the "
                "other responses to the same prompt, and a group of one has none to compare with"
            )
        return v


class TokenizerConfig(_Strict):
    """The tokenizer of a run on text (``data`` set): prompts encoded, responses decoded."""

    path: Optional[Path] = None
    """A Hugging Face tokenizer directory (``AutoTokenizer``, local files only); None: the policy's
    ``from_hf`` directory. ``{output_dir}`` stands for the run's ``output_dir``."""
    stop: list[str] = Field(default_factory=list)
    """Stop strings: a response ends at the first (its text cut there, its tokens after it masked),
    as it ends at the tokenizer's EOS token."""
    log_samples: int = Field(2, ge=0)
    """Sample texts (prompt, response, reward) kept per iteration in ``log.json``; the console shows
    the first one every fifth iteration."""


class RewardConfig(_Strict):
    """How responses are scored (see :mod:`chatlearn_mem_ray.rewards`)."""

    function: str = "token_range"
    """``token_range`` (the toy rule on random token ids, runs without ``data``), ``exact_match``,
    ``math``, or your own: ``"package.module:function"`` or ``"path/to/file.py:function"``, called
    with ``(prompts, responses, **fields)`` (the texts and each row's other fields) and returning one
    float per response, or a dict with them under ``"reward"`` and more named scores to log."""


class ReferenceConfig(_Strict):
    """The frozen reference model of the KL term."""

    from_hf: Optional[Path] = None
    """A Hugging Face checkpoint of the policy's architecture (an SFT model, say); None: the
    policy's initial weights (its ``from_hf`` checkpoint, or its seed's random init)."""


def _default_policy() -> TrainerModelConfig:
    return TrainerModelConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=64, seq_length=16, lr=1e-3
    )


def _default_critic() -> TrainerModelConfig:
    return TrainerModelConfig(**_DEFAULT_CRITIC)


_DEFAULT_CRITIC = dict(
    num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=64, seq_length=16, lr=3e-3, seed=4321
)


C = TypeVar("C", bound="LoopConfig")


class LoopConfig(_Strict):
    """What every loop on the colocation service shares: the policy, its parallel layout, the
    rollout engine, the task, the memory policy, Ray, checkpoints and the output directory.

    A loop's own config subclasses it with one section of its own (``ppo``, ``grpo``, ...) named
    by :attr:`loop_section`; that section holds at least ``iterations`` and ``seed``. Subclasses
    add models (PPO's ``critic``) and cross-field checks (:meth:`_problems`)."""

    loop_section: ClassVar[str] = "loop"
    """The name of the loop's own section."""
    model_sections: ClassVar[tuple[str, ...]] = ("policy",)
    """Sections that hold a :class:`TrainerModelConfig` (``{output_dir}`` is filled in each)."""

    policy: TrainerModelConfig = Field(default_factory=_default_policy)
    """The policy trainer; the rollout (and a reference) are inference copies of it."""
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    memory: MemoryPolicy = Field(default_factory=MemoryPolicy)
    ray: RayConfig = Field(default_factory=RayConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
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

    @model_validator(mode="before")
    @classmethod
    def _checkpoint_paths(cls, data):
        if not isinstance(data, dict):
            return data
        out_dir = str(data.get("output_dir", cls.model_fields["output_dir"].default))
        data = dict(data)
        for role in cls.model_sections:
            if isinstance(data.get(role), dict) and "{output_dir}" in str(data[role].get("from_hf") or ""):
                data[role] = {**data[role], "from_hf": str(data[role]["from_hf"]).replace("{output_dir}", out_dir)}
        return cls._derive(data)

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
            if m.num_attention_heads % tp or m.vocab_size % tp:
                problems.append(
                    f"parallel.tensor_model_parallel_size ({tp}) must divide "
                    f"{name}.num_attention_heads ({m.num_attention_heads}) and "
                    f"{name}.vocab_size ({m.vocab_size})"
                )
        problems += self._model_problems()
        if self.task.target_high > p.vocab_size:
            problems.append(f"task.target_high ({self.task.target_high}) exceeds policy.vocab_size ({p.vocab_size})")
        problems += self._batch_problems()
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


class RunConfig(LoopConfig):
    """A whole colocated PPO run."""

    loop_section: ClassVar[str] = "ppo"
    model_sections: ClassVar[tuple[str, ...]] = ("policy", "critic")

    critic: TrainerModelConfig = Field(default_factory=_default_critic)
    """The critic trainer (a GPT trunk with a scalar value head). When the policy has
    ``from_hf`` and the critic does not say otherwise, the critic starts from the same
    checkpoint's trunk, with the policy's architecture and shape."""
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    output_dir: Path = Path("runs/ppo")
    """Where the JSON log and the memory timeline PNG go. Checked writable before Ray starts;
    ``log.json`` is rewritten (atomically) after every iteration. Each iteration's entry holds
    ``reward`` (mean task reward of the rollouts), ``policy_loss`` (``pg`` on the console: the
    policy-gradient loss), ``value_loss`` (``vf``: the value-function loss), ``kl`` (KL(policy ||
    reference) per token) and the phases' seconds and device bytes."""

    @classmethod
    def _derive(cls, data: dict) -> dict:
        if not isinstance(data.get("policy"), dict) or not data["policy"].get("from_hf"):
            return data
        policy = data["policy"]
        if isinstance(data.get("critic"), dict):
            critic = dict(data["critic"])
        else:  # the default critic's own settings; its shape is the checkpoint's
            critic = {k: v for k, v in _DEFAULT_CRITIC.items() if k not in _TRUNK_FIELDS}
        if "from_hf" in critic:
            return data
        for field in _TRUNK_FIELDS:
            if field in policy:
                critic.setdefault(field, policy[field])
        critic["from_hf"] = policy["from_hf"]
        critic["create_hf"] = policy.get("create_hf", False)  # written once, from the policy's config
        return {**data, "critic": critic}

    def _model_problems(self) -> list[str]:
        if self.critic.vocab_size != self.policy.vocab_size:
            return [
                f"critic.vocab_size ({self.critic.vocab_size}) must equal policy.vocab_size ({self.policy.vocab_size})"
            ]
        return []

    def _batch_problems(self) -> list[str]:
        ppo, dp = self.ppo, self.parallel.data_parallel_size
        if ppo.prompts_per_iteration % dp:
            return [
                f"ppo.prompts_per_iteration ({ppo.prompts_per_iteration}) must be "
                f"divisible by the data-parallel size ({dp})"
            ]
        if (ppo.prompts_per_iteration // dp) % ppo.minibatch_size:
            return [
                f"ppo.minibatch_size ({ppo.minibatch_size}) must divide the prompts per "
                f"data-parallel rank ({ppo.prompts_per_iteration // dp})"
            ]
        return []


class GRPORunConfig(LoopConfig):
    """A whole colocated GRPO run: the policy, its rollout and (with ``grpo.kl_coef`` > 0) a
    frozen reference; no critic."""

    loop_section: ClassVar[str] = "grpo"

    reference: Optional[ReferenceConfig] = Field(default_factory=ReferenceConfig)
    """The reference model of the KL term; null: none configured (then ``grpo.kl_coef`` must be 0).
    It is launched only when ``grpo.kl_coef`` > 0."""
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    data: Optional[DataConfig] = None
    """Your prompts (:mod:`chatlearn_mem_ray.data`); None: random token ids scored by ``task``."""
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    output_dir: Path = Path("runs/grpo")
    """Where the JSON log and the memory timeline PNG go (as PPO's ``output_dir``)."""

    @property
    def launches_reference(self) -> bool:
        """Whether the run has a reference model: only when the KL term is on."""
        return self.grpo.kl_coef > 0

    @property
    def tokenizer_dir(self) -> Optional[Path]:
        """Where the tokenizer is read from: ``tokenizer.path``, else the policy's checkpoint."""
        return self.tokenizer.path if self.tokenizer.path is not None else self.policy.from_hf

    @classmethod
    def _derive(cls, data: dict) -> dict:
        out_dir = str(data.get("output_dir", cls.model_fields["output_dir"].default))

        def fill(v):
            return str(v).replace("{output_dir}", out_dir) if isinstance(v, (str, Path)) else v

        for section, key in (("data", "train_files"), ("tokenizer", "path"), ("reference", "from_hf")):
            if isinstance(data.get(section), dict) and key in data[section]:
                v = data[section][key]
                data = {
                    **data,
                    section: {**data[section], key: [fill(x) for x in v] if isinstance(v, list) else fill(v)},
                }
        return data

    def _prompt_tokens(self) -> tuple[str, int]:
        if self.data is not None:
            return "data.max_prompt_tokens", self.data.max_prompt_tokens
        return super()._prompt_tokens()

    def _model_problems(self) -> list[str]:
        problems = []
        if self.grpo.kl_coef > 0 and self.reference is None:
            problems.append(
                f"grpo.kl_coef={self.grpo.kl_coef:g} needs a reference model, and reference is null: set "
                "reference: {} (the policy's initial weights) or reference.from_hf, or grpo.kl_coef=0"
            )
        text = self.reward.function != "token_range"
        if self.data is not None and not text:
            problems.append(
                "reward.function=token_range scores random token ids; with data.train_files give a text reward: "
                "exact_match, math, or 'package.module:function'"
            )
        if self.data is None and text:
            problems.append(
                f"reward.function={self.reward.function} scores text: set data.train_files (your prompts) too"
            )
        if self.data is not None and self.tokenizer_dir is None:
            problems.append(
                "data.train_files needs a tokenizer: set tokenizer.path, or policy.from_hf (its directory's)"
            )
        return problems

    def _batch_problems(self) -> list[str]:
        g, dp = self.grpo, self.parallel.data_parallel_size
        batch = g.prompts_per_iteration * g.group_size
        if batch % dp:
            return [
                f"grpo.prompts_per_iteration x grpo.group_size ({batch}) must be divisible by the "
                f"data-parallel size ({dp})"
            ]
        if (batch // dp) % g.minibatch_size:
            return [
                f"grpo.minibatch_size ({g.minibatch_size}) must divide the responses per data-parallel "
                f"rank ({batch // dp} = prompts_per_iteration x group_size / {dp})"
            ]
        return []


PRESETS = resources.files("chatlearn_mem_ray.presets")
"""The shipped PPO presets (``configs/ppo/*.yaml`` in the repository, installed with the package)."""
GRPO_PRESETS = resources.files("chatlearn_mem_ray.grpo_presets")
"""The shipped GRPO presets (``configs/grpo/*.yaml``)."""
DEFAULT_PRESET = "cpu_tiny"
"""What ``chatlearn-mem ppo`` runs without ``--config``: the CPU default (about 30 s on 2 cores)."""
DEFAULT_GRPO_PRESET = "cpu_grpo"
"""What ``chatlearn-mem grpo`` runs without ``--config``."""


def load_config(
    source: Optional[str | os.PathLike] = None, overrides: Sequence[str] = (), schema: type[C] = RunConfig
) -> C:
    """Build a run config from a preset name or YAML path, then dotted ``key=value`` overrides.

    Args:
        source: A preset name (``cpu_tiny``, ``gpu``; see :data:`PRESETS`, or :data:`GRPO_PRESETS`
            for :class:`GRPORunConfig`) or the path of a YAML file; None starts from the defaults.
        overrides: ``ppo.iterations=5``, ``memory.enabled=false``, ...; values are parsed as YAML.
        schema: The config class: :class:`RunConfig` (PPO, the default), :class:`GRPORunConfig`,
            or a loop's own :class:`LoopConfig` subclass (whose presets, if any, are YAML paths).

    Raises:
        ConfigError: The source is missing or not a YAML mapping, an override is malformed, or
            the result is invalid; the message lists every problem with its dotted key.
    """
    presets = {RunConfig: PRESETS, GRPORunConfig: GRPO_PRESETS}.get(schema)
    return _load(schema, source, overrides, presets=presets)


def load_grpo_config(source: Optional[str | os.PathLike] = None, overrides: Sequence[str] = ()) -> GRPORunConfig:
    """:func:`load_config` for GRPO (presets from :data:`GRPO_PRESETS`)."""
    return load_config(source, overrides, GRPORunConfig)
