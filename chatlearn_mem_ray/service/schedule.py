"""What stays on each device in each phase a loop declared: the residency planner
(:func:`chatlearn_mem.plan_residency`) applied to a loop's phases.

An *item* is one part of one actor's model (``"critic_0/optimizer_states"``). Each declared phase
needs some items and writes some of them (:class:`PhaseDemand`; the colocation service derives
both from the loop's :class:`~chatlearn_mem_ray.service.service.Phase` declarations). Gradients are
scratch (dropped on offload, rebuilt zeroed). Each placement-group bundle is one device with its
own budget, so each bundle gets its own plan over the items of the actors on it; which bundle an
actor lives on is given, never read from its name.

:class:`ResidencySchedule` holds the plans and the driver's view of what is resident now; at each
phase it says what moves out, what moves in, and whether the next phase's in-moves may start
early (prefetch: when what is resident now and what comes in fit the budget together). A loop
that runs its phases in another order than declared (a skipped sync, a repeated generate) stays
correct: every boundary is computed from what is resident now, it only moves more. A model whose
sizes change (the optimizer states the first step creates, a buffer that grows) is planned
again: :meth:`ResidencySchedule.update_sizes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from chatlearn_mem import Part, ResidencyPlan, plan_residency

__all__ = ["BoundaryPlan", "PhaseDemand", "ResidencySchedule", "TRAINED"]

TRAINED = (Part.WEIGHTS, Part.MAIN_WEIGHTS, Part.OPTIMIZER_STATES)
"""What a training phase changes (gradients are scratch and never copied)."""

Item = tuple[str, Part]  # (actor name, part)


@dataclass(frozen=True)
class PhaseDemand:
    """What one phase asks of the devices, per actor.

    Attributes:
        name: The phase's name.
        needs: Actor name -> the parts the phase uses (they are resident during it).
        writes: Actor name -> the parts the phase changes (a subset of ``needs``; an item moved
            out after a write is copied back to the host, otherwise dropped).
    """

    name: str
    needs: dict[str, tuple[Part, ...]]
    writes: dict[str, tuple[Part, ...]] = field(default_factory=dict)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes < 2**30 else f"{nbytes / 2**30:.2f} GiB"


def _key(item: Item) -> str:
    return f"{item[0]}/{item[1].value}"


@dataclass(frozen=True)
class BoundaryPlan:
    """What changes at the boundary into one phase, per actor: ``out`` and ``into`` map an actor
    name to the parts it offloads and onloads."""

    out: dict[str, tuple[Part, ...]]
    into: dict[str, tuple[Part, ...]]


class ResidencySchedule:
    """The residency plan of every bundle of a run, and what is resident now.

    Args:
        sizes: Actor name -> part -> device bytes when resident (every actor of the run).
        budget_bytes: Device bytes each bundle may hold (the same for all when an int).
        phases: The loop's phases in their declared order (the cycle the plan optimises).
        bundles: Actor name -> the bundle (device) it lives on.
        pinned: Items resident in every phase, whatever the phase needs (an engine that cannot
            sleep).

    Raises:
        ValueError: A phase alone exceeds a bundle's budget (naming the bundle, the phase, its
            bytes and the budget).
    """

    def __init__(
        self,
        sizes: Mapping[str, Mapping[Part, int]],
        budget_bytes: int | Mapping[int, int],
        phases: Sequence[PhaseDemand],
        bundles: Mapping[str, int],
        pinned: Iterable[Item] = (),
    ):
        self.names = list(sizes)
        self.bundle_of = {n: int(bundles.get(n, 0)) for n in self.names}
        self.bundles = sorted(set(self.bundle_of.values()))
        self.budget = (
            {b: int(budget_bytes) for b in self.bundles}
            if isinstance(budget_bytes, (int, float))
            else {b: int(budget_bytes[b]) for b in self.bundles}
        )
        self.phase_names = [p.name for p in phases]
        self.sizes: dict[Item, int] = {}
        self.resident: set[Item] = set()  # what the driver has onloaded (or is onloading) and not offloaded
        self.plans: dict[int, ResidencyPlan] = {}
        self.replans = 0
        self.pinned = {(a, Part(p)) for a, p in pinned if a in self.names}
        self._needs = [{a: tuple(parts) for a, parts in p.needs.items() if a in self.names} for p in phases]
        for need in self._needs:  # a pinned item is needed in every phase
            for a, p in sorted(self.pinned):
                need[a] = tuple(dict.fromkeys([*need.get(a, ()), p]))
        self._writes = [{a: tuple(parts) for a, parts in p.writes.items() if a in self.names} for p in phases]
        self._plan(sizes)

    def index(self, phase: str) -> int:
        """The position of ``phase`` in the declared order."""
        return self.phase_names.index(phase)

    # -- planning ---------------------------------------------------------------------------
    def _plan(self, sizes: Mapping[str, Mapping[Part, int]]) -> None:
        self.sizes = {(n, Part(p)): int(b) for n, parts in sizes.items() for p, b in parts.items()}
        plans = {}
        for b in self.bundles:
            names = [n for n in self.names if self.bundle_of[n] == b]
            items = {_key(i): n for i, n in self.sizes.items() if i[0] in names}
            phases = [[_key((a, p)) for a, parts in need.items() if a in names for p in parts] for need in self._needs]
            written = [[_key((a, p)) for a, parts in w.items() if a in names for p in parts] for w in self._writes]
            scratch = [_key((n, Part.GRADS)) for n in names if _key((n, Part.GRADS)) in items]
            needs = [sum(items.get(k, 0) for k in ph) for ph in phases]
            worst = max(range(len(phases)), key=lambda i: needs[i])
            if needs[worst] > self.budget[b]:
                where = f"device {b} (bundle {b})" if len(self.bundles) > 1 else "the device"
                raise ValueError(
                    f"memory.device_budget_mb is below what one phase needs on {where}: {self.phase_names[worst]} "
                    f"needs {_mib(needs[worst])} but the budget is {_mib(self.budget[b])}; raise "
                    f"memory.device_budget_mb to at least {-(-needs[worst] // 2**20)}, or set it to null (onload "
                    "each phase's models, offload them after)"
                )
            plans[b] = plan_residency(items, phases, self.budget[b], written=written, scratch=scratch)
        self.plans = plans
        self._kept_scratch = {
            b: self._keep_scratch(b, set(s for s in self.sizes if self.bundle_of.get(s[0], 0) == b))
            for b in self.bundles
        }

    def _keep_scratch(self, bundle: int, items: set[Item]) -> set[Item]:
        """Gradients the plan drops between training phases but that fit beside every phase's
        resident set: keep them. Dropping and rebuilding them copies nothing (the plan's cost is the
        same), but rebuilding zeroes them, which takes time."""
        plan = self.plans[bundle]
        load = list(plan.resident_bytes)
        kept = set()
        for item in sorted((i for i in items if i[1] is Part.GRADS), key=lambda i: -self.sizes[i]):
            key = _key(item)
            missing = [i for i, r in enumerate(plan.resident) if key not in r]
            if missing and all(load[i] + self.sizes[item] <= self.budget[bundle] for i in missing):
                for i in missing:
                    load[i] += self.sizes[item]
                kept.add(item)
        return kept

    def update_sizes(self, sizes: Mapping[str, Mapping[Part, int]]) -> bool:
        """Plan again when any item's size changed (measured after a phase); returns whether it did.

        Raises:
            ValueError: A phase no longer fits the budget.
        """
        new = {(n, Part(p)): int(b) for n, parts in sizes.items() for p, b in parts.items()}
        if all(self.sizes.get(i) == b for i, b in new.items()):
            return False
        merged = {n: {p: self.sizes.get((n, p), 0) for p in Part} for n in self.names}
        for (n, p), b in new.items():
            merged[n][p] = b
        self._plan(merged)
        self.replans += 1
        return True

    # -- the phases -------------------------------------------------------------------------
    def target(self, phase: int) -> set[Item]:
        """The items resident during phase ``phase`` (its index in the declared order), over all bundles."""
        out: set[Item] = set()
        for b, plan in self.plans.items():
            for key in plan.resident[phase]:
                name, _, part = key.rpartition("/")
                out.add((name, Part(part)))
            out |= self._kept_scratch[b]
        return out

    def kept(self, phase: int) -> dict[str, list[str]]:
        """Actor -> the parts resident now beyond what phase ``phase`` needs: kept by the plan, or
        already loaded for the next phase (prefetch)."""
        need = {(a, p) for a, parts in self._needs[phase].items() for p in parts}
        out: dict[str, list[str]] = {}
        for a, p in sorted(self.resident - need, key=lambda i: (i[0], i[1].value)):
            out.setdefault(a, []).append(p.value)
        return out

    def boundary(self, phase: int) -> BoundaryPlan:
        """What moves at the boundary into ``phase`` from what is resident now."""
        target = self.target(phase)
        return BoundaryPlan(_by_actor(self.resident - target), _by_actor(target - self.resident))

    def fits(self, items: Iterable[Item]) -> bool:
        """Whether ``items`` fit every bundle's budget together."""
        items = set(items)
        return all(
            sum(self.sizes.get(i, 0) for i in items if self.bundle_of.get(i[0], 0) == b) <= self.budget[b]
            for b in self.bundles
        )

    def moved(self, moves: BoundaryPlan) -> None:
        """Record a boundary's moves as made (the driver issued them)."""
        for a, parts in moves.out.items():
            self.resident.difference_update((a, p) for p in parts)
        for a, parts in moves.into.items():
            self.resident.update((a, p) for p in parts)

    def clear(self) -> None:
        """Everything was offloaded (or put back on the device by hand): nothing resident."""
        self.resident = set()

    def summary(self) -> dict:
        """Per bundle: budget, planned bytes moved per iteration, all-or-nothing's, resident sets."""
        return {
            str(b): {
                "budget_bytes": self.budget[b],
                "bytes_moved": p.bytes_moved,
                "all_or_nothing_bytes": p.all_or_nothing_bytes,
                "optimal": p.optimal,
                "phases": list(self.phase_names),
                "resident": [sorted(r) for r in p.resident],
                "gradients_kept": sorted(_key(i) for i in self._kept_scratch[b]),
            }
            for b, p in self.plans.items()
        }


def _by_actor(items: Iterable[Item]) -> dict[str, tuple[Part, ...]]:
    out: dict[str, list[Part]] = {}
    for a, p in sorted(items, key=lambda i: (i[0], list(Part).index(i[1]))):
        out.setdefault(a, []).append(p)
    return {a: tuple(ps) for a, ps in out.items()}
