"""The built-in task's reward: what a rollout is scored by when no reward function is given."""

from __future__ import annotations

from typing import Callable

import torch

from chatlearn_mem_ray.config import TaskConfig

__all__ = ["TASKS", "token_range_reward"]


def token_range_reward(responses: torch.Tensor, task: TaskConfig) -> torch.Tensor:
    """Fraction of response tokens (B, R) with ids in ``[target_low, target_high)``: (B,) in [0, 1]."""
    hit = (responses >= task.target_low) & (responses < task.target_high)
    return hit.float().mean(dim=1)


TASKS: dict[str, Callable[[torch.Tensor, TaskConfig], torch.Tensor]] = {"token_range": token_range_reward}
