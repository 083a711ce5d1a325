"""An independent oracle for residency plans (tests only): simulate the copies of every pattern of
every item and search all combinations. Small schedules only (about 10 items x 5 phases)."""

import itertools


def simulated_bytes(size, pattern, written_phases, is_scratch, n):
    """Bytes one item copies in the second of two simulated iterations (the steady state)."""
    resident = dirty = False
    moved = 0
    for iteration in range(2):
        for i in range(n):
            cost = 0
            if resident and i not in pattern:
                cost += size if dirty and not is_scratch else 0
                resident = dirty = False
            if not resident and i in pattern:
                cost += 0 if is_scratch else size
                resident = True
            moved += cost if iteration == 1 else 0
            dirty |= i in written_phases
    return moved


def schedule_bytes(sizes, resident, written, scratch):
    n = len(resident)
    return sum(
        simulated_bytes(
            sizes[x],
            {i for i in range(n) if x in resident[i]},
            {i for i in range(n) if x in written[i]},
            x in scratch,
            n,
        )
        for x in sizes
    )


def optimum_bytes(sizes, phases, budget, written, scratch):
    """The fewest bytes of any resident schedule under the budget: every superset of each item's
    phases (less those a subset pattern beats at no more cost), every combination that fits."""
    n = len(phases)
    per_item = []
    for x in sorted(sizes):
        need = {i for i in range(n) if x in phases[i]}
        w = {i for i in range(n) if x in written[i]}
        patterns = [
            (simulated_bytes(sizes[x], need | set(extra), w, x in scratch, n), need | set(extra))
            for r in range(n + 1)
            for extra in itertools.combinations(sorted(set(range(n)) - need), r)
        ]
        patterns = [(c, p) for c, p in patterns if not any(c2 <= c and p2 < p for c2, p2 in patterns)]
        per_item.append((sizes[x], sorted(patterns, key=lambda cp: cp[0])))
    best = [None]
    load = [0] * n

    def search(k, cost):
        if best[0] is not None and cost >= best[0]:
            return
        if k == len(per_item):
            best[0] = cost
            return
        size, patterns = per_item[k]
        for c, p in patterns:
            if all(load[i] + size <= budget for i in p):
                for i in p:
                    load[i] += size
                search(k + 1, cost + c)
                for i in p:
                    load[i] -= size

    search(0, 0)
    return best[0]
