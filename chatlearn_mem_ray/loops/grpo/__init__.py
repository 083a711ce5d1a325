"""GRPO on the colocation service: its config (:mod:`.config`), its math (:mod:`.losses`) and its
recipe (:mod:`.loop`)."""

from chatlearn_mem_ray.loops.grpo.config import GRPOConfig, GRPORunConfig, ReferenceConfig, load_grpo_config
from chatlearn_mem_ray.loops.grpo.loop import GRPO, decode_responses, run_grpo
from chatlearn_mem_ray.loops.grpo.losses import group_advantages, grpo_loss, response_mask

__all__ = [
    "GRPO",
    "GRPOConfig",
    "GRPORunConfig",
    "ReferenceConfig",
    "decode_responses",
    "group_advantages",
    "grpo_loss",
    "load_grpo_config",
    "response_mask",
    "run_grpo",
]
