"""What a phase does with memory, apart from its work: :class:`PhaseRunner` brings the models a
phase needs onto the devices (all of them, or as the residency plan of ``memory.device_budget_mb``
says, with prefetch), audits them, and once the work is done records every actor's residency in
the memory timeline and puts them back to sleep. The colocation service
(:class:`chatlearn_mem_ray.service.service.Service`) calls :meth:`PhaseRunner.enter` and
:meth:`PhaseRunner.exit` around the work of each ``with svc.phase(name)`` block.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

from chatlearn_mem import Part
from chatlearn_mem_ray.config import LoopConfig
from chatlearn_mem_ray.errors import AuditFailedError, BudgetError
from chatlearn_mem_ray.service.schedule import BoundaryPlan, PhaseDemand, ResidencySchedule
from chatlearn_mem_ray.service.timeline import MemoryTimeline

if TYPE_CHECKING:
    from chatlearn_mem_ray.service.colocation import Colocation

__all__ = ["OpenPhase", "PhaseRunner"]


@dataclass
class OpenPhase:
    """A phase between :meth:`PhaseRunner.enter` and :meth:`PhaseRunner.exit`."""

    number: int
    name: str
    needs: dict[Any, tuple[Part, ...]]  # actor handle -> parts
    manager_on: bool
    planned: bool
    t0: float
    before_seconds: float = 0.0  # transitions before the work (that did not overlap it)
    moved: list = field(default_factory=list)


class PhaseRunner:
    """The memory side of every phase of a run.

    Args:
        cfg: The run config (``memory.audit``, ``memory.prefetch``, ``memory.device_budget_mb``).
        colo: The actors, set up.
        demands: Each declared phase's needs and writes per actor name, in declared order.
        pinned: Items that cannot leave the device (an engine that cannot sleep).
        progress: Called with the warnings of a residency plan (a phase over its budget, a re-plan).

    Attributes:
        timeline: Every phase's residency and transitions so far.
        audits: ``{"runs", "checks_clean"}`` of the audits after each phase's onload.
        schedule: The residency plan, once :meth:`plan` made one.
        over_budget: Phases measured above their device's budget.
    """

    def __init__(
        self,
        cfg: LoopConfig,
        colo: "Colocation",
        demands: Sequence[PhaseDemand],
        pinned: set = frozenset(),
        progress: Callable[[str], None] = print,
    ):
        self.cfg, self.colo, self.demands, self.pinned, self.progress = cfg, colo, list(demands), pinned, progress
        self.timeline = MemoryTimeline()
        self.audits = {"runs": 0, "checks_clean": 0}
        self.schedule: Optional[ResidencySchedule] = None
        self.over_budget: list[dict] = []
        self.prefetch = cfg.memory.prefetch  # with a residency plan: non-blocking transitions, prefetch
        self._unsettled: set = set()  # actors with non-blocking transitions not yet waited for

    def plan(self) -> Optional[ResidencySchedule]:
        """With ``memory.device_budget_mb``: measure every model's parts and plan what each device
        keeps resident in each phase (call with every model asleep: ``auto`` reads the free memory).

        Raises:
            BudgetError: A phase alone needs more than the budget (or ``auto`` without a GPU).
        """
        mem, c = self.cfg.memory, self.colo
        if mem.device_budget_mb is None:
            return None
        sizes = {c.names[a]: s for a, s in c.call("plan", {a: a.part_sizes.remote() for a in c.all_actors}).items()}
        sizes = {n: {Part(p): b for p, b in s.items()} for n, s in sizes.items()}
        if mem.device_budget_mb == "auto":
            if not c.use_gpu:
                raise BudgetError(
                    "memory.device_budget_mb=auto reads the free memory of each GPU, and this run "
                    "has none; give the budget in MiB, or null (all or nothing)"
                )
            one = {c.bundle_of[c.names[a]]: a for a in reversed(c.all_actors)}  # one actor per device
            free = c.call("plan", {a: a.device_free_bytes.remote() for a in one.values()})
            margin = int(mem.device_budget_margin_mb * 2**20)
            budget = {b: max(0, free[a] - margin) for b, a in one.items()}
        else:
            budget = int(mem.device_budget_mb * 2**20)
        try:
            self.schedule = ResidencySchedule(sizes, budget, self.demands, c.bundle_of, pinned=self.pinned)
        except ValueError as e:
            raise BudgetError(str(e)) from None
        return self.schedule

    def audit(self, name: str, actors) -> None:
        """Audit ``actors`` after their onload in phase ``name``; a problem stops the run."""
        c = self.colo
        for a, problems in c.call(name, {a: a.audit.remote() for a in actors}).items():
            self.audits["runs"] += 1
            if problems:
                raise AuditFailedError(
                    f"audit of {c.names[a]} after onload in phase {name!r} "
                    f"found {len(problems)} problem(s): {problems[:5]}"
                )
            self.audits["checks_clean"] += 1

    # -- one phase --------------------------------------------------------------------------
    def enter(self, number: int, name: str, needs: Mapping[Any, tuple[Part, ...]], manager_on: bool) -> OpenPhase:
        """Before phase ``name`` of iteration ``number``'s work: onload what ``needs`` names (actor
        -> parts; all of it, or as the residency plan says) and audit it. With ``manager_on``
        false nothing moves (the models stay resident)."""
        planned = self.schedule is not None and manager_on
        open_ = OpenPhase(number, name, dict(needs), manager_on, planned, time.perf_counter())
        if planned:
            self._planned_enter(open_)
            return open_
        c = self.colo
        if manager_on:
            open_.moved += [
                s
                for stats in c.call(name, {a: a.onload.remote(parts) for a, parts in needs.items()}).values()
                for s in stats
            ]
        open_.before_seconds = time.perf_counter() - open_.t0
        if manager_on and self.cfg.memory.audit:
            self.audit(name, needs)
        return open_

    def exit(self, open_: OpenPhase) -> None:
        """After the phase's work: record everyone's residency, then offload what it onloaded (or
        wait for the plan's transitions)."""
        if open_.planned:
            return self._planned_exit(open_)
        c, name = self.colo, open_.name
        residency = c.call(name, {a: a.residency.remote() for a in c.all_actors})
        t1 = time.perf_counter()
        if open_.manager_on:
            open_.moved += [
                s
                for stats in c.call(name, {a: a.offload.remote(parts) for a, parts in open_.needs.items()}).values()
                for s in stats
            ]
        self._record(open_, residency, open_.before_seconds + time.perf_counter() - t1)

    def settle(self) -> None:
        """Wait for every non-blocking transition still running (before everything is offloaded)."""
        if self._unsettled:
            self.colo.call("sleep", {a: a.settle.remote() for a in self._unsettled})
            self._unsettled.clear()

    def _record(self, open_: OpenPhase, residency: dict, transition_seconds: float, **planned) -> None:
        c = self.colo
        self.timeline.add(
            open_.number,
            open_.name,
            open_.manager_on,
            time.perf_counter() - open_.t0,
            {c.names[a]: parts for a, parts in open_.needs.items()},
            {c.names[a]: r for a, r in residency.items()},
            moved=open_.moved,
            transition_seconds=transition_seconds,
            bundles=c.bundle_of,
            **planned,
        )

    def _moves(self, name: str, moves: dict[str, tuple[Part, ...]], direction: str, blocking: bool) -> list[dict]:
        """Offload or onload ``moves`` (actor name -> parts) on every actor at once; the stats of
        blocking calls (non-blocking ones report through ``settle``)."""
        if not moves:
            return []
        c = self.colo
        by_name = {c.names[a]: a for a in c.all_actors}
        refs = {by_name[n]: getattr(by_name[n], direction).remote(list(parts), blocking) for n, parts in moves.items()}
        if not blocking:
            self._unsettled.update(refs)
        return [s for stats in c.call(name, refs).values() for s in stats]

    def _planned_enter(self, open_: OpenPhase) -> None:
        """A phase under the residency plan (``memory.device_budget_mb``): at the boundary the
        plan's out-moves (first, and waited for, only when the device needs their room), then its
        in-moves; the next declared phase's in-moves start now when they fit beside this phase's
        models (prefetch). With ``memory.prefetch`` the transitions are non-blocking: a forward
        pass waits per module for its weights, a training step for the parts it touches."""
        s, name = self.schedule, open_.name
        phase = s.index(name)
        nb = self.prefetch
        moves = s.boundary(phase)
        if moves.out and not s.fits(s.resident | s.target(phase)):  # their room is needed first
            open_.moved += self._moves(name, moves.out, "offload", blocking=True)
            s.moved(BoundaryPlan(moves.out, {}))
            moves = BoundaryPlan({}, moves.into)
        open_.moved += self._moves(name, moves.into, "onload", blocking=not nb)
        open_.moved += self._moves(name, moves.out, "offload", blocking=not nb)  # behind this phase
        s.moved(moves)
        if nb:  # the next phase's in-moves, when they fit beside what is resident now
            ahead = s.boundary((phase + 1) % len(s.phase_names)).into
            items = {(a, p) for a, parts in ahead.items() for p in parts}
            if ahead and s.fits(s.resident | items):
                self._moves(name, ahead, "onload", blocking=False)
                s.moved(BoundaryPlan({}, ahead))
        open_.before_seconds = time.perf_counter() - open_.t0

    def _planned_exit(self, open_: OpenPhase) -> None:
        """Every transition still running is waited for, the phase's models audited and the
        residency recorded; a phase measured over its budget is said; changed sizes re-plan."""
        c, s, name, number = self.colo, self.schedule, open_.name, open_.number
        t1 = time.perf_counter()
        waits = c.call(name, {a: a.settle.remote() for a in self._unsettled})
        self._unsettled.clear()
        open_.moved += [x for w in waits.values() for x in w["stats"]]
        t_settle = time.perf_counter() - t1
        if self.cfg.memory.audit:
            self.audit(name, open_.needs)
        residency = c.call(name, {a: a.residency.remote() for a in c.all_actors})
        self._record(
            open_, residency, open_.before_seconds + t_settle, budget_bytes=s.budget, kept=s.kept(s.index(name))
        )
        over = {b: n for b, n in self.timeline.records[-1].bundle_bytes.items() if n > s.budget[int(b)]}
        if over:  # never silently: a measured phase above its device's budget is said and logged
            self.over_budget.append({"iteration": number, "phase": name, "device_bytes": over})
            self.progress(
                f"warning: {name} of iteration {number} held "
                + ", ".join(f"{n / 2**20:.2f} MiB on device {b}" for b, n in over.items())
                + " (the budget is "
                f"{max(s.budget.values()) / 2**20:.2f} MiB); a model grew past what was measured"
            )
        sizes = {c.names[a]: {Part(p): b for p, b in r["resident_by_part"].items()} for a, r in residency.items()}
        if s.update_sizes(sizes):
            self.progress(
                f"re-planned the device memory after {name} of iteration {number}: a model's parts changed size"
            )
