"""Search over labellings: greedy construction, local search, evolutionary search.

Everything here works on an :class:`~shared.topology.objective.Objective` and integer
labels (peer index -> group); :mod:`shared.topology.planner` maps peers and stages to
and from them. Randomness comes from the ``rng`` given and limits from a :class:`Budget`
of wall time and evaluations: with a budget of evaluations (and time to spare) a search
is reproducible; with one of time it is bounded however loaded the machine is.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .cost import shortest_path
from .objective import Objective, Score, State


class Budget:
    """What a search may spend: ``seconds`` of wall time and ``evaluations`` of placements
    (counted by the objectives given), from now. ``spent()`` is the larger fraction used;
    a search phase runs while ``spent() < its share``."""

    def __init__(self, objectives: Sequence[Objective], seconds: float = math.inf, evaluations: float = math.inf):
        if not (seconds > 0 and evaluations > 0):
            raise ValueError(f"a search budget needs seconds > 0 and evaluations > 0, got {seconds} and {evaluations}")
        self.objectives = list(objectives)
        self.seconds, self.evaluations = seconds, evaluations
        self.started = time.perf_counter()
        self.evaluated = sum(o.evaluations for o in self.objectives)

    def spent(self) -> float:
        by_time = (time.perf_counter() - self.started) / self.seconds
        by_evals = (sum(o.evaluations for o in self.objectives) - self.evaluated) / self.evaluations
        return max(by_time, by_evals)

    def over(self, share: float = 1.0) -> bool:
        return self.spent() >= share


# --- construction --------------------------------------------------------------------------


def _capacity(obj: Objective) -> int:
    return obj.n // obj.num_groups if obj.equal_sizes else obj.n


def _interleaved(obj: Objective, rng: random.Random, throughput: Sequence[float] | None) -> list[int]:
    """Peers fastest first, classes interleaved (round robin over classes), so that the
    first ``S`` peers, which seed the groups, are fast and varied."""
    by_class: dict[int, list[int]] = {}
    order = list(range(obj.n))
    rng.shuffle(order)
    if throughput is not None:
        order.sort(key=lambda p: -throughput[p])
    for p in order:
        by_class.setdefault(obj.classes[p], []).append(p)
    queues = sorted(by_class.values(), key=lambda q: -(throughput[q[0]] if throughput is not None else 0))
    out = []
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop(0))
    return out


def spread(obj: Objective, rng: random.Random) -> list[int]:
    """Deal peers round robin over the groups, classes interleaved: every group gets a mix
    (one peer per city when counts allow: DT-FM's "one pipeline per city")."""
    labels = [0] * obj.n
    for i, p in enumerate(sorted(range(obj.n), key=lambda p: (obj.classes[p], rng.random()))):
        labels[p] = i % obj.num_groups
    return labels


def pack(obj: Objective, rng: random.Random) -> list[int]:
    """Fill groups one after another with peers sorted by class: each group as local as
    possible ("one stage per city")."""
    labels = [0] * obj.n
    size = math.ceil(obj.n / obj.num_groups)
    for i, p in enumerate(sorted(range(obj.n), key=lambda p: (obj.classes[p], rng.random()))):
        labels[p] = min(i // size, obj.num_groups - 1)
    return labels


def chain(obj: Objective, rng: random.Random, throughput: Sequence[float] | None = None) -> list[int]:
    """Line the peers up along the cheapest path through their classes (regions), then
    cut the line into consecutive stages of equal capacity (equal sizes if required):
    stages are local and each stage's neighbours are near. Good when traffic dominates."""
    assert obj.distance is not None, "the objective gives peer distances"
    reps = sorted({c: p for p, c in reversed(list(enumerate(obj.classes)))}.items())
    index = np.array([p for _, p in reps], dtype=np.intp)
    _, class_order = shortest_path(obj.distance[np.ix_(index, index)])
    rank = {reps[i][0]: r for r, i in enumerate(class_order)}
    weight = [1.0] * obj.n if obj.equal_sizes or throughput is None else list(throughput)
    line = sorted(range(obj.n), key=lambda p: (rank[obj.classes[p]], -weight[p], rng.random()))
    unassigned = sum(weight)  # weight not in a closed stage yet
    labels = [0] * obj.n
    group, filled = 0, 0.0
    for pos, p in enumerate(line):
        groups_left, peers_left = obj.num_groups - group, obj.n - pos
        target = unassigned / groups_left
        if group < obj.num_groups - 1 and filled > 0 and (filled + weight[p] / 2 > target or peers_left < groups_left):
            unassigned -= filled
            group, filled = group + 1, 0.0
        labels[p] = group
        filled += weight[p]
    return labels


def insertion(obj: Objective, rng: random.Random, throughput: Sequence[float] | None = None) -> list[int]:
    """Greedy: seed each group with one peer, then put every other peer where the cost
    grows least (respecting equal sizes)."""
    order = _interleaved(obj, rng, throughput)
    seeds, rest = order[: obj.num_groups], order[obj.num_groups :]
    labels = [-1] * obj.n
    for g, p in enumerate(seeds):
        labels[p] = g
    placed = list(seeds)
    cap = _capacity(obj)
    for p in rest:
        best: tuple[Score, int] | None = None
        sub_labels = [labels[q] for q in placed] + [0]
        sizes = Counter(labels[q] for q in placed)
        for g in range(obj.num_groups):
            if sizes[g] >= cap:
                continue
            sub_labels[-1] = g
            score = partial_score(obj, placed + [p], sub_labels)
            if best is None or score.better_than(best[0]):
                best = (score, g)
        assert best is not None, "some group has room"
        labels[p] = best[1]
        placed.append(p)
    return labels


def partial_score(obj: Objective, peers: list[int], labels: list[int]) -> Score:
    """Score of a placement of some peers only (groups may be smaller than their final
    size), pipeline in group order unless the objective is order-free."""
    members: list[list[int]] = [[] for _ in range(obj.num_groups)]
    for p, g in zip(peers, labels):
        members[g].append(p)
    keys = [obj.key(m) for m in members]
    values = [obj.group_term(m, k) for m, k in zip(members, keys)]
    ordered = not obj.order_free
    pairs = np.zeros((obj.num_groups, obj.num_groups, 2))
    for a in range(obj.num_groups):
        for b in range(a + 1, obj.num_groups):
            if not ordered or b == a + 1:
                pairs[a, b] = pairs[b, a] = obj.pair_term(members[a], keys[a], members[b], keys[b])
    return obj.combine(values, pairs, ordered)


def random_labels(obj: Objective, rng: random.Random) -> list[int]:
    """A uniformly random placement with every group non-empty (equal sizes if required)."""
    if obj.equal_sizes:
        size = obj.n // obj.num_groups
        labels = [i // size for i in range(obj.n)]
        rng.shuffle(labels)
        return labels
    labels = list(range(obj.num_groups)) + [rng.randrange(obj.num_groups) for _ in range(obj.n - obj.num_groups)]
    rng.shuffle(labels)
    return labels


def kick(obj: Objective, labels: Sequence[int], rng: random.Random, strength: int | None = None) -> list[int]:
    """``labels`` with ``strength`` random swaps (default n/8): a nearby start for a
    population member that shares much of a good placement."""
    out = list(labels)
    for _ in range(strength or max(2, obj.n // 8)):
        a, b = rng.sample(range(obj.n), 2)
        out[a], out[b] = out[b], out[a]
    return out


# --- local search --------------------------------------------------------------------------


def _candidates(
    state: State, rng: random.Random, allow_moves: bool, frozen: frozenset[int], limit: MoveLimit | None = None
) -> list[tuple]:
    """Distinct swaps and moves (one per (group, class) -> (group, class): swapping
    interchangeable peers changes nothing), and block moves: all peers of one cluster
    (region) in a group go to another group, or two such blocks trade places. A block
    move takes the steps that single moves cannot take one at a time (moving one of two
    far-away peers out of a stage does not shorten its slowest link; moving both does).
    With a ``limit``, a (group, class) is represented by a peer that moving costs least:
    one already away from home, else one not counted (a joiner), else one at home.
    Shuffled."""
    obj = state.objective
    reps: dict[tuple[int, int], int] = {}  # (group, class) -> a representative peer
    blocks: dict[tuple[int, int], list[int]] = {}  # (group, cluster) -> its peers
    order = rng.sample(range(obj.n), obj.n)
    if limit is not None:
        order.sort(key=lambda p: limit.price(state.labels, p))
    for p in order:
        if p not in frozen:
            reps.setdefault((state.labels[p], obj.classes[p]), p)
            blocks.setdefault((state.labels[p], obj.clusters[p]), []).append(p)
    items = list(reps.items())
    out: list[tuple] = []
    for ((ga, ca), pa), ((gb, cb), pb) in itertools.combinations(items, 2):
        if ga != gb and ca != cb:
            out.append(("swap", pa, pb))
    sizes = [len(m) for m in state.members]
    if allow_moves and not obj.equal_sizes:
        for (ga, _), pa in items:
            if sizes[ga] > 1:
                out.extend(("move", pa, g) for g in range(obj.num_groups) if g != ga)
        for (ga, _), peers in blocks.items():
            if 1 < len(peers) < sizes[ga]:
                out.extend(("block", tuple(peers), g) for g in range(obj.num_groups) if g != ga)
    block_items = [(k, v) for k, v in blocks.items() if len(v) > 1]
    for ((ga, ra), pa), ((gb, rb), pb) in itertools.combinations(block_items, 2):
        if ga != gb and ra != rb and (len(pa) == len(pb) or not obj.equal_sizes):
            out.append(("trade", tuple(pa), tuple(pb)))
    rng.shuffle(out)
    return out


def _changes(state: State, candidate: tuple) -> list[tuple[int, int]] | None:
    """The relabelling a candidate means in ``state``; None if it no longer changes
    anything or would empty a group."""
    kind, a, b = candidate
    labels = state.labels
    if kind == "swap":
        if labels[a] == labels[b]:
            return None
        return [(a, labels[b]), (b, labels[a])]
    if kind == "move":
        if labels[a] == b or len(state.members[labels[a]]) < 2:
            return None
        return [(a, b)]
    if kind == "block":
        source = {labels[p] for p in a}
        if len(source) != 1 or b in source or len(state.members[labels[a[0]]]) <= len(a):
            return None
        return [(p, b) for p in a]
    ga, gb = {labels[p] for p in a}, {labels[p] for p in b}  # trade
    if len(ga) != 1 or len(gb) != 1 or ga == gb:
        return None
    (ga,), (gb,) = ga, gb
    return [(p, gb) for p in a] + [(p, ga) for p in b]


@dataclass(frozen=True)
class MoveLimit:
    """At most ``max_away`` of the ``counted`` peers may sit outside their ``home`` group
    (a replan's bound on how many servers it moves)."""

    home: Sequence[int]
    counted: frozenset[int]
    max_away: int

    def away(self, labels: Sequence[int]) -> int:
        return sum(1 for p in self.counted if labels[p] != self.home[p])

    def delta(self, labels: Sequence[int], changes: Sequence[tuple[int, int]]) -> int:
        return sum((g != self.home[p]) - (labels[p] != self.home[p]) for p, g in changes if p in self.counted)

    def price(self, labels: Sequence[int], p: int) -> int:
        """What moving peer ``p`` may cost at most: 0 if it is away from home (moving it
        again costs nothing), 1 if it is not counted, 2 if it is at home."""
        if p not in self.counted:
            return 1
        return 2 if labels[p] == self.home[p] else 0

    def fewest_moves(self, obj: Objective, labels: Sequence[int]) -> list[int]:
        """``labels`` with interchangeable peers (same class) traded so that as many
        counted peers as possible sit at home: the same cost (it depends only on how many
        peers of each class each group holds), the fewest peers away."""
        by_class: dict[int, list[int]] = {}
        for p in range(obj.n):
            by_class.setdefault(obj.classes[p], []).append(p)
        out = list(labels)
        for peers in by_class.values():
            if len(peers) < 2:
                continue
            slots = Counter(labels[p] for p in peers)
            rest = []
            for p in peers:
                if p in self.counted and slots[self.home[p]] > 0:
                    out[p] = self.home[p]
                    slots[self.home[p]] -= 1
                else:
                    rest.append(p)
            unplaced = []
            for p in rest:  # the others keep their group where it still has room
                if slots[labels[p]] > 0:
                    out[p] = labels[p]
                    slots[labels[p]] -= 1
                else:
                    unplaced.append(p)
            free = [g for g, count in slots.items() for _ in range(count)]
            for p, g in zip(unplaced, free):
                out[p] = g
        return out

    def kick(self, obj: Objective, labels: Sequence[int], rng: random.Random, strength: int) -> list[int] | None:
        """``strength`` random swaps of peers of different groups and classes that keep at
        most ``max_away`` counted peers away from home (:func:`kick` within the limit);
        None if no such swap was found."""
        labels = self.fewest_moves(obj, labels)
        away = self.away(labels)
        cheap = [p for p in range(obj.n) if self.price(labels, p) < 2]  # peers whose swaps cost no more away
        done = 0
        for _ in range(20 * strength):
            if done >= strength:
                break
            pool = range(obj.n) if away < self.max_away else cheap
            if len(pool) < 2:
                break
            a, b = rng.sample(pool, 2)
            if labels[a] == labels[b] or obj.classes[a] == obj.classes[b]:
                continue
            changes = [(a, labels[b]), (b, labels[a])]
            step = self.delta(labels, changes)
            if away + step > self.max_away:
                continue
            for p, g in changes:
                labels[p] = g
            away += step
            done += 1
        return labels if done else None


def local_search(
    state: State,
    rng: random.Random,
    *,
    budget: Budget | None = None,
    until: float = 1.0,
    max_evals: int | None = None,
    allow_moves: bool = True,
    frozen: frozenset[int] = frozenset(),
    limit: MoveLimit | None = None,
) -> State:
    """First-improvement descent over swaps, moves (when sizes are free) and block moves
    until no candidate improves the score, the ``budget`` is spent up to ``until`` or
    ``max_evals`` candidates were tried. ``frozen`` peers never change; with a ``limit``,
    no change takes more peers away from home than it allows. An ordered state is
    improved in place; an order-free one is searched in the cheap ordered form,
    renumbered along its cheapest pipeline between descents, and returned as a new
    order-free state (``limit`` needs an ordered state: renumbering moves everyone)."""
    left = [math.inf if max_evals is None else max_evals]

    def stop() -> bool:
        return left[0] <= 0 or (budget is not None and budget.over(until))

    if state.ordered:
        _descend(state, rng, stop, left, allow_moves, frozen, limit)
        return state
    assert limit is None, "a move limit needs stages that keep their numbers (an ordered state)"
    current = state.reorder(ordered=True)
    while True:
        _descend(current, rng, stop, left, allow_moves, frozen, None)
        free = current.reorder(ordered=False)
        if not free.score.better_than(current.score) or stop():
            return free
        current = free.reorder(ordered=True)


def _descend(
    state: State,
    rng: random.Random,
    stop: Callable[[], bool],
    left: list[float],
    allow_moves: bool,
    frozen: frozenset[int],
    limit: MoveLimit | None,
) -> None:
    """Passes over the candidates until one pass improves nothing. A pass goes on after an
    improvement (its candidates are still valid changes, only drawn from an older state):
    cheaper than drawing and shuffling a fresh list after every improvement."""
    away = limit.away(state.labels) if limit is not None else 0
    improved = True
    while improved:
        improved = False
        for candidate in _candidates(state, rng, allow_moves, frozen, limit):
            if stop():
                return
            changes = _changes(state, candidate)
            if changes is None:
                continue
            step = limit.delta(state.labels, changes) if limit is not None else 0
            if limit is not None and step > 0 and away + step > limit.max_away:
                continue
            left[0] -= 1
            score, evaluated = state.evaluate(changes, state.score)
            if score.better_than(state.score):
                state.apply(evaluated)
                away += step
                improved = True


# --- evolutionary search ---------------------------------------------------------------------


def align(reference: Sequence[int], other: Sequence[int], num_groups: int) -> list[int]:
    """``other`` relabelled so its groups match ``reference``'s by largest overlap (labels
    are arbitrary names: two equal placements may name their groups differently)."""
    overlap = Counter(zip(reference, other))
    mapping: dict[int, int] = {}
    used: set[int] = set()
    for (ref, oth), _ in sorted(overlap.items(), key=lambda kv: -kv[1]):
        if oth not in mapping and ref not in used:
            mapping[oth] = ref
            used.add(ref)
    free = iter(g for g in range(num_groups) if g not in used)
    for g in range(num_groups):
        if g not in mapping:
            mapping[g] = next(free)
    return [mapping[g] for g in other]


def crossover(obj: Objective, p1: Sequence[int], p2: Sequence[int], rng: random.Random) -> list[int]:
    """Uniform crossover of group labels (``p2`` aligned to ``p1``): peers on which the
    parents agree keep their group; the others take either parent's, then :func:`repair`."""
    p2 = align(p1, p2, obj.num_groups)
    child = [a if a == b or rng.random() < 0.5 else b for a, b in zip(p1, p2)]
    return repair(obj, child, rng, prefer=[a == b for a, b in zip(p1, p2)])


def repair(obj: Objective, labels: list[int], rng: random.Random, prefer: Sequence[bool] | None = None) -> list[int]:
    """Make a labelling feasible: equal sizes (overfull groups give up peers on which the
    parents disagreed first, to the emptiest groups), or no empty group."""
    members: list[list[int]] = [[] for _ in range(obj.num_groups)]
    for p, g in enumerate(labels):
        members[g].append(p)
    if obj.equal_sizes:
        size = obj.n // obj.num_groups
        pool: list[int] = []
        for m in members:
            rng.shuffle(m)
            if prefer is not None:
                m.sort(key=lambda p: prefer[p])  # disagreeing peers first
            while len(m) > size:
                pool.append(m.pop(0))
        rng.shuffle(pool)
        for g, m in enumerate(members):
            while len(m) < size:
                p = pool.pop()
                m.append(p)
                labels[p] = g
        return labels
    for g, m in enumerate(members):
        if not m:
            donor = max(range(obj.num_groups), key=lambda d: len(members[d]))
            p = members[donor].pop(rng.randrange(len(members[donor])))
            m.append(p)
            labels[p] = g
    return labels


def evolve(
    obj: Objective,
    rng: random.Random,
    seeds: Sequence[Sequence[int]],
    *,
    budget: Budget,
    population_size: int = 12,
    offspring_evals: int = 400,
    polish_share: float = 0.2,
    random_fill: bool = True,
) -> State:
    """Evolutionary search: a population of locally optimal placements (the ``seeds``, best
    first, then random ones and kicked copies of members); each generation crosses two
    tournament-chosen parents, repairs the child, improves it by local search (at most
    ``offspring_evals`` candidates) and lets it replace the worst member if it is better
    and not already present. The last ``polish_share`` of the budget goes to a full local
    search of the best (offspring stop early, so the best may not be locally optimal yet).
    Without ``random_fill`` the population starts from kicked copies only (a replan stays
    near the current assignment). Returns the best placement found."""
    population: list[State] = []
    seen: set[tuple] = set()

    def admit(state: State) -> None:
        key = state.canonical()
        if key in seen:
            return
        if len(population) < population_size:
            population.append(state)
            seen.add(key)
            return
        worst = max(range(len(population)), key=lambda i: (population[i].score.total, population[i].score.secondary))
        if state.score.better_than(population[worst].score):
            seen.discard(population[worst].canonical())
            population[worst] = state
            seen.add(key)

    breed_until = 1.0 - polish_share
    for state in sorted((State(obj, labels) for labels in seeds), key=lambda s: s.score.total):
        if population and budget.over(0.5 * breed_until):
            break  # the best seeds are in; the rest of the budget is for breeding
        admit(local_search(state, rng, budget=budget, until=breed_until))
    while len(population) < population_size and not budget.over(breed_until):
        if len(population) % 2 or not random_fill:
            labels = kick(obj, rng.choice(population).labels, rng)
        else:
            labels = random_labels(obj, rng)
        admit(local_search(State(obj, labels), rng, budget=budget, until=breed_until, max_evals=offspring_evals))
    while len(population) >= 2 and not budget.over(breed_until):
        a = min(rng.sample(population, 2), key=lambda s: s.score.total)
        b = min(
            rng.sample([s for s in population if s is not a], min(2, len(population) - 1)), key=lambda s: s.score.total
        )
        child = State(obj, crossover(obj, a.labels, b.labels, rng))
        admit(local_search(child, rng, budget=budget, until=breed_until, max_evals=offspring_evals))
    best = min(population, key=lambda s: (s.score.total, s.score.secondary))
    return local_search(best.copy(), rng, budget=budget)
