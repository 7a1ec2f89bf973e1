"""Exhaustive search: the optimum placement of a small instance, for tests and benchmarks.

Placements are enumerated up to interchangeable peers: peers of one class (same region
and speed) are counted, not named, so a stage is a vector of class counts and a
placement a multiset of such vectors (or a sequence, when the pipeline order is fixed).
The count still grows like ``S^n / S!``: a few peers more make it unaffordable.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from .objective import Objective, State


def _sub_multisets(counts: Sequence[int], size: int | None, ceiling: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Count vectors ``c <= counts``, lexicographically ``<= ceiling``, with ``sum(c) == size``
    (any sum when None), largest first."""
    suffix = [0] * (len(counts) + 1)
    for i in range(len(counts) - 1, -1, -1):
        suffix[i] = suffix[i + 1] + counts[i]

    def walk(i: int, left: int | None, tight: bool) -> Iterator[tuple[int, ...]]:
        if i == len(counts):
            if not left:
                yield ()
            return
        hi = counts[i] if left is None else min(counts[i], left)
        if tight:
            hi = min(hi, ceiling[i])
        lo = 0 if left is None else max(0, left - suffix[i + 1])
        for take in range(hi, lo - 1, -1):
            for rest in walk(i + 1, None if left is None else left - take, tight and take == ceiling[i]):
                yield (take,) + rest

    return walk(0, size, True)


def _multiset_partitions(
    counts: tuple[int, ...], groups: int, size: int | None, ceiling: tuple
) -> Iterator[list[tuple]]:
    """Unordered partitions of a multiset (class counts) into ``groups`` non-empty parts
    (of ``size`` each if given), each part a count vector; parts in non-increasing
    lexicographic order (each at most ``ceiling``) so each partition comes once."""
    remaining = sum(counts)
    if groups == 1:
        if remaining and (size is None or remaining == size) and counts <= ceiling:
            yield [counts]
        return
    for part in _sub_multisets(counts, size, ceiling):
        total = sum(part)
        if total == 0 or remaining - total < groups - 1:
            continue
        rest = tuple(c - t for c, t in zip(counts, part))
        for tail in _multiset_partitions(rest, groups - 1, size, part):
            yield [part] + tail


def exhaustive(obj: Objective) -> State:
    """The optimum over every placement, up to interchangeable peers (and, when order-free,
    up to group order). For small instances: the count grows like S^n / S!."""
    class_ids = sorted(set(obj.classes))
    peers_of = {c: [p for p in range(obj.n) if obj.classes[p] == c] for c in class_ids}
    counts = tuple(len(peers_of[c]) for c in class_ids)
    size = obj.n // obj.num_groups if obj.equal_sizes else None
    top = tuple(counts)
    best: State | None = None
    for parts in _multiset_partitions(counts, obj.num_groups, size, top):
        orders = [parts] if obj.order_free else set(itertools.permutations(parts))
        for ordered in orders:
            labels = _labels_from_parts(ordered, class_ids, peers_of, obj.n)
            state = State(obj, labels)
            if best is None or state.score.better_than(best.score):
                best = state
    assert best is not None, "some placement exists"
    return best


def _labels_from_parts(
    parts: Sequence[tuple[int, ...]], class_ids: list[int], peers_of: dict[int, list[int]], n: int
) -> list[int]:
    labels = [0] * n
    taken = dict.fromkeys(class_ids, 0)
    for g, part in enumerate(parts):
        for c, take in zip(class_ids, part):
            for p in peers_of[c][taken[c] : taken[c] + take]:
                labels[p] = g
            taken[c] += take
    return labels
