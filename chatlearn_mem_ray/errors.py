"""Errors that stop a run of a loop on the colocation service. All share :class:`RunError` (itself a
:class:`chatlearn_mem.ChatlearnMemError`), so a caller catches one class; the command line prints
``error: <message>`` for each and exits 1."""

from __future__ import annotations

import math

from chatlearn_mem import ChatlearnMemError, ConfigError

__all__ = [
    "check_finite",
    "iteration_label",
    "ActorFailedError",
    "AuditFailedError",
    "BudgetConfigError",
    "BudgetError",
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
    "TrackerError",
    "VersionSkewError",
    "WeightSyncError",
]


def iteration_label(number: int, comparison: bool) -> str:
    """How messages name an iteration: ``"iteration 3"``; ``"manager-off iteration 1"`` for the
    comparison iterations run after the others with the manager off (``memory.compare_iterations``)."""
    return f"manager-off iteration {number}" if comparison else f"iteration {number}"


def check_finite(iteration: int, phase: str, metrics: dict, comparison: bool = False) -> None:
    """Stop the run when a phase's loss (or any other metric) is NaN or infinite.

    Args:
        iteration: The iteration's number (from 1, see :meth:`Service.number
            <chatlearn_mem_ray.service.service.Service.number>`).
        comparison: Whether it is a manager-off comparison iteration.

    Raises:
        NonFiniteLossError: Naming the iteration, the phase and the values.
    """
    bad = {k: v for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)}
    if bad:
        raise NonFiniteLossError(iteration, phase, bad, comparison)


class RunError(ChatlearnMemError):
    """Base class: the run cannot go on; the message says why and, where it can, what to do."""


class BudgetError(RunError):
    """``memory.device_budget_mb`` cannot hold a phase's models (checked before Ray starts from the
    config, and again once the models are measured); the message names the phase, its bytes and
    the budget."""


class BudgetConfigError(BudgetError, ConfigError):
    """``memory.device_budget_mb`` is below what the largest declared phase needs, estimated from the
    config before anything starts: a config mistake (the command line exits 2)."""


class LoopUsageError(RunError):
    """A loop asked the colocation service for something it did not declare: a phase that was not
    declared, a model its phase does not need, phases nested, a phase outside an iteration. The
    message names the phase and the model, and what to declare."""


class TrackerError(RunError, ConfigError):
    """A tracker of ``logger`` is not installed or cannot start (checked before Ray starts): the
    message names the extra to install or why it did not start (the command line exits 2)."""


class EngineMissingError(RunError):
    """The config asks for a rollout engine that is not installed (checked before Ray starts); the
    message gives the install command."""


class ResourceError(RunError):
    """The run asks for more CPUs or GPUs than the machine or cluster has."""


class VersionSkewError(RunError):
    """An actor runs another version of chatlearn-mem, megatron-core, torch or Ray than the driver
    (checked before any work); the message names each actor, its node and both versions."""


class ClusterConnectionError(RunError):
    """The Ray cluster to join cannot be found or reached, or refuses the connection; the message
    names the address, where it came from (``ray.address``, ``RAY_ADDRESS``, the latest
    ``ray start``) and what to set."""


class OutputDirError(RunError):
    """``output_dir`` cannot be written, or holds another run's results (checked before Ray starts)."""


class ActorFailedError(RunError):
    """An actor died or raised during a phase; the message names both.

    Attributes:
        actor, phase: Which actor, in which phase.
        died: Whether its process died (a lost node, the OOM killer, a crash), rather than its
            code raising an exception; only a death is worth a restart
            (``checkpoint.max_restarts``).
    """

    def __init__(self, actor: str, phase: str, cause: str, died: bool = False):
        super().__init__(f"actor {actor!r} failed during phase {phase!r}: {cause}")
        self.actor, self.phase, self.died = actor, phase, died


class CheckpointDirError(RunError):
    """``checkpoint.directory`` cannot be written, has no room for the checkpoints the run keeps, or
    holds an earlier run's checkpoints (checked before the first iteration)."""


class CheckpointSaveError(RunError):
    """Saving a run checkpoint failed; the run stopped, the previous complete checkpoint is intact."""


class ResumeError(RunError):
    """The run cannot be resumed: no checkpoint (with ``checkpoint.resume=true``), or the config's
    model differs from the checkpoint's (the message names each difference)."""


class PhaseTimeoutError(RunError):
    """A phase took longer than ``ray.phase_timeout_s``; the message names the actors waited for."""


class AuditFailedError(RunError):
    """A memory audit after an onload found a broken invariant; training would not be exact."""


class WeightSyncError(RunError):
    """A weight sync did not take: the rollout's weights differ from what the trainer exported (a
    SHA-256 per tensor for the megatron rollout, a digest per engine parameter for vLLM; the first
    differing one named), the update failed or was incomplete, or the engine's log-probs of the
    sampled tokens are farther from the trainer's than its precision allows. Raised before the
    rollout samples from weights that did not verify."""


class NonFiniteLossError(RunError):
    """A loss or gradient norm came back NaN or infinite; the message names the iteration and phase.

    Attributes:
        iteration: The iteration's number, from 1 as on the console and in ``log.json``.
        phase: The phase.
        comparison: Whether it was a manager-off comparison iteration (numbered from 1 again).
    """

    def __init__(self, iteration: int, phase: str, values: dict, comparison: bool = False):
        bad = ", ".join(f"{k}={v}" for k, v in values.items())
        which = iteration_label(iteration, comparison)
        super().__init__(
            f"{which}, phase {phase!r}: non-finite {bad}; the run stopped "
            "(lower the learning rate, or check the config and the reward)"
        )
        self.iteration, self.phase, self.comparison = iteration, phase, comparison


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a run after its log was written. A :class:`KeyboardInterrupt`, so code that
    catches that still does; ``str()`` is the line the command prints.

    Attributes:
        iterations: Iterations completed (all of them are in the log).
        log_path: The ``log.json`` written.
    """

    def __init__(self, iterations: int, log_path):
        plural = "" if iterations == 1 else "s"
        super().__init__(f"stopped by Ctrl-C after {iterations} iteration{plural}; log: {log_path}")
        self.iterations, self.log_path = iterations, log_path


class RunTerminated(RunInterrupted):
    """SIGTERM stopped a run at a safe point (the end of an iteration), after its log was written,
    its final checkpoint saved (``checkpoint.on_sigterm``) and Ray shut down. The command exits 143
    with ``str()``: how far it got and how to resume.

    Attributes:
        iterations: Iterations completed (all of them are in the log).
        log_path: The ``log.json`` written.
        checkpoint: The newest complete checkpoint (None: none).
    """

    def __init__(self, iterations: int, log_path, checkpoint=None, note: str = ""):
        plural = "" if iterations == 1 else "s"
        resume = (
            f"newest checkpoint {checkpoint} ({note}); continue with --resume"
            if checkpoint is not None
            else f"no checkpoint ({note}); a new run starts from the beginning"
        )
        KeyboardInterrupt.__init__(
            self, f"stopped by SIGTERM after {iterations} iteration{plural}; {resume}; log: {log_path}"
        )
        self.iterations, self.log_path, self.checkpoint = iterations, log_path, checkpoint
