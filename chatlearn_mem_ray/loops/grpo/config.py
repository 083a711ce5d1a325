"""GRPO's config: the shared :class:`~chatlearn_mem_ray.config.LoopConfig` with the ``grpo`` section,
the reference model, and the run's text inputs (``data``, ``tokenizer``, ``reward``)."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import ClassVar, Literal, Optional, Sequence

from pydantic import Field, field_validator, model_validator

from chatlearn_mem_ray.config import LoopConfig, Section, load_config
from chatlearn_mem_ray.inputs.data import DataConfig, TokenizerConfig
from chatlearn_mem_ray.inputs.rewards import RewardConfig

__all__ = [
    "DEFAULT_GRPO_PRESET",
    "GRPOConfig",
    "GRPORunConfig",
    "GRPO_PRESETS",
    "ReferenceConfig",
    "ValidationConfig",
    "load_grpo_config",
]

GRPO_PRESETS = resources.files("chatlearn_mem_ray.grpo_presets")
"""The shipped GRPO presets (``configs/grpo/*.yaml``)."""
DEFAULT_GRPO_PRESET = "cpu_grpo"
"""What ``chatlearn-mem grpo`` runs without ``--config``."""


class GRPOConfig(Section):
    """GRPO hyper-parameters and batch shape: ``group_size`` responses per prompt, advantages
    normalised within each prompt's group, no critic (see :mod:`chatlearn_mem_ray.loops.grpo.loop`)."""

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
    """Sets the defaults of :attr:`estimator` and :attr:`loss_agg`: ``grpo`` (GRPO's paper:
    advantages ``(r - mean) / (std + 1e-6)``, each response's token losses averaged, then the
    responses) or ``dr_grpo`` (Dr. GRPO: ``r - mean``, each response's token losses summed over the
    constant ``response_length``), so neither a group's spread nor a response's length rescales
    its gradient."""
    estimator: Optional[Literal["grpo", "dr_grpo", "rloo", "reinforce_pp"]] = None
    """The advantage estimator (:mod:`~chatlearn_mem_ray.loops.grpo.losses`): ``grpo``, ``dr_grpo``,
    ``rloo`` (the other responses' mean reward as the baseline) or ``reinforce_pp`` (REINFORCE++:
    the group's mean subtracted, then whitened over the batch). None: :attr:`variant`'s."""
    loss_agg: Optional[Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]] = None
    """How token losses make the loss: ``token_mean`` (DAPO, verl's default: every token counts
    once, so long responses weigh more), ``seq_mean_token_mean`` (GRPO's paper: every response
    counts once) or ``seq_mean_token_sum_norm`` (Dr. GRPO). None: :attr:`variant`'s
    (``seq_mean_token_mean`` for ``grpo``, what every GRPO run did before this key existed)."""
    policy_loss: Literal["ppo_clip", "gspo"] = "ppo_clip"
    """``ppo_clip``: each token's ratio clipped to ``[1 - clip_low, 1 + clip_high]``; ``gspo`` (GSPO,
    as Qwen3 was trained): one ratio per response, the geometric mean of its token ratios, clipped
    per response to ``[1 - gspo_clip_low, 1 + gspo_clip_high]``."""
    gspo_clip_low: float = Field(3e-4, gt=0, lt=1)
    """GSPO's lower clip of the sequence ratio (the paper's 3e-4: a sequence ratio strays far less
    from 1 than a token's)."""
    gspo_clip_high: float = Field(4e-4, gt=0)
    """GSPO's upper clip of the sequence ratio (the paper's 4e-4)."""
    clip_ratio_c: Optional[float] = Field(None, gt=1)
    """The dual clip (verl's ``clip_ratio_c``, 3.0 there): for a negative advantage the loss is
    capped at ``clip_ratio_c x |A|``, however far the ratio goes. None: off."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop the groups whose rewards are all equal (no signal), sample more
    prompts until ``prompts_per_iteration`` groups with a spread are in hand, at most
    :attr:`dynamic_sampling_extra_rounds` more rounds (then the batch is filled up with dropped
    groups, and the log counts them)."""
    dynamic_sampling_extra_rounds: int = Field(3, ge=0)
    """With dynamic sampling: the most generation rounds after the first in one iteration."""
    seed: int = 0
    """Seed of prompts and sampling."""

    @field_validator("group_size")
    @classmethod
    def _a_group(cls, v: int) -> int:
        if v < 2:
            raise ValueError(
                f"must be >= 2, got {v}: a response's advantage is its reward against the "
                "other responses to the same prompt, and a group of one has none to compare with "
                "(nor can grpo.dynamic_sampling find one whose rewards differ)"
            )
        return v

    @model_validator(mode="after")
    def _variant_defaults(self) -> "GRPOConfig":
        if self.estimator is None:
            self.estimator = self.variant
        if self.loss_agg is None:
            self.loss_agg = "seq_mean_token_sum_norm" if self.variant == "dr_grpo" else "seq_mean_token_mean"
        return self

    @property
    def ratio_clip(self) -> tuple[float, float]:
        """``(low, high)`` of the ratio's clip for :attr:`policy_loss`."""
        if self.policy_loss == "gspo":
            return self.gspo_clip_low, self.gspo_clip_high
        return self.clip_low, self.clip_high


class ValidationConfig(Section):
    """Scoring the policy on held-out prompts (``data.val_files``) during the run: the rollout
    generates for every held-out prompt in the ``validate`` phase (only the rollout awake) and
    ``reward.function`` scores the responses; ``val/reward`` (and every named score, ``val/pass@1``
    and with several samples ``val/pass@k``) goes into the log, the console and the trackers."""

    every: int = Field(0, ge=0)
    """Validate after every this many iterations, and after the last; 0: not during the run."""
    before_training: bool = False
    """Validate once before the first iteration (logged as iteration 0)."""
    samples_per_prompt: int = Field(1, ge=1)
    """Responses per held-out prompt, ``k`` of ``val/pass@k`` (more than 1 needs a temperature > 0)."""
    temperature: float = Field(0.0, ge=0)
    """0: greedy decoding (the default); above 0: sampled at this temperature."""
    max_prompts: Optional[int] = Field(None, ge=1)
    """Validate on the first this many held-out prompts (file order); None: all of them."""
    pass_threshold: float = 1.0
    """A response whose reward reaches this counts as solved (``val/pass@k``)."""

    @property
    def active(self) -> bool:
        """Whether the run validates at all."""
        return self.every > 0 or self.before_training

    def due(self, iteration: int, iterations: int) -> bool:
        """Whether to validate after ``iteration`` (from 1) of ``iterations``."""
        return self.every > 0 and (iteration % self.every == 0 or iteration == iterations)


class ReferenceConfig(Section):
    """The frozen reference model of the KL term."""

    from_hf: Optional[Path] = None
    """A Hugging Face checkpoint of the policy's architecture (an SFT model, say); None: the
    policy's initial weights (its ``from_hf`` checkpoint, or its seed's random init)."""


class GRPORunConfig(LoopConfig):
    """A whole colocated GRPO run: the policy, its rollout and (with ``grpo.kl_coef`` > 0) a
    frozen reference; no critic."""

    loop_section: ClassVar[str] = "grpo"
    presets: ClassVar = GRPO_PRESETS

    reference: Optional[ReferenceConfig] = Field(default_factory=ReferenceConfig)
    """The reference model of the KL term; null: none configured (then ``grpo.kl_coef`` must be 0).
    It is launched only when ``grpo.kl_coef`` > 0."""
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    data: Optional[DataConfig] = None
    """Your prompts (:mod:`chatlearn_mem_ray.inputs.data`); None: random token ids scored by ``task``."""
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
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

        for section, key in (
            ("data", "train_files"),
            ("data", "val_files"),
            ("tokenizer", "path"),
            ("reference", "from_hf"),
        ):
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
        ref = self.reference.from_hf if self.reference is not None else None
        if self.launches_reference and ref is not None and Path(ref).exists():
            from chatlearn_mem.models import hf

            found = hf.config_from_hf(ref)
            differ = [
                f"{f}={getattr(found, f)!r} (policy: {getattr(self.policy, f)!r})"
                for f in hf.CHECKPOINT_FIELDS
                if getattr(found, f) != getattr(self.policy, f)
            ]
            if differ:
                problems.append(
                    f"reference.from_hf {ref} is not of the policy's architecture: {', '.join(differ)}; the "
                    "reference must share it (or set reference.from_hf=null: the policy's initial weights)"
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
        v = self.validation
        if v.active and (self.data is None or not self.data.val_files):
            problems.append(
                f"validation.every={v.every} / validation.before_training={v.before_training} score the policy on "
                "held-out prompts: set data.val_files (JSONL or Parquet, as data.train_files), or validation.every=0 "
                "and validation.before_training=false"
            )
        if v.samples_per_prompt > 1 and v.temperature == 0:
            problems.append(
                f"validation.samples_per_prompt={v.samples_per_prompt} with validation.temperature=0 (greedy) samples "
                "the same response each time: set validation.temperature above 0, or samples_per_prompt=1"
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


def load_grpo_config(source: Optional[str | os.PathLike] = None, overrides: Sequence[str] = ()) -> GRPORunConfig:
    """:func:`load_config` for GRPO (presets from :data:`GRPO_PRESETS`)."""
    return load_config(source, overrides, GRPORunConfig)
