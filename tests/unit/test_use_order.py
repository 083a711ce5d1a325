"""The order a non-blocking weights onload copies bytes in (``group_transfer._use_order``): the
same ranges as a direct, quadratic formulation, at a cost linear in the number of parameters.
A buffer of n parameters once cost O(n^2) per onload: 12800 of them took 1.7 s a call."""

import bisect
import random

from chatlearn_mem.group_transfer import _cover, _subtract, _use_order


def _reference_use_order(users, sizes):
    """The formulation _use_order had before: every covered range visited, one range per piece."""

    def subtract(r, taken):
        a, b = r
        out = []
        for lo, hi in taken:
            if hi <= a or lo >= b:
                continue
            if lo > a:
                out.append((a, lo))
            a = max(a, hi)
        if a < b:
            out.append((a, b))
        return out

    covered, order = {}, []

    def add(i, a, b, new_user):
        for lo, hi in subtract((a, b), covered.setdefault(i, [])):
            if order and order[-1][0] == i and order[-1][2] == lo:
                order[-1] = (i, order[-1][1], hi, order[-1][3])
            else:
                order.append((i, lo, hi, new_user and bool(order)))
            new_user = False
            bisect.insort(covered[i], (lo, hi))
        return new_user

    for ranges in users:
        new_user = True
        for i, a, b in ranges:
            if a < b:
                new_user = add(i, max(0, a), min(sizes[i], b), new_user)
    new_user = True
    for i, n in enumerate(sizes):
        if n:
            new_user = add(i, 0, n, new_user)
    return order


def test_use_order_matches_the_direct_formulation_on_random_layouts():
    rng = random.Random(0)
    for _ in range(400):
        sizes = tuple(rng.choice([0, rng.randint(1, 300)]) for _ in range(rng.randint(1, 4)))
        users = []
        for _ in range(rng.randint(0, 12)):
            ranges = []
            for _ in range(rng.randint(0, 3)):
                i = rng.randrange(len(sizes))
                a = rng.randint(-5, sizes[i] + 5)
                ranges.append((i, a, a + rng.randint(-3, 80)))  # overlapping, empty, out of bounds
            users.append(tuple(ranges))
        users = tuple(users)
        assert _use_order(users, sizes) == _reference_use_order(users, sizes), (users, sizes)


def test_megatron_layouts_give_one_range_per_parameter_in_forward_order():
    n = 1000  # one buffer, each parameter its own user, laid out in reverse (megatron's DDP) or in order
    for reverse in (True, False):
        users = tuple(((0, (n - 1 - k if reverse else k) * 64, (n - k if reverse else k + 1) * 64),) for k in range(n))
        order = _use_order(users, (n * 64,))
        assert order == _reference_use_order(users, (n * 64,))
        assert [r[1] for r in order] == [u[0][1] for u in users][: len(order)]
        assert len(order) == (n if reverse else 1)  # in order, the ranges continue upwards: one copy


class _Counting(list):
    """A list that counts the elements read from it (bisect reads through __getitem__ too)."""

    reads = 0

    def __getitem__(self, k):
        _Counting.reads += 1
        return list.__getitem__(self, k)

    def __iter__(self):
        for x in list.__iter__(self):
            _Counting.reads += 1
            yield x


def test_subtract_reads_only_the_ranges_near_its_own():
    taken = _Counting((k * 10, k * 10 + 5) for k in range(10_000))  # disjoint, sorted
    _Counting.reads = 0
    assert _subtract((99_983, 100_020), taken) == [(99_985, 99_990), (99_995, 100_020)]
    assert _Counting.reads <= 20  # bisection and the neighbours, not 10 000 ranges
    _Counting.reads = 0
    assert _subtract((0, 7), taken) == [(5, 7)] and _Counting.reads <= 20


def test_cover_merges_what_it_touches():
    taken: list = []
    for k in reversed(range(100)):  # a reversed buffer read parameter by parameter
        _cover(taken, k * 8, k * 8 + 8)
    assert taken == [(0, 800)]
    _cover(taken, 900, 950)
    _cover(taken, 1000, 1010)
    _cover(taken, 950, 1000)  # bridges both neighbours
    assert taken == [(0, 800), (900, 1010)]
