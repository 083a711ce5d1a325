"""The colocation service on Ray, and the RL loops built on it (installed as ``chatlearn_mem_ray``).

The package by role; each layer imports only the layers below it (a test reads every import):

=====================  =====================================================================
``loops/``             the loops we ship, each with its config next to its recipe: PPO
                       (:mod:`~chatlearn_mem_ray.loops.ppo`), GRPO (:mod:`~chatlearn_mem_ray.loops.grpo`)
``job/``               any loop as a job: :func:`run_loop` (Ray, iterations, ``log.json``,
                       checkpoints, ``--resume``, restarts, SIGTERM); knows the service, not the loops
``service/``           the service a loop drives: :class:`Model`, :class:`Phase`, :class:`Loop`,
                       ``with svc.phase(name) as p:``, the residency plan, the memory timeline
``actors/``            the actors the service runs (:class:`TrainerActor`, :class:`InferenceActor`,
                       the vLLM engine's) and the Ray cluster under them
``inputs/``            what loops read: prompts (JSONL, Parquet), reward functions, built-in tasks
``config``, ``errors``  the config every loop shares (:class:`LoopConfig`, :func:`load_config`) and
                       the errors a run stops with (:class:`RunError`)
=====================  =====================================================================

A loop of your own: subclass :class:`Loop`, declare its models and phases, write one iteration as
``with svc.phase(name) as p:`` blocks and run it with :func:`run_loop` (``docs/service.md``).
Command line: ``chatlearn-mem ppo|grpo [--config PRESET|PATH] [key=value ...]``.

Module paths from before the app was arranged by role (``chatlearn_mem_ray.supervisor``,
``.ppo``, ``.grpo``, ``.tasks``, ...) still import, with a ``DeprecationWarning`` that names the
new one (:mod:`chatlearn_mem_ray._moved`).
"""

from chatlearn_mem_ray import _moved
from chatlearn_mem_ray.actors import InferenceActor, TrainerActor
from chatlearn_mem_ray.config import LoopConfig
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
from chatlearn_mem_ray.inputs.tasks import TASKS
from chatlearn_mem_ray.job import run_loop
from chatlearn_mem_ray.loops import GRPORunConfig, RunConfig, load_config, load_grpo_config, run_grpo, run_ppo
from chatlearn_mem_ray.service import EVERYTHING, WEIGHTS, DeclarationError, Loop, Model, Phase, Service
from chatlearn_mem_ray.service.colocation import Colocation

__all__ = [
    # the service a loop drives
    "EVERYTHING",
    "WEIGHTS",
    "Colocation",
    "DeclarationError",
    "Loop",
    "Model",
    "Phase",
    "Service",
    # any loop as a job
    "run_loop",
    # the loops shipped, and the configs
    "GRPORunConfig",
    "LoopConfig",
    "RunConfig",
    "load_config",
    "load_grpo_config",
    "run_grpo",
    "run_ppo",
    "TASKS",
    # the actors (plain classes; the service makes them Ray actors)
    "InferenceActor",
    "TrainerActor",
    # errors that stop a run
    "ActorFailedError",
    "AuditFailedError",
    "CheckpointDirError",
    "CheckpointSaveError",
    "ClusterConnectionError",
    "EngineMissingError",
    "LoopUsageError",
    "NonFiniteLossError",
    "OutputDirError",
    "PhaseTimeoutError",
    "ResourceError",
    "ResumeError",
    "RunError",
    "RunInterrupted",
    "RunTerminated",
    "WeightSyncError",
]

_moved.install()
