"""The colocation service on Ray, and the RL loops built on it (installed as ``chatlearn_mem_ray``).

- The service: a loop declares its models (:class:`Model`) and phases (:class:`Phase`), writes one
  iteration as ``with svc.phase(name) as p:`` blocks (:class:`Loop`), and :func:`run_loop` runs it
  as a job. The service wakes what each phase needs, audits it, records the memory timeline and
  puts it back to sleep; ``docs/service.md`` has a complete loop.
- The loops shipped: PPO with a critic (:func:`run_ppo`, :mod:`~chatlearn_mem_ray.ppo`) and GRPO
  (:func:`run_grpo`, :mod:`~chatlearn_mem_ray.grpo`).
- :class:`RunConfig` (PPO), :class:`GRPORunConfig`, :class:`LoopConfig` (what every loop shares) and
  :func:`load_config`: a run as pydantic models, from a preset or a YAML file plus ``key=value``
  overrides.
- :class:`TrainerActor`, :class:`InferenceActor`: the actors (plain classes; ``ray.remote`` them).
- Checkpoints, resume and restarts of dead actors: the ``checkpoint`` section of the config;
  :mod:`chatlearn_mem_ray.checkpoints` reads what a run saved.
- :class:`RunError`: the base of every error that stops a run; :class:`RunInterrupted` (a
  ``KeyboardInterrupt``) when Ctrl-C stops one after its log was written, :class:`RunTerminated`
  when SIGTERM does (at the end of an iteration, its checkpoint saved).
- Command line: ``chatlearn-mem ppo|grpo [--config PRESET|PATH] [key=value ...]``.
"""

from chatlearn_mem_ray.actors import InferenceActor, TrainerActor
from chatlearn_mem_ray.colocation import Colocation
from chatlearn_mem_ray.config import GRPORunConfig, LoopConfig, RunConfig, load_config, load_grpo_config
from chatlearn_mem_ray.declare import EVERYTHING, WEIGHTS, DeclarationError, Model, Phase
from chatlearn_mem_ray.errors import (
    ActorFailedError,
    AuditFailedError,
    CheckpointDirError,
    CheckpointSaveError,
    ClusterConnectionError,
    EngineMissingError,
    LoopUsageError,
    NonFiniteLossError,
    OutputDirError,
    PhaseTimeoutError,
    ResourceError,
    ResumeError,
    RunError,
    RunInterrupted,
    RunTerminated,
    WeightSyncError,
)
from chatlearn_mem_ray.service import Loop, Service
from chatlearn_mem_ray.supervisor import run_grpo, run_loop, run_ppo

__all__ = [
    "EVERYTHING",
    "WEIGHTS",
    "ActorFailedError",
    "AuditFailedError",
    "CheckpointDirError",
    "CheckpointSaveError",
    "ClusterConnectionError",
    "Colocation",
    "DeclarationError",
    "EngineMissingError",
    "GRPORunConfig",
    "InferenceActor",
    "Loop",
    "LoopConfig",
    "LoopUsageError",
    "Model",
    "NonFiniteLossError",
    "OutputDirError",
    "Phase",
    "PhaseTimeoutError",
    "ResourceError",
    "ResumeError",
    "RunConfig",
    "RunError",
    "RunInterrupted",
    "RunTerminated",
    "Service",
    "TrainerActor",
    "WeightSyncError",
    "load_config",
    "load_grpo_config",
    "run_grpo",
    "run_loop",
    "run_ppo",
]
