"""What a loop on the colocation service is: declarations, one iteration, and the loop's own state."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, ClassVar

from chatlearn_mem_ray.config import LoopConfig
from chatlearn_mem_ray.service.declare import Model, Phase

if TYPE_CHECKING:
    from chatlearn_mem_ray.service.service import Service

__all__ = ["Loop"]


class Loop:
    """A loop on the colocation service: subclass it, declare, and write one iteration.

    The service keeps the memory side; the loop keeps its own state. Whatever :meth:`state_dict`
    returns (JSON-serialisable: counters, a data cursor, a controller's state) is saved with the
    models in every run checkpoint and handed to :meth:`load_state_dict` on ``--resume`` and after
    a restart, before the next :meth:`step`. A step must depend only on the service, that state
    and its ``index`` (seed per-iteration randomness from it), so that a replayed iteration is the
    same iteration.

    Args:
        cfg: The run's config (a :class:`~chatlearn_mem_ray.config.LoopConfig` subclass, whose
            ``loop_section`` holds at least ``iterations``).
    """

    name: ClassVar[str] = "loop"
    """What the log and file names call the loop."""
    title: ClassVar[str] = "loop"
    """What the console and the memory picture call it (``PPO``)."""
    legend: ClassVar[str] = ""
    """One line saying what the progress line's short names mean, said before the first iteration."""

    def __init__(self, cfg: LoopConfig):
        self.cfg = cfg

    @property
    def iterations(self) -> int:
        """How many iterations the run makes (the loop section's ``iterations``)."""
        return int(self.cfg.loop.iterations)

    def models(self) -> list[Model]:
        """The loop's models, in the order their actors start."""
        raise NotImplementedError

    def phases(self) -> list[Phase]:
        """The loop's phases, in the order an iteration usually runs them (the residency plan
        optimises this cycle, and prefetch guesses the next phase from it)."""
        raise NotImplementedError

    def prepare(self, progress: Callable[[str], None]) -> None:
        """Before Ray starts (and again on a restart, quietly): load and check what the loop reads
        (files, tokenizers, functions); raise a ``ConfigError`` for bad input. Default: nothing."""

    def step(self, svc: "Service", index: int) -> dict:
        """Run iteration ``index`` (from 0; ``svc.number(index)`` is what the console shows) and
        return its metrics (floats, or JSON-serialisable values) for ``log.json``; the service
        adds the iteration's number, seconds and memory figures."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """The loop's own state, saved with every run checkpoint (default: none)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Take back what :meth:`state_dict` returned (default: nothing to take)."""

    def progress_line(self, metrics: dict) -> str:
        """The iteration's figures on the console (after ``iter 3/20``); the phases follow."""
        return " ".join(f"{k} {v:.4g}" for k, v in metrics.items() if isinstance(v, float) and k in ("reward", "loss"))
