"""The resilience rule: every stage keeps a replica to lose.

A stage without a replica stops the swarm; a stage with one stops it at that server's
first failure. So servers go where a loss would hurt most, and no move leaves a stage
weaker than that:

- :func:`neediest_stage` ranks the stages by what the loss of one replica would leave:
  an empty stage first, then a stage with one replica (the weakest of them), then the
  stage whose capacity would fall lowest if its strongest replica left (then the least
  capacity, the fewest replicas, the lowest index). A joining server takes that stage
  (:func:`join_stage`), and so does a replica moved by :func:`repair_move`.
- :func:`replica_floor`: the fewest replicas a move may leave on its stage: 2 while the
  swarm has at least two servers a stage (no stage is left with one replica to strengthen
  another), else 1 (no stage is ever emptied).
- :func:`repair_move`: the move that gives a stage short of what the swarm can give every
  stage (one replica, two once there are two servers a stage) a replica from a stage with
  spare (a loss or an unlucky join left it short).
- :func:`thinned_stage`: the stage a set of moves (a topology replan) would leave below the floor.
- :func:`standby_stage`: where a standby server (started with ``--stage standby``, holding
  no stage until it is needed) goes: the neediest stage, once some stage has fewer than
  ``SAFE_REPLICAS`` replicas; while every stage has that many, it waits.
- A joiner on a slow link (:func:`slow_link`: a declared link rate under
  ``SLOW_LINK_FRACTION`` of the swarm's median) takes the stage of the same need with the
  MOST capacity instead of the least: every step a stage's replicas all-reduce its gradient,
  at the pace of the slowest link among them, so a slow link costs least where the stage has
  compute to spare (a stage of two slow-compute peers that waits on such a round is the
  swarm's bottleneck twice over). The need comes first all the same: an empty stage is
  filled whatever the joiner's link.

A stage's members are the throughputs of its replicas (samples per second, 0: not
measured yet), servers handed the stage but not registered yet counted at the replicas'
mean (:meth:`shared.policy.view.SwarmView.members`); for joins, where every server declared
the compute speed it measured as it joined, those speeds, pending joins at their own
(:meth:`~shared.policy.view.SwarmView.join_members`: as a swarm forms no one has served, and
the throughputs are all 0). Pure logic, standard library only.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shared.policy.move import Move

SAFE_REPLICAS = 2  # a stage with this many replicas survives the loss of one
SLOW_LINK_FRACTION = 0.5  # a declared link under this fraction of the swarm's median is a slow one

Members = Sequence[Sequence[float]]  # per stage, the throughputs of its replicas (pending joins included)


def replica_floor(servers: int, num_stages: int) -> int:
    """The fewest replicas a stage should keep, and a move may leave on its stage: 2 while
    ``servers >= 2 * num_stages``, else 1 (a stage is never emptied)."""
    return max(1, min(SAFE_REPLICAS, servers // num_stages))


def loss_key(members: Sequence[float], stage: int) -> tuple:
    """Sort key of a stage by how badly the loss of one replica would leave it (smallest: worst)."""
    capacity = sum(members)
    left = capacity - max(members) if len(members) >= SAFE_REPLICAS else 0.0
    return (min(len(members), SAFE_REPLICAS), left, capacity, len(members), stage)


def neediest_stage(members: Members, stages: Sequence[int] | None = None, *, strongest: bool = False) -> int:
    """Of ``stages`` (default: all), the stage where the loss of a replica would hurt most:
    see the module's docstring; ``strongest``: of the stages of that need (as many replicas,
    up to ``SAFE_REPLICAS``), the one with the most capacity (then the lowest index), where
    a slow link costs least. Raises ``ValueError`` without stages."""
    candidates = range(len(members)) if stages is None else stages
    if not candidates:
        raise ValueError("no stage to choose from (num_stages must be >= 1)")
    neediest = min(candidates, key=lambda s: loss_key(members[s], s))
    if not strongest:
        return neediest
    need = loss_key(members[neediest], neediest)[0]
    same_need = [s for s in candidates if loss_key(members[s], s)[0] == need]
    return min(same_need, key=lambda s: (-loss_key(members[s], s)[1], -sum(members[s]), s))


def slow_link(link_mbit: float, links: Sequence[float]) -> float | None:
    """The swarm's median link (Mbit/s) when ``link_mbit`` is a slow one: under
    ``SLOW_LINK_FRACTION`` of the median of ``links`` (every replica's and pending join's
    declared link, the joiner's included); else None, and None when the joiner or any of
    them declared none (0): placement then does not know the links."""
    if link_mbit <= 0 or not links or not all(v > 0 for v in links):
        return None
    median = statistics.median(links)
    return median if link_mbit < SLOW_LINK_FRACTION * median else None


def why_needed(members: Members, stage: int, unit: str = "samples/s", *, strongest: bool = False) -> str:
    """Why :func:`neediest_stage` chose ``stage``, in words (for the log and the dashboard);
    ``unit``: what the members count (throughputs, or declared speeds); ``strongest``: it
    chose the stage of that need with the most capacity."""
    count = len(members[stage])
    most = "most" if strongest else "least"
    if count == 0:
        return f"stage {stage} has no replica"
    if count == 1:
        several = sum(1 for m in members if len(m) == 1) > 1
        return f"stage {stage} has one replica: losing it would stop the swarm" + (
            f" (the {most} capacity of such stages, {sum(members[stage]):.3g} {unit})" if several else ""
        )
    left = sum(members[stage]) - max(members[stage])
    return f"stage {stage} would keep the {most} capacity after losing its strongest replica ({left:.3g} {unit})"


@dataclass(frozen=True)
class JoinChoice:
    """Where a joining server goes and why. ``free``: every stage already has
    ``SAFE_REPLICAS`` replicas, so any stage keeps the swarm alive and another rule (the
    network cost model) may place the server instead."""

    stage: int
    reason: str
    free: bool


def join_stage(
    members: Members, unit: str = "samples/s", *, link_mbit: float = 0.0, links: Sequence[float] = ()
) -> JoinChoice:
    """The stage a joining server takes: :func:`neediest_stage` (``unit``: what ``members``
    count); a joiner whose declared link (``link_mbit``) is a :func:`slow_link` among the
    swarm's (``links``: the replicas', the pending joins' and its own) takes the strongest
    stage of that need instead."""
    median = slow_link(link_mbit, links)
    strongest = median is not None and all(len(m) > 0 for m in members)  # an empty stage is filled all the same
    stage = neediest_stage(members, strongest=strongest)
    reason = why_needed(members, stage, unit, strongest=strongest)
    if strongest:
        reason += (
            f"; its {link_mbit:g} Mbit/s link is a slow one (the swarm's median {median:g} Mbit/s): "
            "its step rounds cost least where the stage has compute to spare"
        )
    return JoinChoice(stage, reason, all(len(m) >= SAFE_REPLICAS for m in members))


def standby_stage(members: Members, unit: str = "samples/s") -> JoinChoice | None:
    """The stage a standby server takes now, or None while every stage has ``SAFE_REPLICAS``
    replicas (pending joins counted): a standby replaces what was lost, so a loss that leaves
    a stage one replica, or none, takes it at once (where it would hurt most:
    :func:`join_stage`), and joins placed meanwhile count so that one loss takes one standby."""
    if all(len(m) >= SAFE_REPLICAS for m in members):
        return None
    return join_stage(members, unit)


def repair_move(members: Members, replicas: Mapping[str, tuple[int, float]]) -> Move | None:
    """The move of a replica into a stage short of replicas from a stage with spare, or None.

    A stage is short with fewer than ``min(2, servers // stages)`` replicas (counting every
    replica and pending join in ``members``): no repair while there are fewer servers than
    stages. ``replicas`` (``server_id -> (stage, throughput)``) are the servers that can
    move. The stage to strengthen is the neediest short one; the replica to move is on a
    stage with more than that many and leaves the stage capacities best (the largest
    minimum, then leximin), then its stage has the most replicas, then it is the slowest,
    then the smallest id. The move's capacities are the swarm's minimum stage capacity
    before and after it."""
    counts = [len(m) for m in members]
    floor = min(SAFE_REPLICAS, sum(counts) // len(members))  # what every stage can have
    short = [s for s, count in enumerate(counts) if count < floor]
    if not short:
        return None
    target = neediest_stage(members, short)
    capacity = [sum(m) for m in members]
    best: tuple | None = None
    for server_id, (stage, throughput) in replicas.items():
        if counts[stage] <= floor:
            continue
        moved = list(capacity)
        moved[stage] -= throughput
        moved[target] += throughput
        key = (tuple(-c for c in sorted(moved)), -counts[stage], throughput, server_id)
        if best is None or key < best:
            best = key
    if best is None:
        return None  # the only spare members are pending joins, which cannot move
    server_id = best[-1]
    source = replicas[server_id][0]
    reason = f"{why_needed(members, target)}, while stage {source} has {counts[source]} replicas"
    return Move(server_id, source, target, min(capacity), -best[0][0], reason=reason)


def thinned_stage(current: Mapping[str, int], moves: Sequence[Move], num_stages: int) -> int | None:
    """The first stage that ``moves`` (from the assignment ``current``, ``server_id -> stage``)
    leave below :func:`replica_floor` while it was not, or with fewer replicas when it was; None if none."""
    before = Counter(current.values())
    after = Counter({**current, **{m.server_id: m.to_stage for m in moves}}.values())
    floor = replica_floor(len(current), num_stages)
    for stage in range(num_stages):
        if after[stage] < min(floor, before[stage]):
            return stage
    return None
