"""Errors that stop a colocated PPO run. All share :class:`RunError` (itself a
:class:`chatlearn_mem.ChatlearnMemError`), so a caller catches one class; the command line prints
``error: <message>`` for each and exits 1."""

from __future__ import annotations

from chatlearn_mem import ChatlearnMemError

__all__ = ["ActorFailedError", "AuditFailedError", "PhaseTimeoutError", "ResourceError", "RunError",
           "WeightSyncError"]


class RunError(ChatlearnMemError):
    """Base class: the run cannot go on; the message says why and, where it can, what to do."""


class ResourceError(RunError):
    """The run asks for more CPUs or GPUs than the machine or cluster has."""


class ActorFailedError(RunError):
    """An actor died or raised during a phase; the message names both."""

    def __init__(self, actor: str, phase: str, cause: str):
        super().__init__(f"actor {actor!r} failed during phase {phase!r}: {cause}")
        self.actor, self.phase = actor, phase


class PhaseTimeoutError(RunError):
    """A phase took longer than ``ray.phase_timeout_s``; the message names the actors waited for."""


class AuditFailedError(RunError):
    """A memory audit after an onload found a broken invariant; training would not be exact."""


class WeightSyncError(RunError):
    """The rollout model's weights differ from the policy's after a weight sync (by SHA-256)."""
