"""Ray actors and a colocated PPO loop built on :mod:`chatlearn_mem`.

- :class:`RunConfig` / :func:`load_config`: the whole run as pydantic models, from YAML plus
  ``key=value`` overrides.
- :func:`run_ppo`: start (or join) Ray, place every actor on the same resources, run PPO with
  the memory manager switching models between phases, write the JSON log and memory timeline.
- :class:`TrainerActor`, :class:`InferenceActor`: the actors (plain classes; ``ray.remote`` them).
- Command line: ``chatlearn-mem ppo --config configs/ppo_cpu_tiny.yaml [key=value ...]``.
"""

from ray_actors.actors import InferenceActor, TrainerActor
from ray_actors.cluster import ActorFailedError, Colocation, PhaseTimeoutError, ResourceError
from ray_actors.config import ConfigError, RunConfig, load_config
from ray_actors.ppo import AuditFailedError, run_ppo

__all__ = ["ActorFailedError", "AuditFailedError", "Colocation", "ConfigError", "InferenceActor",
           "PhaseTimeoutError", "ResourceError", "RunConfig", "TrainerActor", "load_config", "run_ppo"]
