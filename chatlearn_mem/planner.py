"""Residency planning: which items stay on the device in each phase of a cyclic schedule.

An RLHF iteration is a cycle of phases (generate, reference, values, train the critic, train the
policy, then generate again). Each phase needs some *items* resident, an item being one part of one
model (``"policy/optimizer_states"``). With a device budget larger than the largest phase, keeping
an item resident across a phase that does not need it saves copying it out and back in.
:func:`plan_residency` picks, under the budget, the resident set of every phase that copies the
fewest bytes per iteration. It is pure Python: no torch, no Ray.

Cost model (what :func:`residency_bytes_moved` computes for any resident schedule):

* The schedule repeats: phase 0 follows phase ``P - 1``. At the boundary into phase ``i`` the items
  of ``resident[i - 1]`` missing from ``resident[i]`` move out first, then the items of
  ``resident[i]`` missing from ``resident[i - 1]`` move in, so only each phase's own resident set
  must fit the budget.
* For one item, its *runs* are the maximal cyclic runs of consecutive phases where it is resident.
  Each run costs an in-move at its start (the item's size) plus an out-move at its end: the size
  if the item is written in some phase of that run, 0 if not (its host copy is current, so it is
  dropped).
* Scratch items (gradients: dropped, rebuilt zeroed) are never copied: their moves cost 0.
* An item resident in every phase never moves (cost 0, written or not); an item resident in none
  costs 0.
* Steady state: at the start of every run the host holds the item's current value. It was copied
  out at the end of the run before, or the item was not modified since its host copy was made.
  The first iteration (when the host copy is first made) is not counted: the plan's bytes are
  those of every later iteration.

Items interact only through the per-phase budget, so the planner is a multiple-choice knapsack
with one capacity per phase. For each item it enumerates the resident patterns worth having: the
phases that need the item plus any subset of the gaps between them, each gap kept whole (a gap
kept in part still costs a move out and a move in, and holds more memory). It drops dominated
patterns (another pattern holding a subset of the phases costs no more). It then chooses one
pattern per item:

1. greedy: patterns in order of bytes saved per weighted byte-phase held, each taken when it
   saves more than the item's current pattern and fits, then single-item improvement until none
   helps. Several passes: every phase weighted 1; phases priced by a few subgradient steps of the
   Lagrangian relaxation of the budgets (a crowded phase costs more); bytes saved alone. The best
   pass is then improved by pairwise exchanges (an item steps down so that another steps up by
   more);
2. exact branch and bound over all items from that incumbent, pruned by the sum of each
   remaining item's best pattern that fits the room left (and cut short when that sum is
   reachable as is). When it finishes within a quarter of ``_MAX_WORK`` units of work, the plan is
   proven optimal (:attr:`ResidencyPlan.optimal`). Schedules of a PPO loop's size need a few
   dozen units;
3. otherwise a large-neighbourhood search spends the rest: groups of up to ten items that share a
   phase are re-solved exactly by the same branch and bound, the other items held fixed (groups
   drawn with a fixed seed, so the plan is deterministic). The plan is then the best found.

Every step starts from or improves on the all-or-nothing plan (each phase keeps exactly what it
needs), so a plan never moves more bytes than that.
"""

from __future__ import annotations

import numbers
import random
from bisect import bisect_left
from dataclasses import dataclass
from typing import Collection, Mapping, Optional, Sequence

from chatlearn_mem.host_memory import gib

__all__ = ["BoundaryMoves", "ResidencyPlan", "plan_residency", "residency_bytes_moved"]

_MAX_WORK = 40_000
"""Search work (one per node plus one per item bounded at it) before the planner settles for the
best plan found: about 40 ms of one core on the largest schedule it is sized for, 64 items x 8
phases (the benchmark's ``planner`` report: ``chatlearn-mem bench --config tiny planner=true``). A quarter goes to the whole branch and bound, which
needs under 100 on the PPO schedule and on random ones up to 6 items x 6 phases."""

_MAX_GAPS = 10
"""An item with more gaps between its needed phases than this gets only the patterns that keep
one cyclic window of consecutive gaps (2**gaps patterns would be too many); the plan then does
not claim optimality."""


@dataclass(frozen=True)
class BoundaryMoves:
    """What moves at the boundary into one phase: out-moves first, then in-moves.

    Attributes:
        phase: Index of the phase entered (the boundary into phase 0 follows the last phase).
        move_out: Items that leave the device, sorted.
        move_in: Items that come onto the device, sorted.
        copy_out: The ``move_out`` items whose device value must be copied to the host first
            (modified since their last copy and not scratch); the others are dropped.
        bytes_out: Bytes copied to the host: the sizes of ``copy_out``.
        bytes_in: Bytes copied to the device: the sizes of ``move_in`` less scratch items
            (rebuilt zeroed, not copied).
    """

    phase: int
    move_out: tuple[str, ...]
    move_in: tuple[str, ...]
    copy_out: tuple[str, ...]
    bytes_out: int
    bytes_in: int


@dataclass(frozen=True)
class ResidencyPlan:
    """The resident set of every phase of a cyclic schedule, and what it costs.

    Attributes:
        resident: The items resident during each phase (a superset of the phase's needs).
        bytes_moved: Bytes copied per iteration in steady state (in-moves plus copied-out moves).
        all_or_nothing_bytes: The same for keeping exactly each phase's needs.
        optimal: True when the search proved no plan under the budget moves fewer bytes.
        boundaries: ``boundaries[i]`` is what moves at the boundary into phase ``i``.
        resident_bytes: Device bytes of each phase's resident set (each <= ``budget_bytes``).
        kept: The items resident in each phase beyond its needs (``resident[i] - phases[i]``).
        budget_bytes: The budget the plan was made for.
        search_nodes: Branch-and-bound nodes explored, over the whole search and the
            neighbourhoods (a measure of the planner's work, at most ``_MAX_WORK``).
    """

    resident: tuple[frozenset[str], ...]
    bytes_moved: int
    all_or_nothing_bytes: int
    optimal: bool
    boundaries: tuple[BoundaryMoves, ...]
    resident_bytes: tuple[int, ...]
    kept: tuple[frozenset[str], ...]
    budget_bytes: int
    search_nodes: int

    def __str__(self) -> str:
        lines = [
            f"residency plan: {gib(self.bytes_moved)} moved per iteration "
            f"(all-or-nothing {gib(self.all_or_nothing_bytes)}, "
            f"{'optimal' if self.optimal else 'best found'}), budget {gib(self.budget_bytes)}"
        ]
        for b, nbytes, kept in zip(self.boundaries, self.resident_bytes, self.kept):
            lines.append(
                f"  into phase {b.phase}: out {list(b.move_out)} (copied {list(b.copy_out)}, "
                f"{gib(b.bytes_out)}), in {list(b.move_in)} ({gib(b.bytes_in)}); "
                f"resident {gib(nbytes)}, kept beyond need {sorted(kept)}"
            )
        return "\n".join(lines)


def plan_residency(
    sizes: Mapping[str, int],
    phases: Sequence[Collection[str]],
    budget_bytes: int,
    *,
    written: Optional[Sequence[Collection[str]]] = None,
    scratch: Collection[str] = (),
) -> ResidencyPlan:
    """Choose each phase's resident set to copy the fewest bytes per iteration under a budget.

    Args:
        sizes: Item name -> device bytes when resident (an item is one part of one model,
            e.g. ``"policy/optimizer_states"``), each >= 0.
        phases: The cyclic schedule: ``phases[i]`` are the items that must be resident during
            phase ``i``. Phase 0 follows the last phase.
        budget_bytes: Device bytes the resident items of any one phase may hold, >= 0.
        written: Parallel to ``phases``: ``written[i]`` are the items modified during phase ``i``
            (a subset of ``phases[i]``). Default: none is modified, so every out-move is a drop.
        scratch: Items never copied (dropped and rebuilt, e.g. gradients): their moves cost 0.

    Returns:
        The plan: resident sets, the moves at each boundary, and the bytes they copy.

    Raises:
        ValueError: A phase needs more than ``budget_bytes`` on its own; an item is not in
            ``sizes``; a size or the budget is negative; ``written`` has another length than
            ``phases`` or names an item its phase does not need; the schedule is empty.
        TypeError: A size or the budget is not an integer, or a phase is given as one string.
    """
    return _plan(sizes, phases, budget_bytes, written=written, scratch=scratch, max_work=_MAX_WORK)


def residency_bytes_moved(
    sizes: Mapping[str, int],
    resident: Sequence[Collection[str]],
    *,
    written: Optional[Sequence[Collection[str]]] = None,
    scratch: Collection[str] = (),
) -> int:
    """Steady-state bytes copied per iteration by a given resident schedule (the cost model above).

    Args:
        sizes: Item name -> device bytes when resident.
        resident: ``resident[i]`` are the items on the device during phase ``i``; cyclic.
        written: Parallel to ``resident``: the items modified during each phase (each a subset of
            that phase's resident set). Default: none.
        scratch: Items never copied: their moves cost 0.

    Returns:
        Bytes copied to the device plus bytes copied to the host, per iteration.

    Raises:
        ValueError: An unknown item, a negative size, an empty schedule, or ``written`` not
            parallel to ``resident`` or naming an item not resident in its phase.
    """
    sizes_, resident_, written_, scratch_ = _check_schedule(sizes, resident, written, scratch, "resident")
    return sum(b.bytes_in + b.bytes_out for b in _boundaries(sizes_, resident_, written_, scratch_))


# --- validation -------------------------------------------------------------------------------


def _check_int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an integer number of bytes, got {value!r} ({type(value).__name__})")
    if value < 0:
        raise ValueError(f"{what} must be >= 0 bytes, got {value}")
    return int(value)


def _check_sets(sets, name: str, known: Mapping[str, int]) -> list[frozenset[str]]:
    if isinstance(sets, (str, bytes)) or not isinstance(sets, Sequence):
        raise TypeError(f"{name} must be a sequence of collections of item names, got {sets!r}")
    return [_check_items(items, f"{name}[{i}]", known) for i, items in enumerate(sets)]


def _check_items(items, where: str, known: Mapping[str, int]) -> frozenset[str]:
    if isinstance(items, str):
        raise TypeError(f"{where} is the string {items!r}; give a collection of item names, e.g. {{{items!r}}}")
    items = frozenset(items)
    unknown = sorted(map(str, items - known.keys()))
    if unknown:
        raise ValueError(
            f"{where} names {unknown[0]!r}, which is not in sizes "
            f"(sizes has {len(known)} items: {_first(sorted(known))}); add its size or fix the name"
        )
    return items


def _first(names: list[str], n: int = 5) -> str:
    return ", ".join(map(repr, names[:n])) + (", ..." if len(names) > n else "")


def _check_schedule(sizes, sets, written, scratch, name: str):
    """Validate and normalize the inputs common to the planner and the cost function."""
    if not isinstance(sizes, Mapping):
        raise TypeError(f"sizes must be a mapping item name -> bytes, got {type(sizes).__name__}")
    sizes_ = {}
    for item, nbytes in sizes.items():
        if not isinstance(item, str):
            raise TypeError(f"item names must be strings, got {item!r} ({type(item).__name__}) in sizes")
        sizes_[item] = _check_int(nbytes, f"sizes[{item!r}]")
    sets_ = _check_sets(sets, name, sizes_)
    if not sets_:
        raise ValueError(f"{name} is empty; give at least one phase")
    if written is None:
        written_ = [frozenset()] * len(sets_)
    else:
        written_ = _check_sets(written, "written", sizes_)
        if len(written_) != len(sets_):
            raise ValueError(
                f"written has {len(written_)} entries but {name} has {len(sets_)}; "
                f"written[i] must list the items modified in phase i (empty for none)"
            )
        for i, (w, s) in enumerate(zip(written_, sets_)):
            if not w <= s:
                raise ValueError(
                    f"written[{i}] names {sorted(w - s)[0]!r}, which {name}[{i}] lacks; "
                    f"an item modified in a phase must be resident in it"
                )
    scratch_ = _check_items(scratch, "scratch", sizes_)
    return sizes_, sets_, written_, scratch_


# --- cost model -------------------------------------------------------------------------------


def _boundaries(sizes, resident, written, scratch) -> tuple[BoundaryMoves, ...]:
    n = len(resident)
    out = []
    for i in range(n):
        prev, cur = resident[i - 1], resident[i]
        move_out, move_in = sorted(prev - cur), sorted(cur - prev)
        copy_out = [x for x in move_out if x not in scratch and _dirty(x, i - 1, resident, written)]
        out.append(
            BoundaryMoves(
                phase=i,
                move_out=tuple(move_out),
                move_in=tuple(move_in),
                copy_out=tuple(copy_out),
                bytes_out=sum(sizes[x] for x in copy_out),
                bytes_in=sum(sizes[x] for x in move_in if x not in scratch),
            )
        )
    return tuple(out)


def _dirty(item: str, last: int, resident, written) -> bool:
    """Whether ``item`` is written in the run of phases that ends with phase ``last``."""
    n = len(resident)
    j = last % n
    for _ in range(n):  # the run ends, so it is shorter than the cycle
        if item not in resident[j]:
            return False
        if item in written[j]:
            return True
        j = (j - 1) % n
    raise AssertionError(f"{item!r} is resident in every phase but moves out")


def _runs(mask: int, n: int) -> list[int]:
    """Maximal cyclic runs of set bits in an ``n``-bit mask that is neither empty nor full."""
    start = next(p for p in range(n) if not mask >> p & 1)
    runs, run = [], 0
    for k in range(1, n + 1):
        p = (start + k) % n
        if mask >> p & 1:
            run |= 1 << p
        elif run:
            runs.append(run)
            run = 0
    return runs


def _pattern_cost(size: int, mask: int, wmask: int, n: int) -> int:
    """Steady-state bytes of one non-scratch item resident in the phases of ``mask``."""
    if mask == 0 or mask == (1 << n) - 1:
        return 0
    return sum(size + (size if run & wmask else 0) for run in _runs(mask, n))


# --- the search -------------------------------------------------------------------------------


@dataclass
class _Item:
    name: str
    size: int
    options: list[tuple[int, int, tuple[int, ...]]]  # (saving, extra mask, extra phases), best first


def _options(size: int, need: int, wmask: int, n: int, slack: list[int]) -> tuple[list, bool]:
    """Undominated patterns beyond ``need`` that save bytes and fit alone; and whether all were tried."""
    gaps = _runs(((1 << n) - 1) & ~need, n)
    base = _pattern_cost(size, need, wmask, n)
    m = len(gaps)
    if m <= _MAX_GAPS:
        subsets = range(1, 1 << m)
    else:  # one cyclic window of consecutive gaps
        subsets = sorted(
            {sum(1 << ((s + k) % m) for k in range(length)) for s in range(m) for length in range(1, m + 1)}
        )
    found = []
    for sub in subsets:
        extra = 0
        for g in range(m):
            if sub >> g & 1:
                extra |= gaps[g]
        phases = tuple(p for p in range(n) if extra >> p & 1)
        if any(slack[p] < size for p in phases):
            continue
        saving = base - _pattern_cost(size, need | extra, wmask, n)
        if saving > 0:
            found.append((saving, extra, phases))
    found.sort(key=lambda o: (len(o[2]), -o[0], o[1]))
    kept = []
    for o in found:
        if not any(k[1] & ~o[1] == 0 and k[0] >= o[0] for k in kept):
            kept.append(o)
    kept.sort(key=lambda o: (-o[0], len(o[2]), o[1]))
    return kept, m <= _MAX_GAPS


def _plan(sizes, phases, budget_bytes, *, written, scratch, max_work: int) -> ResidencyPlan:
    sizes_, phases_, written_, scratch_ = _check_schedule(sizes, phases, written, scratch, "phases")
    budget = _check_int(budget_bytes, "budget_bytes")
    n = len(phases_)
    need_bytes = [sum(sizes_[x] for x in ph) for ph in phases_]
    for i, nbytes in enumerate(need_bytes):
        if nbytes > budget:
            raise ValueError(
                f"phase {i} needs {gib(nbytes)} ({nbytes} B) but budget_bytes is {gib(budget)} ({budget} B): "
                f"every item of phases[{i}] must be resident at once, so the budget must be at least the "
                f"largest phase, {max(need_bytes)} B; raise budget_bytes or split the phase"
            )
    slack = [budget - b for b in need_bytes]

    items, complete = [], True
    for name in sorted(sizes_):
        need = sum(1 << i for i, ph in enumerate(phases_) if name in ph)
        size = sizes_[name]
        if name in scratch_ or size == 0 or need in (0, (1 << n) - 1):
            continue  # moving it is free or it never moves: keeping exactly its phases is optimal
        wmask = sum(1 << i for i, w in enumerate(written_) if name in w)
        opts, tried_all = _options(size, need, wmask, n, slack)
        complete &= tried_all
        if opts:
            items.append(_Item(name, size, opts))

    choice, saving = _greedy(items, slack)
    choice, saving, nodes, finished, work = _branch_and_bound(items, slack, choice, saving, max_work // 4)
    if not finished:
        choice, saving, more = _neighbourhoods(items, slack, choice, max_work - work)
        nodes += more

    extra_by_name = {it.name: it.options[c][1] for it, c in zip(items, choice) if c is not None}
    resident = tuple(
        frozenset(ph | {x for x, e in extra_by_name.items() if e >> i & 1}) for i, ph in enumerate(phases_)
    )
    boundaries = _boundaries(sizes_, resident, written_, scratch_)
    moved = sum(b.bytes_in + b.bytes_out for b in boundaries)
    aon = sum(b.bytes_in + b.bytes_out for b in _boundaries(sizes_, phases_, written_, scratch_))
    assert moved == aon - saving, (moved, aon, saving)  # the search's costs agree with the cost model
    resident_bytes = tuple(sum(sizes_[x] for x in r) for r in resident)
    assert all(b <= budget for b in resident_bytes)
    return ResidencyPlan(
        resident=resident,
        bytes_moved=moved,
        all_or_nothing_bytes=aon,
        optimal=finished and complete,
        boundaries=boundaries,
        resident_bytes=resident_bytes,
        kept=tuple(r - ph for r, ph in zip(resident, phases_)),
        budget_bytes=budget,
        search_nodes=nodes,
    )


def _fits(it: _Item, c: Optional[int], cur: Optional[int], slack: list[int]) -> bool:
    """Whether switching ``it`` from option ``cur`` to option ``c`` fits in ``slack``."""
    if c is None:
        return True
    held = it.options[cur][1] if cur is not None else 0
    return all(slack[p] + (it.size if held >> p & 1 else 0) >= it.size for p in it.options[c][2])


def _switch(it: _Item, c: Optional[int], cur: Optional[int], slack: list[int]) -> None:
    """Move ``it`` from option ``cur`` to option ``c`` (None: keep exactly its needs) in ``slack``."""
    if cur is not None:
        for p in it.options[cur][2]:
            slack[p] += it.size
    if c is not None:
        for p in it.options[c][2]:
            slack[p] -= it.size


def _saving(items: list[_Item], choice: list) -> int:
    return sum(it.options[c][0] for it, c in zip(items, choice) if c is not None)


def _greedy(items: list[_Item], slack: list[int]) -> tuple[list, int]:
    """Greedy passes, each improved item by item; the best of them.

    Each pass takes the options in order of bytes saved per weighted byte-phase held, each when it
    saves more than the item's current option and fits. The weights: every phase 1 (byte-phases),
    then the prices of crowded phases from a few subgradient steps of the Lagrangian relaxation
    (an option held through a phase many others want ranks lower); and a pass by bytes saved alone.
    """
    cands = [(k, c) for k, it in enumerate(items) for c in range(len(it.options))]
    n = len(slack)
    keys = [lambda kc: (-items[kc[0]].options[kc[1]][0], items[kc[0]].name, kc[1])]
    for w in [[1.0] * n, *_prices(items, slack)]:

        def key(kc, w=w):
            it = items[kc[0]]
            saving, _, phases = it.options[kc[1]]
            return (-saving / (it.size * sum(w[p] for p in phases)), -saving, it.name, kc[1])

        keys.append(key)
    best = None
    for key in keys:
        room, choice = list(slack), [None] * len(items)
        for k, c in sorted(cands, key=key):
            it, cur = items[k], choice[k]
            if (cur is None or it.options[c][0] > it.options[cur][0]) and _fits(it, c, cur, room):
                _switch(it, c, cur, room)
                choice[k] = c
        _improve(items, choice, room)
        total = _saving(items, choice)
        if best is None or total > best[1]:
            best = (choice, total, room)
    choice, _, room = best
    _exchange(items, choice, room)
    return choice, _saving(items, choice)


def _prices(items: list[_Item], slack: list[int], steps: int = 12) -> list[list[float]]:
    """Phase prices (saved bytes per byte held) from subgradient steps on the Lagrangian relaxation.

    Relaxing the per-phase budgets with prices ``lam``, each item takes the option that maximizes
    its saving less ``size * sum(lam)`` over the phases it adds; a phase asked for more than its room
    gets dearer. Returns the distinct positive price vectors seen, each floored at a small epsilon.
    """
    n = len(slack)
    lam = [0.0] * n
    total = sum(it.options[0][0] for it in items) or 1
    out = []
    for t in range(steps):
        usage = [0] * n
        for it in items:
            best, best_ph = 0.0, ()
            for saving, _, phases in it.options:
                v = saving - it.size * sum(lam[p] for p in phases)
                if v > best:
                    best, best_ph = v, phases
            for p in best_ph:
                usage[p] += it.size
        g = [(usage[p] - slack[p]) / total for p in range(n)]  # normalized by the bytes at stake
        if all(x <= 0 for x in g) and t:
            break
        lam = [max(0.0, lam[p] + g[p] / (t + 1)) for p in range(n)]
        if any(lam):
            out.append([x + 1e-3 for x in lam])
    return out[-4:]


def _improve(items: list[_Item], choice: list, room: list[int]) -> None:
    """Move single items to their best option that fits, until none improves."""
    changed = True
    while changed:
        changed = False
        for k, it in enumerate(items):
            cur = choice[k]
            have = it.options[cur][0] if cur is not None else 0
            for c, (s, _, _) in enumerate(it.options):  # best first
                if s <= have:
                    break
                if _fits(it, c, cur, room):
                    _switch(it, c, cur, room)
                    choice[k] = c
                    changed = True
                    break


def _exchange(items: list[_Item], choice: list, room: list[int]) -> None:
    """Pairwise exchange: give an item a better option when another, holding every phase that
    lacks room for it, can step down to an option that frees them for less than is gained; then
    refill item by item. Repeats until no exchange helps."""
    n = len(room)
    changed = True
    while changed:
        changed = False
        holders = [
            {k for k, (it, c) in enumerate(zip(items, choice)) if c is not None and it.options[c][1] >> p & 1}
            for p in range(n)
        ]
        for b, it in enumerate(items):
            cur = choice[b]
            have = it.options[cur][0] if cur is not None else 0
            held = it.options[cur][1] if cur is not None else 0
            for c, (s, extra, phases) in enumerate(it.options):
                if s <= have:
                    break
                blocking = [p for p in phases if room[p] + (it.size if held >> p & 1 else 0) < it.size]
                if not blocking:
                    continue
                block_mask = sum(1 << p for p in blocking)
                for a in sorted(set.intersection(*(holders[p] for p in blocking)) - {b}):
                    other, cur_a = items[a], choice[a]
                    have_a = other.options[cur_a][0]
                    steps = [
                        c2
                        for c2 in range(len(other.options))
                        if other.options[c2][0] < have_a and not other.options[c2][1] & block_mask
                    ]
                    for c2 in [*steps, None]:
                        gain = s - have - (have_a - (other.options[c2][0] if c2 is not None else 0))
                        if gain <= 0 or not _fits(other, c2, cur_a, room):
                            continue
                        _switch(other, c2, cur_a, room)
                        if _fits(it, c, cur, room):
                            _switch(it, c, cur, room)
                            choice[a], choice[b] = c2, c
                            changed = True
                            break
                        _switch(other, cur_a, c2, room)
                    if changed:
                        break
                if changed:
                    break
            if changed:
                break
        if changed:
            _improve(items, choice, room)


class _OutOfWork(Exception):
    pass


def _branch_and_bound(
    items: list[_Item], slack: list[int], choice: list, saving: int, max_work: int
) -> tuple[list, int, int, bool, int]:
    """Depth-first search over one option per item, starting from the incumbent ``choice``.

    Returns the best choice, its saving, the nodes explored, whether the search finished (then
    the choice is optimal) and the work done. The work counted against ``max_work`` is one per
    node plus one per item whose best fitting option the node's bound looks up, so it follows
    the time spent.
    """
    order = sorted(range(len(items)), key=lambda k: (-items[k].options[0][0], items[k].name))
    seq = [items[k] for k in order]
    suffix = [0] * (len(seq) + 1)
    for d in range(len(seq) - 1, -1, -1):
        suffix[d] = suffix[d + 1] + seq[d].options[0][0]
    best = {"saving": saving, "choice": [choice[k] for k in order]}
    room = list(slack)
    phases = range(len(room))
    picked: list = [None] * len(seq)
    counts = {"nodes": 0, "work": 0}

    def tight_masks():
        """A function size -> mask of the phases whose room is below that size."""
        by_room = sorted(phases, key=room.__getitem__)
        rooms = [room[p] for p in by_room]
        prefix = [0]
        for p in by_room:
            prefix.append(prefix[-1] | 1 << p)
        return lambda size: prefix[bisect_left(rooms, size)]

    def spend(work: int) -> None:
        if counts["work"] + work > max_work:
            raise _OutOfWork
        counts["work"] += work

    def dfs(d: int, got: int) -> None:
        spend(1)
        counts["nodes"] += 1
        if got + suffix[d] <= best["saving"]:
            return
        spend(len(seq) - d)
        tight = tight_masks()
        ub, opts = 0, []  # each remaining item's best option that fits alone
        for it in seq[d:]:
            t = tight(it.size)
            c = next((c for c, o in enumerate(it.options) if not o[1] & t), None)
            opts.append(c)
            if c is not None:
                ub += it.options[c][0]
        if got + ub <= best["saving"]:
            return
        trial = list(room)
        for it, c in zip(seq[d:], opts):
            _switch(it, c, None, trial)
        if min(trial) >= 0:  # the bound is reachable: nothing below does better
            best["saving"], best["choice"] = got + ub, picked[:d] + opts
            return
        it, t = seq[d], tight(seq[d].size)
        for c, (s, extra, _) in enumerate(it.options):
            if not extra & t:
                _switch(it, c, None, room)
                picked[d] = c
                dfs(d + 1, got + s)
                _switch(it, None, c, room)
        picked[d] = None
        dfs(d + 1, got)

    finished = True
    if seq:
        try:
            dfs(0, 0)
        except _OutOfWork:
            finished = False
    result = [None] * len(items)
    for d, k in enumerate(order):
        result[k] = best["choice"][d]
    return result, best["saving"], counts["nodes"], finished, counts["work"]


_NEIGHBOURHOOD = 10
"""Items re-optimized together in one step of :func:`_neighbourhoods`."""


def _neighbourhoods(items: list[_Item], slack: list[int], choice: list, max_work: int) -> tuple[list, int, int]:
    """Large-neighbourhood search: re-solve small groups of items exactly, the others held fixed.

    Each step picks a phase and up to ``_NEIGHBOURHOOD`` items with a pattern through it
    (seeded, so the plan is deterministic), frees their room and runs the branch and bound on
    them alone; a better choice is kept, then the others are improved item by item. Stops after
    ``max_work`` (the branch and bound's work units). Returns the choice, its saving and the nodes.
    """
    rng = random.Random(0)
    room = list(slack)
    for it, c in zip(items, choice):
        _switch(it, c, None, room)
    touching = [[k for k, it in enumerate(items) if any(o[1] >> p & 1 for o in it.options)] for p in range(len(room))]
    touching = [ks for ks in touching if ks]
    choice, work, nodes = list(choice), 0, 0
    while touching and work < max_work:
        pool = touching[rng.randrange(len(touching))]
        group = sorted(rng.sample(pool, min(_NEIGHBOURHOOD, len(pool))))
        sub = [items[k] for k in group]
        sub_room = list(room)
        for it, k in zip(sub, group):
            _switch(it, None, choice[k], sub_room)
        before = _saving(sub, [choice[k] for k in group])
        got, got_saving, n, _, w = _branch_and_bound(
            sub, sub_room, [choice[k] for k in group], before, min(2_000, max_work - work)
        )
        work, nodes = work + w, nodes + n
        if got_saving > before:
            for it, k, c in zip(sub, group, got):
                _switch(it, c, choice[k], room)
                choice[k] = c
            _improve(items, choice, room)
    return choice, _saving(items, choice), nodes
