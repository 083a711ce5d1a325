"""GRPO's config: the shared :class:`~chatlearn_mem_ray.config.LoopConfig` with the ``grpo`` section,
the reference model, and the run's text inputs (``data``, ``tokenizer``, ``reward``)."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import ClassVar, Literal, Optional, Sequence

from pydantic import Field, field_validator

from chatlearn_mem_ray.config import LoopConfig, _Strict, load_config
from chatlearn_mem_ray.inputs.data import DataConfig, TokenizerConfig
from chatlearn_mem_ray.inputs.rewards import RewardConfig

__all__ = ["DEFAULT_GRPO_PRESET", "GRPOConfig", "GRPORunConfig", "GRPO_PRESETS", "ReferenceConfig", "load_grpo_config"]

GRPO_PRESETS = resources.files("chatlearn_mem_ray.grpo_presets")
"""The shipped GRPO presets (``configs/grpo/*.yaml``)."""
DEFAULT_GRPO_PRESET = "cpu_grpo"
"""What ``chatlearn-mem grpo`` runs without ``--config``."""


class GRPOConfig(_Strict):
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


class ReferenceConfig(_Strict):
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


def load_grpo_config(source: Optional[str | os.PathLike] = None, overrides: Sequence[str] = ()) -> GRPORunConfig:
    """:func:`load_config` for GRPO (presets from :data:`GRPO_PRESETS`)."""
    return load_config(source, overrides, GRPORunConfig)
