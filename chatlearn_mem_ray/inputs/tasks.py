"""The built-in task's reward: what a rollout is scored by when no reward function is given."""

from __future__ import annotations

from typing import Callable, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["TASKS", "TaskConfig", "token_range_reward"]


class TaskConfig(BaseModel):
    """The rule-based toy task: reward = fraction of response tokens in ``[target_low, target_high)``.

    A randomly initialised policy samples tokens nearly uniformly, so it starts near
    ``(target_high - target_low) / vocab_size``; PPO pushes it towards 1.
    """

    model_config = ConfigDict(extra="forbid")

    name: Literal["token_range"] = "token_range"
    """Which task (only one is built in; add yours in ``chatlearn_mem_ray.inputs.tasks.TASKS``)."""
    target_low: int = Field(0, ge=0)
    """Lowest rewarded token id."""
    target_high: int = Field(16, ge=1)
    """One past the highest rewarded token id."""

    @model_validator(mode="after")
    def _range(self) -> "TaskConfig":
        if self.target_high <= self.target_low:
            raise ValueError(f"target_high ({self.target_high}) must be > target_low ({self.target_low})")
        return self


def token_range_reward(responses: torch.Tensor, task: TaskConfig) -> torch.Tensor:
    """Fraction of response tokens (B, R) with ids in ``[target_low, target_high)``: (B,) in [0, 1]."""
    hit = (responses >= task.target_low) & (responses < task.target_high)
    return hit.float().mean(dim=1)


TASKS: dict[str, Callable[[torch.Tensor, TaskConfig], torch.Tensor]] = {"token_range": token_range_reward}
