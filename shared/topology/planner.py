"""Topology-aware placement of stage servers: fresh plans, joiners and replans.

Peers and stages in, ``{peer_id: stage}`` out. The cost is either the SWARM step cost
(``model="swarm"``: heterogeneous peers, stages of any size, stochastic wiring) or
DT-FM's (``model="dtfm"``: equal stages, fixed pipelines), see
:mod:`shared.topology.cost`. How the coordinator uses it:

- a server joins: :func:`place_joiners` gives its stage (the cheapest for the swarm as
  it is; nobody else moves);
- periodically, with the throughputs and RTTs from heartbeats in ``peers`` and the
  ``network``'s measurements: :func:`replan` from the current assignment. It returns
  no move unless moving gains at least ``min_gain`` (so measurement noise moves
  nothing), and then only the moves that matter (so churn moves few servers);
- at the start of a run: :func:`plan`, the full search (greedy seeds, local search,
  evolutionary search).

Every search takes a wall-time budget (``time_budget_s``) and, optionally, a budget of
evaluated placements (``max_evaluations``): with the latter, results depend only on the
seed, not on how busy the machine is.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from shared.policy.move import Move

from .cost import Workload
from .network import Network, Peer
from .objective import DTFMObjective, Objective, State, SwarmObjective
from .search import Budget, MoveLimit, chain, evolve, insertion, local_search, pack, spread

MODELS = ("swarm", "dtfm")
INSERTION_MAX_PEERS = 256  # the insertion seed costs peers x stages evaluations of the whole placement
REPLAN_INSERTION_MAX_PEERS = 64  # a replan's fresh plans use it only for small swarms (~0.15 s at 64 peers)
REPLAN_FRESH_RUNS = 3  # independent fresh plans a replan cuts and walks towards


@dataclass(frozen=True)
class Placement:
    """A plan: each peer's stage, its predicted seconds per step, and what it took."""

    assignment: dict[str, int]
    cost_s: float
    evaluations: int
    seconds: float


@dataclass(frozen=True)
class Replan:
    """The assignment after a replan: ``moves`` of servers that already had a stage,
    ``joined`` stages of servers that had none, the cost before (current assignment with
    the joiners placed) and after."""

    assignment: dict[str, int]
    moves: list[Move]
    joined: dict[str, int]
    cost_before_s: float
    cost_after_s: float


def build_objective(
    peers: Sequence[Peer], network: Network, workload: Workload, num_stages: int, *, model: str, order_free: bool
) -> Objective:
    """The objective over ``peers`` (indices in the given order)."""
    if model not in MODELS:
        raise ValueError(f"unknown cost model {model!r}; choose one of {MODELS}")
    rtt, bw = network.matrices(peers)
    classes = network.peer_classes(peers)
    region_ids: dict[str, int] = {}
    clusters = [region_ids.setdefault(p.region, len(region_ids)) for p in peers]
    if model == "dtfm":
        if len(peers) % num_stages:
            raise ValueError(
                f"DT-FM's cost needs equal stages: {len(peers)} peers do not split into num_stages={num_stages}"
            )
        activation = workload.tasklet_activation_gb(len(peers) // num_stages)
        return DTFMObjective(
            rtt, bw, classes, num_stages, activation, workload.gradient_gb, order_free=order_free, clusters=clusters
        )
    throughput = np.array([p.throughput for p in peers], dtype=float)
    return SwarmObjective(rtt, bw, throughput, classes, num_stages, workload, order_free=order_free, clusters=clusters)


def plan(
    peers: Sequence[Peer],
    network: Network,
    workload: Workload,
    num_stages: int,
    *,
    model: str = "swarm",
    time_budget_s: float = 10.0,
    max_evaluations: float = math.inf,
    seed: int = 0,
    population_size: int = 12,
) -> Placement:
    """A fresh placement: greedy seeds (chain, spread, pack, insertion), local search on
    each, then evolutionary search until the budget is spent. Stages are numbered along
    the cheapest pipeline order."""
    started = time.perf_counter()
    rng = random.Random(seed)
    obj = build_objective(peers, network, workload, num_stages, model=model, order_free=True)
    throughput = [p.throughput for p in peers]
    seeds = [chain(obj, rng, throughput), spread(obj, rng), pack(obj, rng)]
    if len(peers) <= INSERTION_MAX_PEERS:
        seeds.append(insertion(obj, rng, throughput))
    budget = Budget([obj], time_budget_s, max_evaluations)
    best = evolve(obj, rng, seeds, budget=budget, population_size=population_size)
    stage_of_group = {g: s for s, g in enumerate(best.score.order)}
    assignment = {p.peer_id: stage_of_group[best.labels[i]] for i, p in enumerate(peers)}
    return Placement(assignment, best.score.total, obj.evaluations, time.perf_counter() - started)


def placement_cost(
    assignment: Mapping[str, int],
    peers: Sequence[Peer],
    network: Network,
    workload: Workload,
    num_stages: int,
    *,
    model: str = "swarm",
) -> float:
    """Seconds per step of ``assignment``: stages in their numbered order (DT-FM's cost
    picks its own order, as the paper defines it)."""
    obj = build_objective(peers, network, workload, num_stages, model=model, order_free=model == "dtfm")
    return State(obj, [assignment[p.peer_id] for p in peers]).score.total


def _initial_labels(
    obj: Objective, current: Mapping[str, int], peers: Sequence[Peer], rng: random.Random, budget: Budget
) -> tuple[list[int], list[int]]:
    """Current stages of the peers that have one; joiners placed where the cost is lowest
    while nobody else moves. Returns (labels, indices of the servers that had a stage).

    Joiners first go to a stage that has nobody, else to the stage with the least
    capacity (for equal stages: a free slot; servers beyond a stage's share, after
    departures elsewhere, count as joiners); then local search moves only joiners.
    """
    labels = [-1] * obj.n
    kept = []
    for i, p in enumerate(peers):
        stage = current.get(p.peer_id)
        if stage is not None and 0 <= stage < obj.num_groups:
            labels[i] = stage
            kept.append(i)
    cap = obj.n // obj.num_groups if obj.equal_sizes else obj.n
    if obj.equal_sizes:
        for g in range(obj.num_groups):
            for i in [i for i in kept if labels[i] == g][cap:]:
                labels[i] = -1
        kept = [i for i in kept if labels[i] >= 0]
    joiners = [i for i in range(obj.n) if labels[i] < 0]
    if not joiners:
        return labels, kept
    throughput = [p.throughput for p in peers]
    capacity = [0.0] * obj.num_groups
    sizes = [0] * obj.num_groups
    for i in kept:
        capacity[labels[i]] += throughput[i]
        sizes[labels[i]] += 1
    for i in sorted(joiners, key=lambda i: -throughput[i]):
        g = min((g for g in range(obj.num_groups) if sizes[g] < cap), key=lambda g: (sizes[g] > 0, capacity[g], g))
        labels[i] = g
        capacity[g] += throughput[i]
        sizes[g] += 1
    state = local_search(State(obj, labels), rng, budget=budget, frozen=frozenset(kept))
    return state.labels, kept


def place_joiners(
    current: Mapping[str, int],
    peers: Sequence[Peer],
    network: Network,
    workload: Workload,
    num_stages: int,
    *,
    model: str = "swarm",
    time_budget_s: float = 1.0,
    max_evaluations: float = math.inf,
    seed: int = 0,
) -> dict[str, int]:
    """Stages for the ``peers`` not in ``current``: an empty stage first, else where the
    cost is lowest (local search that moves joiners only, within the budget); nobody
    else moves."""
    obj = build_objective(peers, network, workload, num_stages, model=model, order_free=False)
    budget = Budget([obj], time_budget_s, max_evaluations)
    labels, _ = _initial_labels(obj, current, peers, random.Random(seed), budget)
    return {p.peer_id: labels[i] for i, p in enumerate(peers) if p.peer_id not in current}


def replan(
    current: Mapping[str, int],
    peers: Sequence[Peer],
    network: Network,
    workload: Workload,
    num_stages: int,
    *,
    model: str = "swarm",
    min_gain: float = 0.05,
    tolerance: float = 0.02,
    move_cost: float = 0.005,
    max_moves: int | None = None,
    time_budget_s: float = 2.0,
    max_evaluations: float = math.inf,
    seed: int = 0,
) -> Replan:
    """Replan from ``current`` (``{peer_id: stage}``; ids absent from ``peers`` are gone).

    Joiners (peers absent from ``current``) are placed first (:func:`place_joiners`) and
    then wherever the cost is lowest (they move for free): the cheapest placement that
    moves no server is the baseline (``cost_before_s``). Stages keep their numbers and no
    search takes more than ``max_moves`` servers away from their stage (interchangeable
    servers are traded so that the fewest count as moved): iterated local search from the
    baseline; short fresh plans; towards each, walks one best move at a time from the
    baseline and from the search's result, and a cut (the fresh plan with servers sent
    home, the least useful first, until ``max_moves`` are away); iterated local search
    from the cheapest walk state and from the cheapest cut. Of the cheapest placement,
    moves are undone, the least useful first, while a move earns less than ``move_cost``
    (a fraction of the cost: what a state download is worth) or the cost stays within
    ``tolerance`` of it and no worse than the cheapest fresh plan, but never across the
    ``min_gain`` line; a local search that moves no more servers improves the rest.
    Servers move only if the result is at least ``min_gain`` cheaper than the baseline (a
    gain within the measurement noise is not worth it) and, without ``max_moves``, still
    is once the undoing goes on to ``tolerance`` of the best (a reshuffle that only noise
    favours spreads its gain over many moves, each earning little; ``max_moves`` bounds
    what noise can buy). Budget shares: 5% joiners, 5% the baseline, 20% the first
    search, 25% fresh plans, up to 3% per walk and cut, the rest (to 95%) the last
    searches; undoing moves may go past the budget. When the first local search does not
    reach a local optimum within its share, it gets the whole budget instead.
    """
    rng = random.Random(seed)
    obj = build_objective(peers, network, workload, num_stages, model=model, order_free=False)
    fresh_obj = build_objective(peers, network, workload, num_stages, model=model, order_free=True)
    budget = Budget([obj, fresh_obj], time_budget_s, max_evaluations)
    labels0, kept = _initial_labels(obj, current, peers, rng, _Share(budget, 0.05))
    limit = MoveLimit(labels0, frozenset(kept), len(kept) if max_moves is None else max_moves)
    start = State(obj, labels0)
    if len(kept) < obj.n:  # joiners move for free: the best placement that moves no server is the baseline
        start = _iterated_local_search(start, rng, _Share(budget, 0.1), dataclasses.replace(limit, max_away=0))
    best, fresh_cost = _search_within(start, fresh_obj, peers, limit, rng, budget)
    # Keep the moves that matter: undo those earning less than move_cost, and others while the cost stays
    # within tolerance of the best, no worse than the cheapest fresh plan and min_gain below the baseline.
    # Without max_moves nothing bounds how many servers a reshuffle that only noise favours moves: its gain,
    # spread over many moves, must survive undoing them on to tolerance of the best.
    tolerated, worth = best.score.total * (1 + tolerance), start.score.total / (1 + min_gain)
    bounds = [(max(best.score.total, min(tolerated, fresh_cost)), worth)] + (
        [(tolerated, math.inf)] if max_moves is None else []
    )
    final, *check = _prune(best, limit, bounds, budget, move_cost * start.score.total)
    final = local_search(final, rng, budget=budget, limit=dataclasses.replace(limit, max_away=limit.away(final.labels)))
    final = State(obj, limit.fewest_moves(obj, final.labels))
    if not start.score.total > max([final.score.total] + [c.score.total for c in check]) * (1 + min_gain):
        final = start
    assignment = {p.peer_id: final.labels[i] for i, p in enumerate(peers)}
    moves = [
        Move(peers[i].peer_id, current[peers[i].peer_id], final.labels[i])
        for i in kept
        if final.labels[i] != current[peers[i].peer_id]
    ]
    joined = {p.peer_id: final.labels[i] for i, p in enumerate(peers) if p.peer_id not in current}
    return Replan(assignment, moves, joined, start.score.total, final.score.total)


def _search_within(
    start: State, fresh_obj: Objective, peers: Sequence[Peer], limit: MoveLimit, rng: random.Random, budget: Budget
) -> tuple[State, float]:
    """The cheapest placement found with at most ``limit.max_away`` servers away from
    home, and the cost of the cheapest fresh plan (inf if none was made): iterated local
    search from ``start``; fresh plans; towards each, walks from ``start`` and from the
    search's result, and a cut; iterated local search from the cheapest walk state and
    from the cheapest cut. When the first local search does not reach a local optimum
    within its share (up to 30% of the budget), it goes on alone to 95%."""
    share = _Share(budget, 0.3)
    near = local_search(start.copy(), rng, budget=share, limit=limit)
    if share.over():
        return _iterated_local_search(near, rng, _Share(budget, 0.95), limit, descended=True), math.inf
    near = _iterated_local_search(near, rng, share, limit, descended=True)
    fresh = _fresh_plans(fresh_obj, peers, rng, _Share(budget, 0.55))
    walked, cut = [near], []
    for target in fresh:  # each walk and cut may take 3% of the budget
        walked += [_relink(origin, target, limit, _Share(budget, budget.spent() + 0.03)) for origin in (start, near)]
        cut += [c for c in [_cut(start, target, limit, _Share(budget, budget.spent() + 0.03))] if c is not None]
    origins = [min(walked, key=_by_cost)] + ([min(cut, key=_by_cost)] if cut else [])
    begin = budget.spent()
    best = min(
        (
            _iterated_local_search(origin, rng, _Share(budget, begin + (0.95 - begin) * (k + 1) / len(origins)), limit)
            for k, origin in enumerate(origins)
        ),
        key=_by_cost,
    )
    return best, fresh[0].score.total


def _by_cost(state: State) -> tuple[float, float]:
    return state.score.total, state.score.secondary


def _fresh_plans(obj: Objective, peers: Sequence[Peer], rng: random.Random, budget: Budget) -> list[State]:
    """Placements from scratch (order-free ``obj``): the best of each of
    ``REPLAN_FRESH_RUNS`` evolutionary searches from the greedy seeds, cheapest first.
    Independent short runs differ more than one long run improves (its population
    settles early)."""
    throughput = [p.throughput for p in peers]
    seeds = [chain(obj, rng, throughput), spread(obj, rng), pack(obj, rng)]
    if len(peers) <= REPLAN_INSERTION_MAX_PEERS:
        seeds.append(insertion(obj, rng, throughput))
    plans = []
    for k in range(REPLAN_FRESH_RUNS):
        share = _Share(budget, (k + 1) / REPLAN_FRESH_RUNS)
        plans.append(evolve(obj, random.Random(rng.getrandbits(32)), seeds, budget=share, population_size=8))
    return sorted(plans, key=lambda s: (s.score.total, s.score.secondary))


class _Share(Budget):
    """The part of a budget up to ``until`` of it, as a budget of its own (for phases)."""

    def __init__(self, whole: Budget, until: float):
        self.whole, self.until = whole, until
        self.begin = whole.spent()

    def spent(self) -> float:
        span = self.until - self.begin
        return 1.0 if span <= 0 else (self.whole.spent() - self.begin) / span


def _iterated_local_search(
    start: State, rng: random.Random, budget: Budget, limit: MoveLimit, descended: bool = False
) -> State:
    """Local search from ``start`` within the ``limit``, then kicks (a few random swaps
    within it) of the best and local search again while the budget lasts, keeping the
    best: a local search alone stops at the first local optimum near the current
    assignment."""
    best = start if descended else local_search(start.copy(), rng, budget=budget, limit=limit)
    while not budget.over():
        labels = limit.kick(best.objective, best.labels, rng, strength=3)
        if labels is None:
            break  # nothing can change within the limit
        trial = local_search(State(best.objective, labels), rng, budget=budget, limit=limit)
        if trial.score.better_than(best.score):
            best = trial
    return best


def _aligned_target(near: State, fresh: State, limit: MoveLimit) -> list[int]:
    """``fresh`` (numbered along its own pipeline) as stage labels of ``near``'s objective:
    its pipeline order or the reverse, whichever needs fewer moves from home, with
    interchangeable peers traded to need the fewest."""
    order = list(fresh.score.order)
    best = None
    for path in (order, order[::-1]):
        stage_of = {g: s for s, g in enumerate(path)}
        labels = limit.fewest_moves(near.objective, [stage_of[g] for g in fresh.labels])
        # peers equally placed in near and the target: keep near's choice among interchangeable ones
        key = (limit.away(labels), -sum(a == b for a, b in zip(labels, near.labels)))
        if best is None or key < best[0]:
            best = (key, labels)
    return best[1]


def _relink(near: State, fresh: State, limit: MoveLimit, budget: Budget) -> State:
    """Walk from ``near`` towards ``fresh`` (a placement found from scratch, as
    :func:`_aligned_target` numbers it), taking at each step the move (or, for equal
    stages, swap) towards it that gives the lowest cost without taking more than
    ``limit.max_away`` servers away from home; returns the cheapest state along the way.
    Joiners and servers going home move freely, so the walk goes on after the limit is
    reached."""
    obj = near.objective
    target = _aligned_target(near, fresh, limit)
    state = near.copy()
    best = state.copy()
    away = limit.away(state.labels)
    while not budget.over():
        off = [i for i in range(obj.n) if state.labels[i] != target[i]]
        options = []
        for i in off:
            if obj.equal_sizes:
                changes = [[(i, target[i]), (j, state.labels[i])] for j in off if state.labels[j] == target[i]]
            else:
                changes = [[(i, target[i])]] if len(state.members[state.labels[i]]) > 1 else []
            for change in changes:
                step = limit.delta(state.labels, change)
                if away + step <= limit.max_away:
                    options.append((step, state.evaluate(change)))
        if not options:
            break
        step, (_, evaluated) = min(options, key=lambda o: (o[1][0].total, o[1][0].secondary))
        state.apply(evaluated)
        away += step
        if state.score.better_than(best.score):
            best = state.copy()
    return best


def _cut(start: State, fresh: State, limit: MoveLimit, budget: Budget) -> State | None:
    """``fresh`` (as :func:`_aligned_target` numbers it) with servers sent home, the one
    whose return costs least first, until at most ``limit.max_away`` are away: as much of
    the fresh plan's structure as the limit allows, joiners where it put them. None if
    the budget ends first."""
    target = State(start.objective, _aligned_target(start, fresh, limit))
    (cut,) = _prune(target, limit, [(-math.inf, math.inf)], budget, 0.0, past_budget=False)
    return cut if limit.away(cut.labels) <= limit.max_away else None


def _prune(
    state: State,
    limit: MoveLimit,
    bounds: Sequence[tuple[float, float]],
    budget: Budget,
    move_price: float,
    past_budget: bool = True,
) -> list[State]:
    """Undo moves of kept servers (interchangeable servers first traded to move the
    fewest), the one whose undoing costs least first, while the undoing costs less than
    ``move_price`` (seconds a moved server must earn) per server sent home or the cost
    stays <= ``bound``, without rising above ``floor`` if it is below it, and (whatever
    the cost) while more than ``limit.max_away`` are away. One sequence of undoings;
    returns where it stops for each ``(bound, floor)`` of ``bounds`` (each allowing at
    least what the one before allows). It stops at the end of the budget only without
    ``past_budget``. A server goes back to its old stage alone when stage sizes are free,
    or swapped with a moved server (else a joiner) that sits there."""
    obj = state.objective
    state = State(obj, limit.fewest_moves(obj, state.labels))
    home = limit.home
    stops: list[State] = []
    while len(stops) < len(bounds):
        moved = [i for i in limit.counted if state.labels[i] != home[i]]
        over = len(moved) > limit.max_away
        if not moved or (not past_budget and budget.over()):
            break
        options = []
        for i in moved:
            if obj.equal_sizes:
                partners = [j for j in moved if state.labels[j] == home[i]] or [
                    j for j in range(obj.n) if state.labels[j] == home[i] and j not in limit.counted
                ]
                changes = [[(i, home[i]), (j, state.labels[i])] for j in partners]
            else:
                changes = [[(i, home[i])]] if len(state.members[state.labels[i]]) > 1 else []
            options.extend(state.evaluate(change) for change in changes)
        if not options:
            break
        score, evaluated = min(options, key=lambda o: (o[0].total, o[0].secondary))
        cheap = score.total - state.score.total < move_price * -limit.delta(state.labels, evaluated["changes"])
        while len(stops) < len(bounds):
            bound, floor = bounds[len(stops)]
            if over or ((cheap or score.total <= bound) and not score.total > floor >= state.score.total):
                break
            stops.append(state.copy())
        state.apply(evaluated)
    return stops + [state] * (len(bounds) - len(stops))
