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

import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .cost import Workload
from .network import Network, Peer
from .objective import DTFMObjective, Objective, State, SwarmObjective
from .search import Budget, MoveLimit, chain, evolve, insertion, kick, local_search, pack, spread

MODELS = ("swarm", "dtfm")
INSERTION_MAX_PEERS = 256  # the insertion seed costs peers x stages evaluations of the whole placement


@dataclass(frozen=True)
class Placement:
    """A plan: each peer's stage, its predicted seconds per step, and what it took."""

    assignment: dict[str, int]
    cost_s: float
    evaluations: int
    seconds: float


@dataclass(frozen=True)
class StageMove:
    """Server ``peer_id`` leaves ``from_stage`` for ``to_stage`` (it downloads the new stage's state)."""

    peer_id: str
    from_stage: int
    to_stage: int


@dataclass(frozen=True)
class Replan:
    """The assignment after a replan: ``moves`` of servers that already had a stage,
    ``joined`` stages of servers that had none, the cost before (current assignment with
    the joiners placed) and after."""

    assignment: dict[str, int]
    moves: list[StageMove]
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
            raise ValueError(f"DT-FM's cost needs equal stages: {len(peers)} peers do not split into num_stages={num_stages}")
        activation = workload.tasklet_activation_gb(len(peers) // num_stages)
        return DTFMObjective(rtt, bw, classes, num_stages, activation, workload.gradient_gb, order_free=order_free,
                             clusters=clusters)
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
    assignment: Mapping[str, int], peers: Sequence[Peer], network: Network, workload: Workload, num_stages: int,
    *, model: str = "swarm",
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
    current: Mapping[str, int], peers: Sequence[Peer], network: Network, workload: Workload, num_stages: int,
    *, model: str = "swarm", time_budget_s: float = 1.0, max_evaluations: float = math.inf, seed: int = 0,
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

    Joiners (peers absent from ``current``) are placed first (:func:`place_joiners`).
    Then, stages keeping their numbers: iterated local search from there; a fresh plan
    (evolutionary search seeded with both); and the walk from the former towards the
    latter, one move at a time. The cheapest placement seen moves servers only if it is
    at least ``min_gain`` cheaper than keeping them (moving costs a state download; a
    gain within the measurement noise is not worth it), and then keeps only the moves
    that matter: moves are undone, the least useful first, while the cost stays within
    ``tolerance`` of the best or a move earns less than ``move_cost`` (a fraction of the
    current cost: what a state download is worth), and further (whatever the cost) down
    to ``max_moves``. A reshuffle that only noise favours spreads its gain over many
    moves, each earning little, and is undone.
    With ``max_moves``, a last local search improves the result without moving more
    servers. Budget shares: 10% joiners, 30% local, 45% fresh, the rest undoing moves
    (past the budget if ``max_moves`` requires it) and the last search.
    """
    rng = random.Random(seed)
    obj = build_objective(peers, network, workload, num_stages, model=model, order_free=False)
    fresh_obj = build_objective(peers, network, workload, num_stages, model=model, order_free=True)
    budget = Budget([obj, fresh_obj], time_budget_s, max_evaluations)
    labels0, kept = _initial_labels(obj, current, peers, rng, _Share(budget, 0.1))
    start = State(obj, labels0)
    near = _iterated_local_search(start, rng, _Share(budget, 0.4))
    fresh = evolve(fresh_obj, rng, [near.labels], budget=_Share(budget, 0.85), population_size=8)
    best = min([near, *_relink(near, fresh, kept)], key=lambda s: s.score.total)
    final = _prune(best, labels0, kept, best.score.total * (1 + tolerance), max_moves, budget,
                   move_cost * start.score.total)
    if max_moves is not None:  # pruning down to max_moves may have undone useful moves: search again within it
        limit = MoveLimit(labels0, frozenset(kept), max_moves)
        final = local_search(final, rng, budget=budget, limit=limit)
    if not start.score.total > final.score.total * (1 + min_gain):
        final = start
    assignment = {p.peer_id: final.labels[i] for i, p in enumerate(peers)}
    moves = [StageMove(peers[i].peer_id, current[peers[i].peer_id], final.labels[i])
             for i in kept if final.labels[i] != current[peers[i].peer_id]]
    joined = {p.peer_id: final.labels[i] for i, p in enumerate(peers) if p.peer_id not in current}
    return Replan(assignment, moves, joined, start.score.total, final.score.total)


class _Share(Budget):
    """The part of a budget up to ``until`` of it, as a budget of its own (for phases)."""

    def __init__(self, whole: Budget, until: float):
        self.whole, self.until = whole, until
        self.begin = whole.spent()

    def spent(self) -> float:
        span = self.until - self.begin
        return 1.0 if span <= 0 else (self.whole.spent() - self.begin) / span


def _iterated_local_search(start: State, rng: random.Random, budget: Budget) -> State:
    """Local search from ``start``, then kicks (a few random swaps) of the best and local
    search again while the budget lasts, keeping the best: a local search alone stops at
    the first local optimum near the current assignment."""
    best = local_search(start.copy(), rng, budget=budget)
    while not budget.over():
        trial = local_search(State(best.objective, kick(best.objective, best.labels, rng, strength=3)), rng, budget=budget)
        if trial.score.better_than(best.score):
            best = trial
    return best


def _relink(near: State, fresh: State, kept: Sequence[int]) -> list[State]:
    """Walk from ``near`` (stages as numbered) towards ``fresh`` (a placement found from
    scratch, numbered along its own pipeline, or reversed: whichever keeps more servers
    where they are), taking at each step the move (or, for equal stages, swap) towards it
    that gives the lowest cost; returns the states along the way. The cheapest of them
    may need far fewer moves than ``fresh`` itself."""
    obj = near.objective
    order = list(fresh.score.order)
    candidates = [order, order[::-1]]
    targets = []
    for path in candidates:
        stage_of = {g: s for s, g in enumerate(path)}
        targets.append([stage_of[g] for g in fresh.labels])
    target = max(targets, key=lambda t: sum(t[i] == near.labels[i] for i in kept))
    state, path = near.copy(), []
    while True:
        off = [i for i in range(obj.n) if state.labels[i] != target[i]]
        if not off:
            return path
        options = []
        for i in off:
            if obj.equal_sizes:
                changes = [[(i, target[i]), (j, state.labels[i])] for j in off if state.labels[j] == target[i]]
            else:
                changes = [[(i, target[i])]] if len(state.members[state.labels[i]]) > 1 else []
            options.extend(state.evaluate(c) for c in changes)
        if not options:
            return path
        _, evaluated = min(options, key=lambda o: (o[0].total, o[0].secondary))
        state.apply(evaluated)
        path.append(state.copy())


def _prune(state: State, labels0: Sequence[int], kept: Sequence[int], bound: float, max_moves: int | None,
           budget: Budget, move_price: float) -> State:
    """Undo moves of kept servers, the one whose undoing costs least first, while the cost
    stays <= ``bound`` or the undoing costs less than ``move_price`` (seconds a moved
    server must earn), then (whatever the cost, past the budget if need be) down to
    ``max_moves``. A server goes back to its old stage alone when stage sizes are free,
    or swapped with a moved server (else a joiner) that sits there."""
    state = state.copy()
    obj = state.objective
    while True:
        moved = [i for i in kept if state.labels[i] != labels0[i]]
        over = max_moves is not None and len(moved) > max_moves
        if not moved or (budget.over() and not over):
            return state
        options = []
        for i in moved:
            home = labels0[i]
            if obj.equal_sizes:
                partners = [j for j in moved if state.labels[j] == home] or [
                    j for j in range(obj.n) if state.labels[j] == home and j not in kept]
                changes = [[(i, home), (j, state.labels[i])] for j in partners]
            else:
                changes = [[(i, home)]] if len(state.members[state.labels[i]]) > 1 else []
            options.extend(state.evaluate(change) for change in changes)
        if not options:
            return state
        score, evaluated = min(options, key=lambda o: (o[0].total, o[0].secondary))
        undone = sum(1 for p, g in evaluated["changes"] if p in kept and g == labels0[p])
        cheap = score.total - state.score.total < move_price * undone
        if score.total > bound and not cheap and not over:
            return state
        state.apply(evaluated)
