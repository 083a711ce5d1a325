"""The memory timeline as a picture: :func:`plot_timeline` draws a fixed-size figure (about 1300 x
960 px whatever the run's length): one iteration's phases by actor and part, the peak per
iteration, the engine's log-prob mismatch when there is one, and the manager on next to off."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from chatlearn_mem import Part
from chatlearn_mem.parts import OTHER
from chatlearn_mem_ray.service.timeline import TRAIN_PARTS, MemoryTimeline, PhaseRecord

__all__ = ["plot_timeline"]


MiB = 2**20
PART_HATCH = {
    Part.WEIGHTS: "",
    Part.GRADS: "////",
    Part.MAIN_WEIGHTS: "....",
    Part.OPTIMIZER_STATES: "xxxx",
    OTHER: "----",
}
PART_ALPHA = {Part.WEIGHTS: 1.0, Part.GRADS: 0.75, Part.MAIN_WEIGHTS: 0.6, Part.OPTIMIZER_STATES: 0.45, OTHER: 0.3}
FIGSIZE, DPI = (13.0, 9.6), 100  # 1300 x 960 px
ROLE_CMAP = {"policy": "Blues", "critic": "Oranges", "rollout": "Greens", "reference": "Purples"}
OTHER_COLORS = ("tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray", "tab:red")


def _role(actor: str) -> tuple[str, int]:
    """``"policy_1"`` -> ``("policy", 1)``; a name without a rank suffix is rank 0."""
    base, _, rank = actor.rpartition("_")
    return (base, int(rank)) if base and rank.isdigit() else (actor, 0)


def _actor_colors(names: list[str]) -> tuple[list[str], dict]:
    """The actors in a stable order (policy, critic, rollout, reference, others; by rank) and a
    colour each: one hue per role, the ranks of a role in shades of it, so every run's picture
    reads the same."""
    import matplotlib.pyplot as plt

    roles = list(ROLE_CMAP)
    order = sorted(
        names,
        key=lambda a: (
            roles.index(_role(a)[0]) if _role(a)[0] in roles else len(roles),
            _role(a)[0] if _role(a)[0] not in roles else "",
            _role(a)[1],
            a,
        ),
    )
    colors, others = {}, 0
    for role, cmap_name in ROLE_CMAP.items():
        members = [a for a in order if _role(a)[0] == role]
        cmap = plt.get_cmap(cmap_name)
        for k, a in enumerate(members):
            colors[a] = cmap(0.7 if len(members) == 1 else 0.85 - 0.5 * k / (len(members) - 1))
    for a in order:
        if a not in colors:
            colors[a] = OTHER_COLORS[others % len(OTHER_COLORS)]
            others += 1
    return order, colors


def _ratio(peak: int, need: int) -> float:
    return peak / need if need else float("nan")


def _fmt_mib(nbytes: float) -> str:
    mib = nbytes / MiB
    return f"{mib:.2f}" if mib < 100 else f"{mib:.0f}"


def _no_data(ax, title: str, why: str) -> None:
    ax.set_title(title, fontsize=10, loc="left")
    ax.text(0.5, 0.5, why, ha="center", va="center", fontsize=10, color="0.35", transform=ax.transAxes, wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


def _iteration_stats(timeline: MemoryTimeline) -> list[dict]:
    """Per iteration (and manager setting), in the order run: its worst phase's colocated bytes and
    largest need, its position ``x`` on the peak panel (1, 2, ...) and its ``label``. A manager-off
    iteration after manager-on ones is a comparison iteration, numbered from 1 again as on the
    console (``"manager-off iteration 1"``)."""
    groups: dict[tuple[int, bool], list[PhaseRecord]] = {}
    for r in timeline.records:
        groups.setdefault((r.iteration, r.manager_on), []).append(r)
    out, seen_on = [], False
    for x, ((it, on), recs) in enumerate(groups.items(), 1):
        seen_on |= on
        comparison = seen_on and not on
        peak = max(recs, key=lambda r: r.colocated_bytes)
        largest = max(recs, key=lambda r: r.need_bytes)
        out.append(
            {
                "iteration": it,
                "manager_on": on,
                "records": recs,
                "x": x,
                "comparison": comparison,
                "label": f"manager-off iteration {it}" if comparison else f"iteration {it}",
                "peak_colocated_bytes": peak.colocated_bytes,
                "peak_phase": peak.phase,
                "largest_phase_bytes": largest.need_bytes,
                "largest_phase": largest.phase,
                "ratio": _ratio(peak.colocated_bytes, largest.need_bytes),
            }
        )
    return out


def _parts_of(rec: PhaseRecord, actor: str) -> list[tuple[str, int]]:
    """(part, device bytes) of ``actor`` in ``rec``; one ``"total"`` part when the log predates
    the per-part record."""
    if actor in rec.device_by_part:
        by = rec.device_by_part[actor]
        order = [p for p in TRAIN_PARTS if p in by] + [p for p in by if p not in TRAIN_PARTS]
        return [(p, by[p]) for p in order]
    return [("total", rec.device_bytes.get(actor, 0))]


def _holders(rec: PhaseRecord, actors: list[str]) -> str:
    """The actors holding device bytes, short: ``"critic_0, rollout"``; ranks of a role counted
    (``"policy x4"``) when there are more than two holders."""
    holders = [a for a in actors if rec.device_bytes.get(a, 0) > 0]
    if len(holders) <= 2:
        return ", ".join(holders) or "nothing resident"
    by_role: dict[str, list[str]] = {}
    for a in holders:
        by_role.setdefault(_role(a)[0], []).append(a)
    return ", ".join(names[0] if len(names) == 1 else f"{role} x{len(names)}" for role, names in by_role.items())


def _plot_detail(ax, stat: dict, actors: list[str], colors: dict) -> None:
    """Panel 1: one iteration, a stacked bar per phase; colour = actor, hatch and shade = part."""
    recs = stat["records"]
    budget = max((max(r.budget_bytes.values()) for r in recs if r.budget_bytes), default=0)
    top = max([r.colocated_bytes for r in recs] + [r.need_bytes for r in recs] + [budget, 1]) / MiB
    kept_seen = False
    for x, rec in enumerate(recs):
        bottom = 0.0
        for a in actors:
            for part, nbytes in _parts_of(rec, a):
                if nbytes <= 0:
                    continue
                h = nbytes / MiB
                kept = part in rec.kept.get(a, ())
                kept_seen |= kept
                ax.bar(
                    x,
                    h,
                    bottom=bottom,
                    width=0.62,
                    color=colors[a],
                    alpha=PART_ALPHA.get(part, 1.0),
                    hatch=PART_HATCH.get(part, ""),
                    edgecolor="tab:red" if kept else "0.15",
                    linewidth=1.6 if kept else 0.5,
                    linestyle="--" if kept else "-",
                )
                if h > 0.07 * top:  # room for a label inside the segment
                    ax.text(
                        x,
                        bottom + h / 2,
                        f"{a} {part} {_fmt_mib(nbytes)}",
                        ha="center",
                        va="center",
                        fontsize=8,
                        bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.85),
                    )
                bottom += h
        ax.text(
            x,
            bottom + 0.015 * top,
            f"{_fmt_mib(rec.colocated_bytes)} MiB\n" + _holders(rec, actors),
            ha="center",
            va="bottom",
            fontsize=8,
        )
        ax.plot([x - 0.36, x + 0.36], [rec.need_bytes / MiB] * 2, color="black", ls="--", lw=1.2)
    ax.plot([], [], color="black", ls="--", lw=1.2, label="the phase's need")
    if budget:
        per = " per device" if any(len(r.budget_bytes) > 1 for r in recs) else ""
        ax.axhline(budget / MiB, color="tab:red", lw=1.4, label=f"device budget{per} ({_fmt_mib(budget)} MiB)")
    if kept_seen:
        ax.bar(
            [0],
            [0],
            color="white",
            edgecolor="tab:red",
            linestyle="--",
            linewidth=1.6,
            label="kept resident beyond the phase's need (residency plan)",
        )
    ax.set_xticks(range(len(recs)))
    ax.set_xticklabels([r.phase for r in recs], fontsize=9)
    ax.set_xlim(-0.6, len(recs) - 0.4)
    ax.set_ylim(0, top * 1.22)
    ax.set_ylabel("device MiB", fontsize=9)
    mode = "on" if stat["manager_on"] else "off"
    ax.set_title(
        f"(1) {stat['label']} (the last with the memory manager {mode}): "
        f"device bytes per phase, by actor and part"
        + ("" if any(r.device_by_part for r in recs) else " (parts not in this log: totals)"),
        fontsize=10,
        loc="left",
    )
    ax.legend(fontsize=8, loc="upper left")


def _plot_mismatch(ax, stats: list[dict], mismatch: dict[tuple[int, bool], float]) -> None:
    """Panel 2's right axis: the training-inference mismatch of each iteration that has one."""
    pts = [
        (s["x"], mismatch[(s["iteration"], s["manager_on"])])
        for s in stats
        if (s["iteration"], s["manager_on"]) in mismatch
    ]
    pts = [(x, max(v, 1e-12)) for x, v in pts]  # an exact match still gets a point on a log axis
    if not pts:
        return
    right = ax.twinx()
    right.scatter(
        [x for x, _ in pts],
        [v for _, v in pts],
        marker="^",
        color="tab:green",
        s=26,
        zorder=4,
        label="log-prob mismatch (right)",
    )
    right.set_yscale("log")
    low, high = min(v for _, v in pts), max(v for _, v in pts)
    right.set_ylim(low / 3, high * 3)
    right.tick_params(which="both", labelsize=8, colors="tab:green")  # the legend names the axis
    handles, labels = ax.get_legend_handles_labels()
    more, more_labels = right.get_legend_handles_labels()
    ax.legend(handles + more, labels + more_labels, fontsize=8, loc="lower left", ncol=2)


def _plot_peaks(ax, stats: list[dict]) -> None:
    """Panel 2: per iteration, the worst phase's colocated bytes and the largest phase's need; the
    comparison iterations follow the others, their ticks labelled ``off 1``, ``off 2``, ..."""
    xs = [s["x"] for s in stats]
    ax.plot(xs, [s["peak_colocated_bytes"] / MiB for s in stats], color="0.55", lw=1, zorder=1)
    ax.plot(
        xs,
        [s["largest_phase_bytes"] / MiB for s in stats],
        color="black",
        ls="--",
        lw=1.2,
        label="largest phase's need",
        zorder=2,
    )
    for on, marker, color, label in (
        (True, "o", "0.15", "peak colocated, manager on"),
        (False, "s", "tab:red", "peak colocated, manager off"),
    ):
        sel = [s for s in stats if s["manager_on"] == on]
        if sel:
            ax.scatter(
                [s["x"] for s in sel],
                [s["peak_colocated_bytes"] / MiB for s in sel],
                marker=marker,
                color=color,
                s=30,
                zorder=3,
                label=label,
            )
    off = [s["x"] for s in stats if not s["manager_on"]]
    for i, it in enumerate(off):
        ax.axvspan(it - 0.5, it + 0.5, color="tab:red", alpha=0.1, lw=0, label="manager off" if i == 0 else None)
    top = max(s["peak_colocated_bytes"] for s in stats) / MiB
    for on in (True, False):  # the ratio at the last iteration of each setting
        sel = [s for s in stats if s["manager_on"] == on]
        if sel:
            s = sel[-1]
            ax.annotate(
                f"ratio {s['ratio']:.2f}\n({s['peak_phase']})",
                (s["x"], s["peak_colocated_bytes"] / MiB),
                xytext=(0, 8),
                textcoords="offset points",
                ha="right" if on and off else "center",
                va="bottom",
                fontsize=8,
            )
    ax.set_ylim(0, top * 1.35 if top else 1)
    ax.set_xlim(min(xs) - 0.7, max(xs) + 0.7)
    ax.set_xlabel("iteration", fontsize=9)
    ax.set_ylabel("device MiB", fontsize=9)
    main, compared = [s for s in stats if not s["comparison"]], [s for s in stats if s["comparison"]]
    ticks = main[:: -(-len(main) // 10) or 1] + compared[:: -(-len(compared) // 5) or 1]  # about 10 + 5 at most
    ax.set_xticks(
        [s["x"] for s in ticks], [f"off {s['iteration']}" if s["comparison"] else str(s["iteration"]) for s in ticks]
    )
    ax.set_title("(2) peak per iteration: all actors at the worst phase vs the largest phase", fontsize=10, loc="left")
    ax.legend(fontsize=8, loc="lower left", ncol=2)


def _plot_on_off(ax, on: Optional[dict], off: Optional[dict], actors: list[str], colors: dict) -> None:
    """Panel 3: the five phases with the manager on next to off, stacked by actor."""
    shown = [(s, dx, lab) for s, dx, lab in ((on, -0.21, "on"), (off, 0.21, "off")) if s is not None]
    phases = []
    for s, _, _ in shown:
        phases += [r.phase for r in s["records"] if r.phase not in phases]
    top = max(r.colocated_bytes for s, _, _ in shown for r in s["records"]) / MiB or 1.0
    for s, dx, lab in shown:
        for rec in s["records"]:
            x = phases.index(rec.phase) + dx
            bottom = 0.0
            for a in actors:
                h = rec.device_bytes.get(a, 0) / MiB
                if h > 0:
                    ax.bar(x, h, bottom=bottom, width=0.4, color=colors[a], edgecolor="0.15", linewidth=0.5)
                bottom += h
            ax.text(
                x, bottom + 0.015 * top, f"{lab}\n{_fmt_mib(rec.colocated_bytes)}", ha="center", va="bottom", fontsize=8
            )
    largest = max(s["largest_phase_bytes"] for s, _, _ in shown) / MiB
    ax.axhline(largest, color="black", ls="--", lw=1.2, label="largest phase's need")
    ax.set_xticks(range(len(phases)))
    ax.set_xticklabels(phases, fontsize=9)
    ax.set_xlim(-0.6, len(phases) - 0.4)
    ax.set_ylim(0, top * 1.3)
    ax.set_ylabel("colocated device MiB", fontsize=9)
    ax.legend(fontsize=8, loc="upper right")
    parts = [f"manager {lab} ({s['label']}): {s['ratio']:.2f}" for s, _, lab in shown]
    ax.set_title("(3) manager on vs off, peak colocated / largest phase:\n" + ", ".join(parts), fontsize=10, loc="left")
    if on is None or off is None:
        missing = "on" if on is None else "off"
        ax.text(
            0.02,
            0.97,
            f"no manager-{missing} iteration in this run",
            transform=ax.transAxes,
            ha="left",
            va="top",
            fontsize=9,
            color="tab:red",
        )


def plot_timeline(
    timeline: MemoryTimeline, path: Path, title: str = "", mismatch: Optional[dict[tuple[int, bool], float]] = None
) -> Path:
    """The run's memory in three panels, about 1300 x 960 pixels whatever the run's length.

    1. One iteration in detail (the last with the manager on, else the last): a stacked bar per
       phase whose segments are each actor's parts (colour = actor, hatch and shade = part), with
       the phase's need dashed. With the manager on, each bar is the active model only.
    2. Per iteration, the peak colocated bytes (all actors at the worst phase) and the largest
       phase's need; manager-off iterations are red squares on a shaded band. With ``mismatch``
       (``(iteration, manager_on) -> max |policy - engine| log-prob``, the vLLM rollout's
       training-inference mismatch), green triangles on a log scale at the right.
    3. An iteration with the manager on next to one with it off (the last of each), stacked by
       actor, with each one's ratio peak colocated / largest phase in the title.

    A panel without data says so instead (e.g. no manager-off iterations); an empty timeline
    gives a figure that says it is empty.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    path = Path(path)
    stats = _iteration_stats(timeline)
    actors, colors = _actor_colors(
        list(dict.fromkeys(a for r in timeline.records for a in [*r.device_bytes, *r.device_by_part]))
    )
    last_on = next((s for s in reversed(stats) if s["manager_on"]), None)
    last_off = next((s for s in reversed(stats) if not s["manager_on"]), None)
    detail = last_on or (stats[-1] if stats else None)
    parts_seen = {
        p for r in (detail["records"] if detail else []) for a in actors for p, nbytes in _parts_of(r, a) if nbytes > 0
    }
    handles = [Patch(facecolor=colors[a], edgecolor="0.15", label=a) for a in actors]
    handles += [
        Patch(facecolor="0.6", alpha=PART_ALPHA[p], hatch=PART_HATCH[p], edgecolor="0.15", label=p)
        for p in TRAIN_PARTS
        if p in parts_seen
    ]
    legend_rows = max(1, -(-len(handles) // 10))

    fig = plt.figure(figsize=FIGSIZE, dpi=DPI)
    # Fixed margins (in figure fractions) leave room for the title lines, the legend rows and the
    # two-line title of panel 3, so the layout does not depend on the data.
    grid = fig.add_gridspec(
        2,
        2,
        height_ratios=(1.15, 1.0),
        left=0.05,
        right=0.99,
        top=0.86 - 0.03 * (legend_rows - 1),
        bottom=0.055,
        hspace=0.3,
        wspace=0.2 if mismatch else 0.14,  # room for panel 2's right axis
    )
    ax1, ax2, ax3 = fig.add_subplot(grid[0, :]), fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1])
    if detail is None:
        for n, ax in enumerate((ax1, ax2, ax3), 1):
            _no_data(ax, f"({n})", "no phases recorded")
    else:
        _plot_detail(ax1, detail, actors, colors)
        _plot_peaks(ax2, stats)
        if mismatch:
            _plot_mismatch(ax2, stats, mismatch)
        _plot_on_off(ax3, last_on, last_off, actors, colors)
    for ax in (ax1, ax2, ax3):
        ax.tick_params(labelsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    if handles:
        fig.legend(
            handles=handles,
            loc="upper center",
            bbox_to_anchor=(0.5, 0.925),
            ncol=-(-len(handles) // legend_rows),
            fontsize=9,
            frameon=False,
            handlelength=2.5,
            handleheight=1.2,
        )
    lines = [title] if title else []
    summaries = [(on, timeline.summary(on)) for on in (True, False)]
    lines.append(
        "\n".join(
            f"manager {'on' if on else 'off'}: peak colocated {_fmt_mib(s['peak_colocated_bytes'])} "
            f"MiB ({s['peak_phase']}) / largest phase {_fmt_mib(s['largest_phase_bytes'])} MiB "
            f"({s['largest_phase']}) = {s['ratio']:.2f}"
            for on, s in summaries
            if s
        )
        or "no phases recorded"
    )
    fig.suptitle("\n".join(lines), fontsize=11, y=0.99, va="top")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
