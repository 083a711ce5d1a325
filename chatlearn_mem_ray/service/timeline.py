"""Device memory of every colocated actor, phase by phase, and the figure that says whether
colocation works: ``peak_colocated_bytes / largest_phase_bytes``.

For each phase the run records, at the phase's peak (after its models were onloaded and its
work done, before they are offloaded), the device bytes every actor holds (its manager's
residency: weights, grad buffers, main weights, optimizer states, derived grads) and the bytes the
phase needs: the parts its active actors use (weights for a forward pass, everything for
training). Then

- ``peak_colocated_bytes`` = max over phases of the sum over all actors;
- ``largest_phase_bytes`` = max over phases of the phase's need.

With every model resident the ratio is about the number of models; with the memory manager it
is close to 1. Activations and allocator caches are not included (the manager does not own
them); on CUDA each actor also reports ``torch.cuda.memory_allocated``.

Each record also keeps every actor's device bytes per part (``device_by_part``);
:func:`chatlearn_mem_ray.service.timeline_plot.plot_timeline` draws it.
:meth:`MemoryTimeline.from_json` rebuilds a timeline from a run's ``log.json`` to re-plot it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Mapping, Optional, Sequence

from chatlearn_mem.residency import CATEGORIES

__all__ = ["MemoryTimeline", "PhaseRecord", "TRAIN_PARTS"]

TRAIN_PARTS = CATEGORIES
"""Residency categories in drawing order: every :class:`~chatlearn_mem.Part`, then ``other``."""


@dataclass
class PhaseRecord:
    """One phase of one iteration."""

    iteration: int
    phase: str
    manager_on: bool
    seconds: float
    active: dict[str, list[str]]  # actor -> parts the phase needs
    device_bytes: dict[str, int]  # actor -> device bytes at the phase's peak
    need_bytes: int
    cuda_allocated_bytes: dict[str, int] = field(default_factory=dict)
    # actor -> part (weights, grads, main_weights, optimizer_states, other) -> device bytes at the
    # phase's peak; sums to ``device_bytes[actor]``. Empty in logs written before it was recorded.
    device_by_part: dict[str, dict[str, int]] = field(default_factory=dict)
    # bytes copied by the phase's transitions (gradients are dropped, never copied) and the seconds
    # the driver waited on transitions (those that did not overlap the phase's work)
    moved_in_bytes: int = 0
    moved_out_bytes: int = 0
    transition_seconds: float = 0.0
    # with a device budget (memory.device_budget_mb): bytes per device (bundle) at the phase's peak,
    # each device's budget, and actor -> the parts kept resident beyond what the phase needs
    bundle_bytes: dict[str, int] = field(default_factory=dict)
    budget_bytes: dict[str, int] = field(default_factory=dict)
    kept: dict[str, list[str]] = field(default_factory=dict)
    # actor -> its process's resident set at the phase's peak (empty in older logs): a run that
    # grows host memory shows it here, iteration by iteration
    rss_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def colocated_bytes(self) -> int:
        return sum(self.device_bytes.values())


@dataclass
class MemoryTimeline:
    """Every :class:`PhaseRecord` of a run, in order."""

    records: list[PhaseRecord] = field(default_factory=list)

    def add(
        self,
        iteration: int,
        phase: str,
        manager_on: bool,
        seconds: float,
        active: dict[str, list[str]],
        residency: dict[str, dict],
        moved: Sequence[dict] = (),
        transition_seconds: float = 0.0,
        budget_bytes: Optional[Mapping[int, int]] = None,
        kept: Optional[dict[str, list[str]]] = None,
        bundles: Optional[Mapping[str, int]] = None,
    ) -> PhaseRecord:
        """Record a phase from every actor's ``residency()`` taken at its peak.

        Args:
            moved: The actors' transfer stats of the phase (``{"direction", "copied_bytes", ...}``).
            transition_seconds: Seconds the driver waited on transitions.
            budget_bytes: Device (bundle) -> budget, with a residency plan.
            kept: Actor -> parts kept resident beyond the phase's need, with a residency plan.
            bundles: Actor -> the bundle (device) it lives on (default: all on bundle 0).
        """
        need = sum(residency[a]["by_part"].get(p, 0) for a, parts in active.items() for p in parts)
        on = {a: str((bundles or {}).get(a, 0)) for a in residency}
        per_bundle: dict[str, int] = {}
        for a, r in residency.items():
            per_bundle[on[a]] = per_bundle.get(on[a], 0) + r["device_bytes"]
        rec = PhaseRecord(
            iteration,
            phase,
            manager_on,
            seconds,
            {a: list(p) for a, p in active.items()},
            {a: r["device_bytes"] for a, r in residency.items()},
            need,
            {a: r["cuda_allocated_bytes"] for a, r in residency.items() if "cuda_allocated_bytes" in r},
            {a: {p: int(b) for p, b in r.get("by_part", {}).items()} for a, r in residency.items()},
            moved_in_bytes=sum(s["copied_bytes"] for s in moved if s["direction"] == "onload"),
            moved_out_bytes=sum(s["copied_bytes"] for s in moved if s["direction"] == "offload"),
            transition_seconds=transition_seconds,
            bundle_bytes=per_bundle,
            budget_bytes={str(b): int(v) for b, v in (budget_bytes or {}).items()},
            kept=dict(kept or {}),
            rss_bytes={a: int(r["rss_bytes"]) for a, r in residency.items() if r.get("rss_bytes") is not None},
        )
        self.records.append(rec)
        return rec

    def summary(self, manager_on: bool) -> Optional[dict]:
        """Peak colocated bytes, largest phase bytes and their ratio over the phases run with the
        manager on (or off); None when there are none."""
        recs = [r for r in self.records if r.manager_on == manager_on]
        if not recs:
            return None
        peak = max(recs, key=lambda r: r.colocated_bytes)
        largest = max(recs, key=lambda r: r.need_bytes)
        return {
            "peak_colocated_bytes": peak.colocated_bytes,
            "peak_phase": peak.phase,
            "largest_phase_bytes": largest.need_bytes,
            "largest_phase": largest.phase,
            "ratio": peak.colocated_bytes / largest.need_bytes if largest.need_bytes else float("nan"),
            "phases": len(recs),
        }

    def to_json(self) -> list[dict]:
        return [asdict(r) | {"colocated_bytes": r.colocated_bytes} for r in self.records]

    @classmethod
    def from_json(cls, records: list[dict]) -> "MemoryTimeline":
        """The timeline back from :meth:`to_json`'s records (``log["memory_timeline"]`` of a run's
        ``log.json``), e.g. to re-plot a run without running it again. Derived keys
        (``colocated_bytes``) are recomputed; logs without ``device_by_part`` still load."""
        names = {f.name for f in fields(PhaseRecord)}
        return cls([PhaseRecord(**{k: v for k, v in r.items() if k in names}) for r in records])
