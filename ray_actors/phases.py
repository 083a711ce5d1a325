"""What a phase of the colocated PPO loop does with memory, apart from its work: the recipe
(:mod:`chatlearn_mem_ray.ppo`) says which models each phase needs; :class:`PhaseRunner` brings them
onto the devices (all of them, or as the residency plan of ``memory.device_budget_mb`` says, with
prefetch), audits them, runs the work, records every actor's residency in the memory timeline and
puts them back to sleep.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from chatlearn_mem import Part
from chatlearn_mem_ray.config import RunConfig
from chatlearn_mem_ray.errors import AuditFailedError, BudgetError
from chatlearn_mem_ray.schedule import PHASES, BoundaryPlan, ResidencySchedule, bundle_of, pinned_items
from chatlearn_mem_ray.timeline import MemoryTimeline

if TYPE_CHECKING:
    from chatlearn_mem_ray.colocation import Colocation

__all__ = ["PhaseRunner"]


class PhaseRunner:
    """The memory side of every phase of a run.

    Args:
        cfg: The run config (``memory.audit``, ``memory.prefetch``).
        colo: The actors, set up.
        progress: Called with the warnings of a residency plan (a phase over its budget, a re-plan).

    Attributes:
        timeline: Every phase's residency and transitions so far.
        audits: ``{"runs", "checks_clean"}`` of the audits after each phase's onload.
        schedule: The residency plan, once :meth:`plan` made one.
        over_budget: Phases measured above their device's budget.
    """

    def __init__(self, cfg: RunConfig, colo: "Colocation", progress: Callable[[str], None] = print):
        self.cfg, self.colo, self.progress = cfg, colo, progress
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
            one = {bundle_of(c.names[a]): a for a in reversed(c.policy)}  # one actor per device
            free = c.call("plan", {a: a.device_free_bytes.remote() for a in one.values()})
            margin = int(mem.device_budget_margin_mb * 2**20)
            budget = {b: max(0, free[a] - margin) for b, a in one.items()}
        else:
            budget = int(mem.device_budget_mb * 2**20)
        if self.cfg.rollout.engine == "vllm" and c.use_gpu:
            raise BudgetError(
                "rollout.engine: vllm with memory.device_budget_mb is not supported on GPUs yet: the residency "
                "plan does not know the size of the engine's KV cache there; set memory.device_budget_mb=null"
            )
        try:
            self.schedule = ResidencySchedule(sizes, budget, pinned=pinned_items(self.cfg, c.use_gpu))
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

    def run(self, number: int, name: str, needs: dict[Any, tuple[str, ...]], work: Callable[[], Any], manager_on: bool):
        """Phase ``name`` of iteration ``number``: onload what ``needs`` names (actor -> parts; all
        of it, or as the residency plan says), do ``work``, record everyone's residency, offload.
        With ``manager_on`` false nothing moves (the models stay resident); the phase is recorded."""
        if self.schedule is not None and manager_on:
            return self._planned(number, name, needs, work)
        c = self.colo
        t0 = time.perf_counter()
        moved = []
        if manager_on:
            moved += [
                s
                for stats in c.call(name, {a: a.onload.remote(parts) for a, parts in needs.items()}).values()
                for s in stats
            ]
        t_in = time.perf_counter() - t0
        if manager_on and self.cfg.memory.audit:
            self.audit(name, needs)
        result = work()
        residency = c.call(name, {a: a.residency.remote() for a in c.all_actors})
        t1 = time.perf_counter()
        if manager_on:
            moved += [
                s
                for stats in c.call(name, {a: a.offload.remote(parts) for a, parts in needs.items()}).values()
                for s in stats
            ]
        seconds = time.perf_counter() - t0
        self.timeline.add(
            number,
            name,
            manager_on,
            seconds,
            {c.names[a]: parts for a, parts in needs.items()},
            {c.names[a]: r for a, r in residency.items()},
            moved=moved,
            transition_seconds=t_in + time.perf_counter() - t1,
        )
        return result

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

    def _planned(self, number: int, name: str, needs: dict[Any, tuple[str, ...]], work: Callable[[], Any]):
        """A phase under the residency plan (``memory.device_budget_mb``): at the boundary the
        plan's out-moves (first, and waited for, only when the device needs their room), then its
        in-moves; the next phase's in-moves start now when they fit beside this phase's models
        (prefetch); the work; then every transition still running is waited for and the residency
        recorded. With ``memory.prefetch`` the transitions are non-blocking: a forward pass waits
        per module for its weights, a training step for the parts it touches."""
        c, s = self.colo, self.schedule
        phase = PHASES.index(name)
        nb = self.prefetch
        t0 = time.perf_counter()
        moves = s.boundary(phase)
        moved = []
        if moves.out and not s.fits(s.resident | s.target(phase)):  # their room is needed first
            moved += self._moves(name, moves.out, "offload", blocking=True)
            s.moved(BoundaryPlan(moves.out, {}))
            moves = BoundaryPlan({}, moves.into)
        moved += self._moves(name, moves.into, "onload", blocking=not nb)
        moved += self._moves(name, moves.out, "offload", blocking=not nb)  # behind this phase
        s.moved(moves)
        if nb:  # the next phase's in-moves, when they fit beside what is resident now
            ahead = s.boundary((phase + 1) % len(PHASES)).into
            items = {(a, p) for a, parts in ahead.items() for p in parts}
            if ahead and s.fits(s.resident | items):
                self._moves(name, ahead, "onload", blocking=False)
                s.moved(BoundaryPlan({}, ahead))
        t_before = time.perf_counter() - t0
        result = work()
        t1 = time.perf_counter()
        waits = c.call(name, {a: a.settle.remote() for a in self._unsettled})
        self._unsettled.clear()
        moved += [x for w in waits.values() for x in w["stats"]]
        t_settle = time.perf_counter() - t1
        if self.cfg.memory.audit:
            self.audit(name, needs)
        residency = c.call(name, {a: a.residency.remote() for a in c.all_actors})
        self.timeline.add(
            number,
            name,
            True,
            time.perf_counter() - t0,
            {c.names[a]: parts for a, parts in needs.items()},
            {c.names[a]: r for a, r in residency.items()},
            moved=moved,
            transition_seconds=t_before + t_settle,
            budget_bytes=s.budget,
            kept=s.kept(phase),
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
        return result
