"""Ray actors and a colocated PPO loop built on :mod:`chatlearn_mem` (installed as ``chatlearn_mem_ray``).

- :class:`RunConfig` / :func:`load_config`: the whole run as pydantic models, from a preset or a
  YAML file plus ``key=value`` overrides.
- :func:`run_ppo`: start (or join) Ray, place every actor on the same resources, run PPO with
  the memory manager switching models between phases, write the JSON log and memory timeline.
- :class:`TrainerActor`, :class:`InferenceActor`: the actors (plain classes; ``ray.remote`` them).
- Checkpoints, resume and restarts of dead actors: the ``checkpoint`` section of the config;
  :mod:`chatlearn_mem_ray.checkpoints` reads what a run saved.
- :class:`RunError`: the base of every error that stops a run; :class:`RunInterrupted` (a
  ``KeyboardInterrupt``) when Ctrl-C stops one after its log was written, :class:`RunTerminated`
  when SIGTERM does (at the end of an iteration, its checkpoint saved).
- Command line: ``chatlearn-mem ppo [--config cpu_tiny|gpu|PATH] [key=value ...]``.
- Modules: :mod:`~chatlearn_mem_ray.ppo` (the PPO recipe, to read and copy),
  :mod:`~chatlearn_mem_ray.supervisor` (:func:`run_ppo`: the job around it),
  :mod:`~chatlearn_mem_ray.connect` (start or join Ray), :mod:`~chatlearn_mem_ray.colocation` (the
  actors on shared resources).
"""

from chatlearn_mem_ray.actors import InferenceActor, TrainerActor
from chatlearn_mem_ray.colocation import Colocation
from chatlearn_mem_ray.config import RunConfig, load_config
from chatlearn_mem_ray.errors import (
    ActorFailedError,
    AuditFailedError,
    CheckpointDirError,
    CheckpointSaveError,
    ClusterConnectionError,
    EngineMissingError,
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
from chatlearn_mem_ray.supervisor import run_ppo

__all__ = [
    "ActorFailedError",
    "AuditFailedError",
    "CheckpointDirError",
    "CheckpointSaveError",
    "ClusterConnectionError",
    "EngineMissingError",
    "Colocation",
    "InferenceActor",
    "NonFiniteLossError",
    "OutputDirError",
    "PhaseTimeoutError",
    "ResourceError",
    "ResumeError",
    "RunConfig",
    "RunError",
    "RunInterrupted",
    "RunTerminated",
    "TrainerActor",
    "WeightSyncError",
    "load_config",
    "run_ppo",
]
