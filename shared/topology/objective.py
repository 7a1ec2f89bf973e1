"""What the planner minimises: a placement's cost, evaluated group by group with caches.

A placement labels each of ``n`` peers with one of ``S`` groups (stages). Both costs of
:mod:`shared.topology.cost` split into a term per group (its averaging time, its
capacity) and a term per pair of groups (the traffic across their boundary if they are
neighbours in the pipeline), combined by a cheap function of those terms. Moving or
swapping peers changes the terms of two groups only, so :class:`State` re-evaluates a
change in ``O(S)`` terms instead of the whole placement. Terms are cached by the groups'
*class* multisets: interchangeable peers (same region and speed) give equal terms, so in
region-built networks most terms are computed once.

Every term also has a *smooth* companion (a mean where the term takes a maximum): the
score's ``secondary`` sums them, and local search accepts a change that keeps the cost
and lowers ``secondary``. Costs built of maxima have wide plateaus; without this a
descent stops on the first one.

``order_free`` objectives let the pipeline visit the groups in the cheapest order (a
fresh plan may number the stages at will; DT-FM's cost is defined that way); otherwise
group ``s`` is stage ``s`` (a replan must not renumber stages: that would move everyone).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .cost import Workload, bottleneck_matching, dtfm_pair_cost, shortest_path, spanning_tree_cost

GroupKey = tuple[int, ...]
GroupTerm = tuple[float, float, float]  # (time, capacity, smooth time)
PairTerm = tuple[float, float]  # (time, smooth time)
CACHE_LIMIT = 200_000  # entries per cache; cleared when full (terms are cheap to recompute)
EPS = 1e-9  # relative: scores closer than this are equal


@dataclass(frozen=True)
class Score:
    """``total``: the cost in seconds per step; ``secondary``: its smooth companion, which
    breaks ties; ``order``: the groups from stage 0."""

    total: float
    secondary: float
    order: tuple[int, ...]

    def better_than(self, other: Score, eps: float = EPS) -> bool:
        if not math.isfinite(other.total):  # a stage with nobody: anything finite is better
            return math.isfinite(self.total)
        tie = eps * max(1.0, abs(other.total))
        if self.total < other.total - tie:
            return True
        return self.total <= other.total + tie and self.secondary < other.secondary - eps * max(
            1.0, abs(other.secondary)
        )


REJECTED = Score(float("inf"), float("inf"), ())  # what combine returns when a bound proves it no better


def _butterfly_smooth(rtt: np.ndarray, bw: np.ndarray, members: list[int], gradient_gb: float) -> tuple[float, float]:
    """Butterfly all-reduce time of ``members`` (slowest member) and the members' mean."""
    k = len(members)
    if k < 2:
        return 0.0, 0.0
    sub = np.ix_(members, members)
    per_link = 2.0 * (rtt[sub] + (8.0 * gradient_gb / k) / bw[sub])
    member = per_link.sum(axis=1) - np.diagonal(per_link)
    return float(member.max()), float(member.mean())


SMALL_BLOCK = 144  # pair terms over at most this many links are computed in plain Python


class Objective:
    """A cost over labellings; subclasses give the group term, the pair term and how they combine."""

    def __init__(
        self,
        classes: Sequence[int],
        num_groups: int,
        *,
        equal_sizes: bool,
        order_free: bool,
        clusters: Sequence[int] | None = None,
    ):
        n = len(classes)
        if not 1 <= num_groups <= n:
            raise ValueError(f"{n} peers cannot fill {num_groups} stages (num_stages)")
        if equal_sizes and n % num_groups:
            raise ValueError(f"equal stages need num_stages to divide the {n} peers, got num_stages={num_groups}")
        self.n, self.num_groups = n, num_groups
        self.classes = list(classes)
        self.clusters = list(clusters) if clusters is not None else list(classes)  # regions: blocks that move together
        self.equal_sizes, self.order_free = equal_sizes, order_free
        self.distance: np.ndarray | None = None  # (n, n) how far apart peers are, for seeds; set by subclasses
        self._group_cache: dict[GroupKey, GroupTerm] = {}
        self._pair_cache: dict[tuple[GroupKey, GroupKey], PairTerm] = {}
        self.evaluations = 0

    # --- to override ---------------------------------------------------------------
    def group_value(self, members: list[int]) -> GroupTerm:
        raise NotImplementedError

    def pair_value(self, a: list[int], b: list[int]) -> PairTerm:
        raise NotImplementedError

    def fixed_part(self, values: Sequence[GroupTerm]) -> tuple[float, float]:
        """``(cost, smooth)`` of everything but the pipeline, from the group terms."""
        raise NotImplementedError

    # --- cached terms ----------------------------------------------------------------
    def key(self, members: Sequence[int]) -> GroupKey:
        return tuple(sorted(self.classes[m] for m in members))

    def group_term(self, members: Sequence[int], key: GroupKey) -> GroupTerm:
        value = self._group_cache.get(key)
        if value is None:
            if len(self._group_cache) >= CACHE_LIMIT:
                self._group_cache.clear()
            value = self._group_cache[key] = self.group_value(list(members))
        return value

    def pair_term(self, a: Sequence[int], key_a: GroupKey, b: Sequence[int], key_b: GroupKey) -> PairTerm:
        cache_key = (key_a, key_b) if key_a <= key_b else (key_b, key_a)
        value = self._pair_cache.get(cache_key)
        if value is None:
            if len(self._pair_cache) >= CACHE_LIMIT:
                self._pair_cache.clear()
            value = self._pair_cache[cache_key] = self.pair_value(list(a), list(b))
        return value

    # --- combining -------------------------------------------------------------------
    def path(
        self, pairs: np.ndarray, ordered: bool, rest: float = 0.0, incumbent: Score | None = None
    ) -> tuple[float, tuple[int, ...]] | None:
        """The pipeline's one-way sum of pair times ``pairs[..., 0]``: in group order, or
        the cheapest order. None when ``rest + 2 * path`` provably exceeds the incumbent's
        total (a spanning tree weighs no more than any path)."""
        times = pairs[..., 0]
        s = times.shape[0]
        if ordered:
            return float(sum(times[i, i + 1] for i in range(s - 1))), tuple(range(s))
        if incumbent is not None:
            bound = rest + 2 * spanning_tree_cost(times)
            if bound > incumbent.total + EPS * max(1.0, abs(incumbent.total)):
                return None
        cost, order = shortest_path(times)
        return cost, tuple(order)

    def combine(
        self, values: Sequence[GroupTerm], pairs: np.ndarray, ordered: bool, incumbent: Score | None = None
    ) -> Score:
        """The score of these terms (pipeline in group order if ``ordered``, else the
        cheapest order), or :data:`REJECTED` when a bound shows it cannot beat ``incumbent``."""
        self.evaluations += 1
        fixed, fixed_smooth = self.fixed_part(values)
        if fixed == float("inf"):
            return Score(fixed, fixed, tuple(range(len(values))))
        path = self.path(pairs, ordered, fixed, incumbent)
        if path is None:
            return REJECTED
        pipeline, order = path
        smooth_pipeline = float(sum(pairs[a, b, 1] for a, b in zip(order, order[1:])))
        return Score(fixed + 2 * pipeline, fixed_smooth + 2 * smooth_pipeline, order)

    def score(self, labels: Sequence[int]) -> Score:
        """The whole placement's score (no incremental state)."""
        return State(self, labels).score


class DTFMObjective(Objective):
    """DT-FM's cost: equal groups, max butterfly time + 2 x cheapest path of bottleneck matchings."""

    def __init__(
        self,
        rtt: np.ndarray,
        bw: np.ndarray,
        classes: Sequence[int],
        num_groups: int,
        activation_gb: float,
        gradient_gb: float,
        *,
        order_free: bool = True,
        clusters: Sequence[int] | None = None,
    ):
        super().__init__(classes, num_groups, equal_sizes=True, order_free=order_free, clusters=clusters)
        self.rtt, self.bw, self.gradient_gb = rtt, bw, gradient_gb
        self.transfer = dtfm_pair_cost(rtt, bw, activation_gb)
        self.distance = self.transfer

    def group_value(self, members: list[int]) -> GroupTerm:
        slowest, mean = _butterfly_smooth(self.rtt, self.bw, members, self.gradient_gb)
        return slowest, 0.0, mean

    def pair_value(self, a: list[int], b: list[int]) -> PairTerm:
        cost = self.transfer[np.ix_(a, b)]
        if len(a) != len(b):  # only while a greedy fill is half done: a lower bound
            return float(cost.min(axis=1 if len(a) < len(b) else 0).max()), float(cost.mean())
        value, match = bottleneck_matching(cost)
        return value, float(cost[np.arange(len(a)), match].mean())

    def fixed_part(self, values):
        return max(v[0] for v in values), sum(v[2] for v in values) / len(values)


class SwarmObjective(Objective):
    """The SWARM step cost with stochastic wiring: weakest-stage compute + 2 x pipeline +
    amortized averaging (see :func:`shared.topology.cost.step_cost`)."""

    def __init__(
        self,
        rtt: np.ndarray,
        bw: np.ndarray,
        throughput: np.ndarray,
        classes: Sequence[int],
        num_groups: int,
        workload: Workload,
        *,
        order_free: bool,
        clusters: Sequence[int] | None = None,
    ):
        super().__init__(classes, num_groups, equal_sizes=False, order_free=order_free, clusters=clusters)
        self.rtt, self.bw, self.throughput, self.workload = rtt, bw, throughput, workload
        self.transfer = 8.0 * workload.boundary_gb / bw  # seconds to send the whole boundary over each link
        self.distance = rtt + self.transfer
        self._throughput = throughput.tolist()
        self._transfer_rows, self._rtt_rows = self.transfer.tolist(), rtt.tolist()

    def group_value(self, members: list[int]) -> GroupTerm:
        if not members:
            return 0.0, 0.0, 0.0
        slowest, mean = _butterfly_smooth(self.rtt, self.bw, members, self.workload.gradient_gb)
        return slowest, float(sum(self._throughput[m] for m in members)), mean

    def pair_value(self, a: list[int], b: list[int]) -> PairTerm:
        """:func:`~shared.topology.cost.hop_time` of stochastic flows, specialised: every
        link is used, so sender ``i`` needs ``s_i * sum_j r_j * 8V / bw_ij`` plus its
        largest RTT (``s``, ``r``: the throughput shares). Plain Python for small stages
        (numpy's per-call cost dominates there), numpy for large ones."""
        if not a or not b:
            return 0.0, 0.0
        if len(a) * len(b) > SMALL_BLOCK:
            return self._pair_value_numpy(np.asarray(a, dtype=np.intp), np.asarray(b, dtype=np.intp))
        thr, transfer, rtt = self._throughput, self._transfer_rows, self._rtt_rows
        total_a, total_b = sum(thr[i] for i in a), sum(thr[j] for j in b)
        r = [thr[j] / total_b for j in b]
        receive = [0.0] * len(b)
        receive_rtt = [0.0] * len(b)
        senders = []
        for i in a:
            share, row, lat_row = thr[i] / total_a, transfer[i], rtt[i]
            load, slowest = 0.0, 0.0
            for k, j in enumerate(b):
                t = row[j]
                load += r[k] * t
                receive[k] += share * t
                lat = lat_row[j]
                if lat > slowest:
                    slowest = lat
                if lat > receive_rtt[k]:
                    receive_rtt[k] = lat
            senders.append(share * load + slowest)
        receivers = [r[k] * receive[k] + receive_rtt[k] for k in range(len(b))]
        value = max(max(senders), max(receivers))
        return value, (sum(senders) / len(senders) + sum(receivers) / len(receivers)) / 2

    def _pair_value_numpy(self, a: np.ndarray, b: np.ndarray) -> PairTerm:
        sub = np.ix_(a, b)
        seconds, rtt = self.transfer[sub], self.rtt[sub]
        s = self.throughput[a] / self.throughput[a].sum()
        r = self.throughput[b] / self.throughput[b].sum()
        senders = s * (seconds @ r) + rtt.max(axis=1)
        receivers = r * (s @ seconds) + rtt.max(axis=0)
        value = float(max(senders.max(), receivers.max()))
        return value, float((senders.mean() + receivers.mean()) / 2)

    def fixed_part(self, values):
        w = self.workload
        capacity = [v[1] for v in values]
        if min(capacity) <= 0:
            return float("inf"), float("inf")
        compute = [w.samples_per_step / c for c in capacity]
        cost = max(compute) + max(v[0] for v in values) / w.average_every_steps
        smooth = (sum(compute) + sum(v[2] for v in values) / w.average_every_steps) / len(values)
        return cost, smooth


class State:
    """A labelling with its cached terms; evaluates and applies moves and swaps incrementally.

    ``ordered``: the pipeline visits the groups in label order (default: unless the
    objective is order-free). Searching an order-free objective in ordered states is
    much cheaper (a change touches the pair terms of its groups' two neighbours, not of
    all groups, and needs no path search); :meth:`reorder` then renumbers the groups
    along the cheapest path.
    """

    def __init__(self, objective: Objective, labels: Sequence[int], ordered: bool | None = None):
        obj = self.objective = objective
        self.ordered = not obj.order_free if ordered is None else ordered
        self.labels = list(labels)
        self.members: list[list[int]] = [[] for _ in range(obj.num_groups)]
        for peer, group in enumerate(self.labels):
            self.members[group].append(peer)
        self.keys = [obj.key(m) for m in self.members]
        self.values = [obj.group_term(m, k) for m, k in zip(self.members, self.keys)]
        self.pairs = self._pair_terms(all_pairs=not self.ordered)
        self.score = obj.combine(self.values, self.pairs, self.ordered)

    def _pair_terms(self, all_pairs: bool) -> np.ndarray:
        obj, s = self.objective, self.objective.num_groups
        pairs = np.zeros((s, s, 2))
        for a in range(s):
            for b in range(a + 1, s):
                if all_pairs or b == a + 1:
                    pairs[a, b] = pairs[b, a] = obj.pair_term(
                        self.members[a], self.keys[a], self.members[b], self.keys[b]
                    )
        return pairs

    def needs_pair(self, a: int, b: int) -> bool:
        """Whether groups ``a`` and ``b`` can be neighbours in the pipeline (else their pair
        term is never used and stays 0)."""
        return not self.ordered or abs(a - b) == 1

    def copy(self) -> State:
        new = object.__new__(State)
        new.objective, new.ordered, new.labels = self.objective, self.ordered, list(self.labels)
        new.members = [list(m) for m in self.members]
        new.keys, new.values = list(self.keys), list(self.values)
        new.pairs, new.score = self.pairs.copy(), self.score
        return new

    def evaluate(self, changes: Sequence[tuple[int, int]], incumbent: Score | None = None) -> tuple[Score, dict]:
        """The score after relabelling ``(peer, new_group)`` pairs, and what :meth:`apply`
        needs; :data:`REJECTED` if it provably does not beat ``incumbent``."""
        obj = self.objective
        touched: dict[int, list[int]] = {}
        for peer, group in changes:
            old = self.labels[peer]
            if old == group:
                continue
            touched.setdefault(old, list(self.members[old])).remove(peer)
            touched.setdefault(group, list(self.members[group])).append(peer)
        keys = {g: obj.key(m) for g, m in touched.items()}
        values = list(self.values)
        for g, m in touched.items():
            values[g] = obj.group_term(m, keys[g])
        pairs = self.pairs.copy()
        s = obj.num_groups
        for g, m in touched.items():
            for other in (g - 1, g + 1) if self.ordered else range(s):
                if not 0 <= other < s or other == g or (other in touched and other < g):
                    continue
                om, ok = (touched[other], keys[other]) if other in touched else (self.members[other], self.keys[other])
                pairs[g, other] = pairs[other, g] = obj.pair_term(m, keys[g], om, ok)
        score = obj.combine(values, pairs, self.ordered, incumbent)
        return score, {
            "changes": changes,
            "members": touched,
            "keys": keys,
            "values": values,
            "pairs": pairs,
            "score": score,
        }

    def apply(self, evaluated: dict) -> None:
        for peer, group in evaluated["changes"]:
            self.labels[peer] = group
        for g, m in evaluated["members"].items():
            self.members[g], self.keys[g] = m, evaluated["keys"][g]
        self.values, self.pairs, self.score = evaluated["values"], evaluated["pairs"], evaluated["score"]

    def reorder(self, ordered: bool) -> State:
        """A new state with the groups renumbered along the cheapest pipeline order (group
        ``order[s]`` becomes ``s``), evaluated ``ordered`` or not."""
        _, order = self.objective.path(self._pair_terms(all_pairs=True), ordered=False)
        new_label = {g: s for s, g in enumerate(order)}
        return State(self.objective, [new_label[g] for g in self.labels], ordered=ordered)

    def canonical(self) -> tuple:
        """Equal for placements equal up to interchangeable peers (and group order when order-free)."""
        keys = tuple(self.keys)
        return tuple(sorted(keys)) if self.objective.order_free else keys
