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
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

__all__ = ["MemoryTimeline", "PhaseRecord", "plot_timeline"]

TRAIN_PARTS = ("weights", "grads", "main_weights", "optimizer_states", "other")


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

    @property
    def colocated_bytes(self) -> int:
        return sum(self.device_bytes.values())


@dataclass
class MemoryTimeline:
    """Every :class:`PhaseRecord` of a run, in order."""

    records: list[PhaseRecord] = field(default_factory=list)

    def add(self, iteration: int, phase: str, manager_on: bool, seconds: float,
            active: dict[str, list[str]], residency: dict[str, dict]) -> PhaseRecord:
        """Record a phase from every actor's ``residency()`` taken at its peak."""
        need = sum(residency[a]["by_part"].get(p, 0) for a, parts in active.items() for p in parts)
        rec = PhaseRecord(iteration, phase, manager_on, seconds, {a: list(p) for a, p in active.items()},
                          {a: r["device_bytes"] for a, r in residency.items()}, need,
                          {a: r["cuda_allocated_bytes"] for a, r in residency.items() if "cuda_allocated_bytes" in r})
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
        return {"peak_colocated_bytes": peak.colocated_bytes, "peak_phase": peak.phase,
                "largest_phase_bytes": largest.need_bytes, "largest_phase": largest.phase,
                "ratio": peak.colocated_bytes / largest.need_bytes if largest.need_bytes else float("nan"),
                "phases": len(recs)}

    def to_json(self) -> list[dict]:
        return [asdict(r) | {"colocated_bytes": r.colocated_bytes} for r in self.records]


def plot_timeline(timeline: MemoryTimeline, path: Path, title: str = "") -> Path:
    """Stacked device bytes per actor for every phase; one panel per manager setting present.

    Each bar is a phase; its segments are the actors' device bytes, so a bar made of one colour
    means only the active phase's model was resident. The dashed line is the largest phase's need.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(on, [r for r in timeline.records if r.manager_on == on]) for on in (True, False)]
    panels = [(on, recs) for on, recs in panels if recs]
    actors = sorted({a for r in timeline.records for a in r.device_bytes})
    colors = {a: plt.get_cmap("tab10")(i % 10) for i, a in enumerate(actors)}
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8, 0.35 * max(len(r) for _, r in panels) + 4),
                                                      3.6 * len(panels)), squeeze=False, sharey=True)
    for ax, (on, recs) in zip(axes[:, 0], panels):
        xs = range(len(recs))
        bottom = [0.0] * len(recs)
        for a in actors:
            mib = [r.device_bytes.get(a, 0) / 2**20 for r in recs]
            ax.bar(xs, mib, bottom=bottom, color=colors[a], label=a, width=0.85)
            bottom = [b + m for b, m in zip(bottom, mib)]
        summary = timeline.summary(on)
        ax.axhline(summary["largest_phase_bytes"] / 2**20, color="black", ls="--", lw=1,
                   label="largest phase need")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{r.iteration}:{r.phase}" for r in recs], rotation=70, fontsize=7)
        ax.set_ylabel("device MiB")
        ax.set_title(f"memory manager {'on' if on else 'off'}: peak colocated / largest phase = "
                     f"{summary['ratio']:.2f}", fontsize=10)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
