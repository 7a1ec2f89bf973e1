"""Seconds per global step of a placement: the DT-FM cost and the general SWARM cost.

Units: volumes in GB and bandwidths in Gbit/s (so a transfer takes ``8 * GB / Gbit/s``
seconds), latencies in seconds. Every transfer pays the link's round-trip time once,
as DT-FM's cost model does (its table's delay column is the RTT); a hop of the mesh is
one HTTP request and reply, which costs one RTT too.

**DT-FM cost** (Yuan et al., NeurIPS 2022), for equal data-parallel groups of ``k``
devices, each group holding one pipeline stage:

- data-parallel cost ``DP = max_group max_i sum_{j != i} 2 (rtt_ij + 8 G / (k bw_ij))``:
  a butterfly all-reduce (reduce-scatter then all-gather), member ``i`` sending a
  ``G / k`` slice to each other member in turn, twice;
- pipeline cost ``PP``: between two groups, the bottleneck perfect matching (the
  pairing of their devices that minimises the slowest pair's ``rtt + 8 A / bw``), then
  the cheapest open path visiting every group once (which group is stage 0, 1, ...);
- total ``DP + 2 PP`` (activations forward, their gradients backward).

**SWARM cost** (:func:`step_cost`), for any peers, stage sizes and routing:
``compute + 2 * pipeline + averaging / average_every_steps`` where compute is the
global batch over the weakest stage's capacity (sum of its replicas' throughputs),
pipeline sums over consecutive stages the time of the boundary's traffic (each sender
and receiver serialises its share over its links, plus the slowest link's RTT), and
averaging is the slowest stage's butterfly all-reduce, the DP term above. With equal
peers, equal stages and DT-FM's matched routing it is DT-FM's cost plus a compute term
that does not depend on the placement (checked in the tests).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

# DT-FM's GPT-3 XL task (1.3B parameters, 24 layers, 8 stages of 3 layers, global batch
# 1M tokens of sequence 2048, 8 data-parallel groups): volumes as its released scheduler
# computes them. Activation volume per tasklet = 2024 * 2048 * 2 bytes * 61.04 samples
# / 2**30 = 0.4712 GB (its expression reads 2024, not 2048, for the sequence length);
# gradient volume per stage = 1.3e9 * 4 bytes * 3/24 layers = 0.65 GB.
DTFM_SAMPLES_PER_STEP = 1e6 / 2048
DTFM_TASKLET_SAMPLES = 1.25e5 / 2048
DTFM_ACTIVATION_GB = 2024 * 2048 * 2 * DTFM_TASKLET_SAMPLES / 2**30
DTFM_GRADIENT_GB = 1.3 * 4 * 3 / 24


@dataclass(frozen=True)
class Workload:
    """What one global step moves and computes.

    ``activation_gb_per_sample`` crosses every stage boundary forward, and its gradient
    backward; ``gradient_gb`` is one stage's parameters as averaged; a stage averages
    every ``average_every_steps`` global steps.
    """

    samples_per_step: float
    activation_gb_per_sample: float
    gradient_gb: float
    average_every_steps: float = 1.0

    def __post_init__(self) -> None:
        if not (self.samples_per_step > 0 and self.activation_gb_per_sample >= 0 and self.gradient_gb >= 0):
            raise ValueError(f"workload volumes must be >= 0 and samples_per_step > 0, got {self}")
        if not self.average_every_steps > 0:
            raise ValueError(f"average_every_steps must be > 0, got {self.average_every_steps}")

    @property
    def boundary_gb(self) -> float:
        """Activation volume that crosses one stage boundary per step."""
        return self.samples_per_step * self.activation_gb_per_sample

    def tasklet_activation_gb(self, replicas_per_stage: int) -> float:
        """DT-FM's per-device activation volume with ``replicas_per_stage`` equal groups."""
        return self.boundary_gb / replicas_per_stage


DTFM_GPT3_XL = Workload(
    samples_per_step=DTFM_SAMPLES_PER_STEP,
    activation_gb_per_sample=DTFM_ACTIVATION_GB / DTFM_TASKLET_SAMPLES,
    gradient_gb=DTFM_GRADIENT_GB,
)


# --- building blocks ----------------------------------------------------------------------


def butterfly_time(rtt: np.ndarray, bw: np.ndarray, gradient_gb: float) -> float:
    """Butterfly all-reduce time of one group: its slowest member's
    ``sum_{j != i} 2 (rtt_ij + 8 G / (k bw_ij))``. ``rtt``/``bw`` are the group's ``(k, k)``
    sub-matrices; 0 for a group of one."""
    k = rtt.shape[0]
    if k < 2:
        return 0.0
    per_link = 2.0 * (rtt + (8.0 * gradient_gb / k) / bw)
    return float((per_link.sum(axis=1) - np.diagonal(per_link)).max())


def bottleneck_matching(cost: np.ndarray) -> tuple[float, list[int]]:
    """The perfect matching of rows to columns of a square ``cost`` whose largest entry is
    smallest: ``(that entry, match)`` with row ``i`` paired to column ``match[i]``.

    Edges are added cheapest first, from a lower bound (every row and every column must
    use one of its entries) up, and the matching grows by augmenting paths until it is
    perfect: the last threshold is the answer. Same value as DT-FM's repeated
    linear-sum-assignment, without scipy.
    """
    rows = cost.tolist()
    k = len(rows)
    if k == 0:
        return 0.0, []
    lower = max(max(min(r) for r in rows), max(min(c) for c in zip(*rows)))
    edges = sorted((v, i, j) for i, r in enumerate(rows) for j, v in enumerate(r))
    adjacency: list[list[int]] = [[] for _ in range(k)]
    owner = [-1] * k  # column -> row
    free = list(range(k))
    pos, threshold = 0, lower
    while True:
        while pos < len(edges) and edges[pos][0] <= threshold:
            adjacency[edges[pos][1]].append(edges[pos][2])
            pos += 1
        free = [row for row in free if not _augment(row, adjacency, owner, [False] * k)]
        if not free:
            break
        threshold = edges[pos][0]
    match = [0] * k
    for col, row in enumerate(owner):
        match[row] = col
    return float(threshold), match


def _augment(row: int, adjacency: list[list[int]], owner: list[int], seen: list[bool]) -> bool:
    """Kuhn's augmenting path from ``row``; updates ``owner`` (column -> row) on success."""
    for col in adjacency[row]:
        if not seen[col]:
            seen[col] = True
            if owner[col] < 0 or _augment(owner[col], adjacency, owner, seen):
                owner[col] = row
                return True
    return False


@lru_cache(maxsize=16)
def _open_paths(n: int) -> np.ndarray:
    """Every ordering of ``n`` nodes up to reversal, ``(n!/2, n)`` (one row when n < 2)."""
    perms = [p for p in itertools.permutations(range(n)) if n < 2 or p[0] < p[-1]]
    return np.array(perms, dtype=np.intp).reshape(len(perms), n)


@lru_cache(maxsize=16)
def _subset_layers(n: int) -> list[np.ndarray]:
    """The subsets of ``n`` nodes as bit masks, grouped by size."""
    sizes = np.array([m.bit_count() for m in range(1 << n)])
    return [np.flatnonzero(sizes == k) for k in range(n + 1)]


PERMUTATION_MAX_NODES = 6  # a table of n!/2 paths up to here; Held-Karp up to HELD_KARP_MAX_NODES
HELD_KARP_MAX_NODES = 14


def shortest_path(pair_cost: np.ndarray) -> tuple[float, list[int]]:
    """The cheapest open path visiting every node once (any start, any end) of a symmetric
    ``pair_cost``: ``(cost, order)``. Exact up to 14 nodes; beyond that nearest-neighbour
    from every start then 2-opt, a heuristic (stage counts that large are rare)."""
    n = pair_cost.shape[0]
    if n <= 1:
        return 0.0, list(range(n))
    if n <= PERMUTATION_MAX_NODES:
        paths = _open_paths(n)
        totals = pair_cost[paths[:, :-1], paths[:, 1:]].sum(axis=1)
        best = int(totals.argmin())
        return float(totals[best]), paths[best].tolist()
    if n <= HELD_KARP_MAX_NODES:
        return _held_karp(pair_cost)
    return _two_opt_path(pair_cost)


def _held_karp(pair_cost: np.ndarray) -> tuple[float, list[int]]:
    """Held-Karp dynamic programme, one numpy step per subset size: ``best[S, j]`` is the
    cheapest path through subset ``S`` ending at ``j``, from ``best[S - j, i] + c[i, j]``."""
    n = pair_cost.shape[0]
    nodes = np.arange(n)
    bits = 1 << nodes
    best = np.full((1 << n, n), np.inf)
    best[bits, nodes] = 0.0
    into = pair_cost.T[None, :, :]  # [., j, i] = c[i, j]
    for masks in _subset_layers(n)[2:]:
        before = masks[:, None] ^ bits  # (m, j): the subset without j (garbage where j is not in it)
        reach = (best[before] + into).min(axis=2)
        best[masks] = np.where((masks[:, None] & bits) > 0, reach, np.inf)
    full = (1 << n) - 1
    end = int(best[full].argmin())
    cost, order, mask = float(best[full, end]), [end], full
    while len(order) < n:
        mask ^= 1 << end
        end = int((best[mask] + pair_cost[:, end]).argmin())
        order.append(end)
    return cost, order[::-1]


def spanning_tree_cost(pair_cost: np.ndarray) -> float:
    """Weight of a minimum spanning tree (Prim): a lower bound on any open path's cost,
    a few microseconds against the exact path's hundreds."""
    n = pair_cost.shape[0]
    if n <= 1:
        return 0.0
    rows = pair_cost.tolist()
    dist = list(rows[0])
    left = set(range(1, n))
    total = 0.0
    while left:
        nxt = min(left, key=dist.__getitem__)
        total += dist[nxt]
        left.remove(nxt)
        row = rows[nxt]
        for j in left:
            if row[j] < dist[j]:
                dist[j] = row[j]
    return total


def _path_cost(pair_cost: np.ndarray, order: Sequence[int]) -> float:
    return float(sum(pair_cost[a, b] for a, b in zip(order, order[1:])))


def _two_opt_path(pair_cost: np.ndarray) -> tuple[float, list[int]]:
    """Nearest neighbour from every start, then 2-opt (segment reversals) on the best."""
    n = pair_cost.shape[0]
    c = pair_cost.tolist()
    best: tuple[float, list[int]] | None = None
    for start in range(n):
        order, left = [start], set(range(n)) - {start}
        while left:
            nxt = min(left, key=c[order[-1]].__getitem__)
            order.append(nxt)
            left.remove(nxt)
        cost = _path_cost(pair_cost, order)
        if best is None or cost < best[0]:
            best = (cost, order)
    assert best is not None
    order = best[1]

    def edge(a: int, b: int) -> float:  # positions; the ends of an open path are free
        return c[order[a]][order[b]] if 0 <= a and b < n else 0.0

    improved = True
    while improved:
        improved = False
        for i in range(-1, n - 1):
            for j in range(i + 2, n):  # reverse order[i+1 .. j]
                if edge(i, j) + edge(i + 1, j + 1) < edge(i, i + 1) + edge(j, j + 1) - 1e-12:
                    order[i + 1 : j + 1] = order[i + 1 : j + 1][::-1]
                    improved = True
    return _path_cost(pair_cost, order), order


# --- the DT-FM cost -------------------------------------------------------------------------


@dataclass(frozen=True)
class DTFMCost:
    """DT-FM's cost of a partition into equal groups, and the routing it implies.

    ``order`` lists the groups from stage 0; ``matchings[s][i] = j``: device ``i`` of the
    group at stage ``s`` (positions within ``groups[order[s]]``) sends to device ``j`` of
    the group at stage ``s + 1``.
    """

    total_s: float
    data_parallel_s: float
    pipeline_s: float  # one direction; the total counts it twice
    order: list[int]
    matchings: list[list[int]]


def dtfm_pair_cost(rtt: np.ndarray, bw: np.ndarray, activation_gb: float) -> np.ndarray:
    """Per device pair, the time to send one tasklet's activations: ``rtt + 8 A / bw``."""
    return rtt + 8.0 * activation_gb / bw


def dtfm_cost(
    groups: Sequence[Sequence[int]], rtt: np.ndarray, bw: np.ndarray, activation_gb: float, gradient_gb: float
) -> DTFMCost:
    """DT-FM's cost of ``groups`` (peer indices into ``rtt``/``bw``), all of one size."""
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"DT-FM's cost needs groups of one size, got sizes {sorted(sizes)}")
    idx = [np.asarray(g, dtype=np.intp) for g in groups]
    data_parallel = max(butterfly_time(rtt[np.ix_(g, g)], bw[np.ix_(g, g)], gradient_gb) for g in idx)
    pair = dtfm_pair_cost(rtt, bw, activation_gb)
    n = len(idx)
    between = np.zeros((n, n))
    matches: dict[tuple[int, int], list[int]] = {}
    for a, b in itertools.combinations(range(n), 2):
        between[a, b], matches[a, b] = bottleneck_matching(pair[np.ix_(idx[a], idx[b])])
        between[b, a] = between[a, b]
    pipeline, order = shortest_path(between)
    matchings = []
    for a, b in zip(order, order[1:]):
        if (a, b) in matches:
            matchings.append(matches[a, b])
        else:  # stored the other way round: invert
            inverse = [0] * len(matches[b, a])
            for i, j in enumerate(matches[b, a]):
                inverse[j] = i
            matchings.append(inverse)
    return DTFMCost(data_parallel + 2 * pipeline, data_parallel, pipeline, order, matchings)


# --- the general SWARM cost ---------------------------------------------------------------


@dataclass(frozen=True)
class StepCost:
    """Seconds per global step and its parts; ``averaging_s`` is one round, un-amortized."""

    total_s: float
    compute_s: float
    pipeline_s: float  # one direction, summed over boundaries
    averaging_s: float
    hops_s: list[float]


def stochastic_flows(sender_throughput: np.ndarray, receiver_throughput: np.ndarray) -> np.ndarray:
    """Share of a boundary's traffic on each (sender, receiver) link under stochastic wiring:
    every trainer spreads requests over a stage's replicas in proportion to their speed
    (the ReplicaBalancer's steady state), independently at each stage."""
    s = sender_throughput / sender_throughput.sum()
    r = receiver_throughput / receiver_throughput.sum()
    return np.outer(s, r)


def matched_flows(match: Sequence[int]) -> np.ndarray:
    """Fixed pipelines: sender ``i`` sends its ``1/k`` share only to receiver ``match[i]``."""
    k = len(match)
    flows = np.zeros((k, k))
    flows[np.arange(k), np.asarray(match, dtype=np.intp)] = 1.0 / k
    return flows


def hop_time(flows: np.ndarray, rtt: np.ndarray, bw: np.ndarray, volume_gb: float) -> float:
    """Time for one boundary's traffic: each sender and each receiver moves its share over
    its links one after the other, plus the RTT of its slowest used link; the hop lasts
    as long as the busiest of them. With matched routing this is DT-FM's bottleneck pair
    ``max (rtt + 8 A / bw)``."""
    used = flows > 0
    seconds = np.where(used, 8.0 * volume_gb * flows / bw, 0.0)
    latency = np.where(used, rtt, 0.0)
    senders = latency.max(axis=1) + seconds.sum(axis=1)
    receivers = latency.max(axis=0) + seconds.sum(axis=0)
    return float(max(senders.max(), receivers.max()))


def step_cost(
    stages: Sequence[Sequence[int]],
    throughput: np.ndarray,
    rtt: np.ndarray,
    bw: np.ndarray,
    workload: Workload,
    flows: Sequence[np.ndarray] | None = None,
) -> StepCost:
    """Seconds per global step of ``stages`` (peer indices, stage 0 first).

    ``flows[s]`` is the traffic split over boundary ``s -> s+1`` (rows: stage ``s``'s
    members in the given order); stochastic wiring when None. An empty stage makes the
    step infinitely long.
    """
    idx = [np.asarray(s, dtype=np.intp) for s in stages]
    if any(len(s) == 0 for s in idx):
        return StepCost(float("inf"), float("inf"), 0.0, 0.0, [])
    capacity = min(float(throughput[s].sum()) for s in idx)
    compute = workload.samples_per_step / capacity
    hops = []
    for b, (a_idx, b_idx) in enumerate(zip(idx, idx[1:])):
        f = flows[b] if flows is not None else stochastic_flows(throughput[a_idx], throughput[b_idx])
        hops.append(hop_time(f, rtt[np.ix_(a_idx, b_idx)], bw[np.ix_(a_idx, b_idx)], workload.boundary_gb))
    averaging = max(butterfly_time(rtt[np.ix_(s, s)], bw[np.ix_(s, s)], workload.gradient_gb) for s in idx)
    pipeline = float(sum(hops))
    total = compute + 2.0 * pipeline + averaging / workload.average_every_steps
    return StepCost(total, compute, pipeline, averaging, hops)
