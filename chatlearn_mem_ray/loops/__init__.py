"""The loops shipped on the colocation service, each module holding its config next to its recipe:
PPO with a critic (:mod:`.ppo`) and GRPO (:mod:`.grpo`: its config, its losses, its loop)."""

from __future__ import annotations

import os
from typing import Optional, Sequence

from chatlearn_mem_ray import config
from chatlearn_mem_ray.loops.grpo import GRPO, GRPORunConfig, load_grpo_config, run_grpo
from chatlearn_mem_ray.loops.ppo import PPO, RunConfig, run_ppo

__all__ = ["GRPO", "PPO", "GRPORunConfig", "RunConfig", "load_config", "load_grpo_config", "run_grpo", "run_ppo"]


def load_config(
    source: Optional[str | os.PathLike] = None,
    overrides: Sequence[str] = (),
    schema: Optional[type[config.C]] = None,
) -> config.C:
    """:func:`chatlearn_mem_ray.config.load_config` with PPO's :class:`RunConfig` when no ``schema``
    is named (``chatlearn_mem_ray.load_config``, as it always was)."""
    return config.load_config(source, overrides, schema if schema is not None else RunConfig)
