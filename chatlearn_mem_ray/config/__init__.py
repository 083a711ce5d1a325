"""What every loop on the colocation service configures: one pydantic model per component.

The package: :mod:`.loop` (:class:`LoopConfig`, its shared sections, :func:`load_config`),
:mod:`.model` (:class:`TrainerModelConfig`: a trainer's architecture and the checkpoint it starts
from), :mod:`.output` (the export and the trackers), :mod:`.section` (the base of every section).

:class:`LoopConfig` holds what every loop shares (the policy, its layout, the rollout engine, the
task, memory, Ray, checkpoints, output); a loop's own config subclasses it next to its recipe (PPO's
:class:`~chatlearn_mem_ray.loops.ppo.RunConfig`, GRPO's
:class:`~chatlearn_mem_ray.loops.grpo.config.GRPORunConfig`, yours). :func:`load_config` reads a
preset or a YAML file, applies ``key=value`` overrides (dotted keys, YAML-typed values:
``ppo.iterations=5``, ``memory.enabled=false``) and validates everything at once with the project's
one loader (:func:`chatlearn_mem_config_files.load_config`); its ``ConfigError`` lists every
problem, so a bad run fails before Ray or any model starts.
"""

from chatlearn_mem_ray.config import loop
from chatlearn_mem_ray.config.loop import (
    CheckpointConfig,
    LoopConfig,
    MemoryPolicy,
    ParallelConfig,
    RayConfig,
    RolloutConfig,
    load_config,
)
from chatlearn_mem_ray.config.model import TrainerModelConfig
from chatlearn_mem_ray.config.output import LOGGERS, ExportConfig, TrackerConfig
from chatlearn_mem_ray.config.section import Section
from chatlearn_mem_ray.inputs.tasks import TaskConfig

__all__ = [
    "LOGGERS",
    "CheckpointConfig",
    "ExportConfig",
    "LoopConfig",
    "MemoryPolicy",
    "ParallelConfig",
    "RayConfig",
    "RolloutConfig",
    "Section",
    "TaskConfig",
    "TrackerConfig",
    "TrainerModelConfig",
    "load_config",
]


def __getattr__(name: str):
    """A loop's own config names moved next to their recipes (``RunConfig``, ``GRPORunConfig``, ...):
    they still import from here, with a ``DeprecationWarning`` that says where each lives now."""
    return loop.moved(name)
