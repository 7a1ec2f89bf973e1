"""The throughput rule: stage capacities, the weakest stage, the best single move, and the best exchange.

A swarm runs at the speed of its weakest stage, whose capacity is the sum of its
replicas' throughputs. ``replicas`` maps ``server_id -> (stage, throughput)``; a
replica's throughput is taken to be the same on every stage (the partition balances the
stages' work). Pure logic, no I/O.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from shared.policy.hysteresis import Confirmation
from shared.policy.move import Move
from shared.policy.resilience import replica_floor

Replicas = Mapping[str, tuple[int, float]]
DEFAULT_MIN_GAIN = 1 / 0.75  # moving costs a state download: only a clear gain is worth it


def weakest(capacities: Sequence[float], replicas: Sequence[int]) -> int | None:
    """THE weakest-stage rule: the stage with the least capacity, then the fewest replicas,
    then the lowest index (``capacities[i]`` and ``replicas[i]`` are stage ``i``'s); ``None``
    without stages. The swarm waits on this stage (a new server joins where a loss would
    hurt most: :func:`shared.policy.resilience.join_stage`)."""
    if len(capacities) != len(replicas):
        raise ValueError(f"{len(capacities)} capacities for {len(replicas)} replica counts: one of each per stage")
    if not capacities:
        return None
    return min(range(len(capacities)), key=lambda stage: (capacities[stage], replicas[stage], stage))


def stage_capacities(replicas: Replicas, num_stages: int) -> list[float]:
    """Sum of the replicas' throughputs per stage, stages ``0..num_stages-1`` in order.

    Raises ``ValueError`` when a replica's stage is outside ``[0, num_stages)``.
    """
    capacity = [0.0] * num_stages
    for server_id, (stage, throughput) in replicas.items():
        if not 0 <= stage < num_stages:
            raise ValueError(f"replica {server_id!r} is on stage {stage}, outside [0, {num_stages}) (num_stages)")
        capacity[stage] += throughput
    return capacity


def replica_counts(replicas: Replicas, num_stages: int) -> list[int]:
    """Replicas per stage, stages ``0..num_stages-1`` in order."""
    counts = [0] * num_stages
    for stage, _ in replicas.values():
        counts[stage] += 1
    return counts


def weakest_stage(replicas: Replicas, num_stages: int) -> int:
    """:func:`weakest` of these replicas' stages (``num_stages >= 1``)."""
    stage = weakest(stage_capacities(replicas, num_stages), replica_counts(replicas, num_stages))
    assert stage is not None, "num_stages must be >= 1"
    return stage


def plan_move(replicas: Replicas, num_stages: int, floor: int | None = None) -> Move | None:
    """The single move of one replica to another stage that raises the minimum capacity most.

    Only a move into the weakest stage can raise the minimum, and only when that stage is
    the unique weakest one (if two stages tie for weakest, one move leaves the other at
    the minimum): so there is no move when the weakest stage is tied. No move leaves its
    stage with fewer than ``floor`` replicas (default :func:`~shared.policy.resilience.replica_floor`:
    2 while the swarm has two servers a stage, else 1, so no stage is emptied). Returns
    ``None`` when no move raises the minimum strictly.

    Among the moves that raise it, the choice is deterministic: the largest minimum
    capacity after the move; then the leximin-best capacities after it (the sorted
    capacities compared weakest first, so that a tie leaves the other stages as strong as
    possible and no new tie for weakest blocks the next move); then the smallest moved
    throughput (the slowest replica that does the job); then the smallest ``server_id``.
    O(replicas x stages log stages).
    """
    capacity = stage_capacities(replicas, num_stages)
    counts = replica_counts(replicas, num_stages)
    floor = replica_floor(len(replicas), num_stages) if floor is None else floor
    before = min(capacity, default=0.0)
    lowest = [stage for stage in range(num_stages) if capacity[stage] == before]
    if len(lowest) != 1:
        return None
    (target,) = lowest
    best: tuple[tuple[float, ...], float, str] | None = None  # the sort key of the best move so far
    for server_id, (stage, throughput) in replicas.items():
        if stage == target or counts[stage] <= floor:
            continue
        after = _capacities_after(capacity, stage, target, throughput)
        key = (tuple(-c for c in after), throughput, server_id)
        if after[0] > before and (best is None or key < best):
            best = key
    if best is None:
        return None
    server_id, after = best[2], -best[0][0]
    reason = f"raises the weakest stage's capacity (stage {target}) from {before:.3g} to {after:.3g} samples/s"
    return Move(server_id, replicas[server_id][0], target, before, after, reason=reason)


def _capacities_after(capacity: list[float], from_stage: int, to_stage: int, throughput: float) -> list[float]:
    """The stage capacities, weakest first, once ``throughput`` moves from one stage to the other."""
    moved = list(capacity)
    moved[from_stage] -= throughput
    moved[to_stage] += throughput
    return sorted(moved)


def plan_swap(replicas: Replicas, num_stages: int) -> tuple[Move, Move] | None:
    """The exchange of a replica of the weakest stage with a faster one of another stage that
    raises the minimum capacity most: what the throughput rule does where no single move
    can, every stage being at its replica floor (two servers a stage: a pairing of slow with
    slow that a move cannot undo without leaving a stage one replica). As :func:`plan_move`:
    none while the weakest stage is tied; the largest minimum after it, then the leximin-best
    capacities, then the smallest exchanged throughput, then the smallest ids. Returns the
    two moves (the faster replica's into the weakest stage first), each with the swarm's
    minimum capacity before and after the exchange, or ``None`` (also while a replica has not
    measured its speed: two state downloads are not spent on a guess). O(replicas^2 x stages log stages)."""
    if any(speed <= 0 for _, speed in replicas.values()):
        return None
    capacity = stage_capacities(replicas, num_stages)
    before = min(capacity, default=0.0)
    lowest = [stage for stage in range(num_stages) if capacity[stage] == before]
    if len(lowest) != 1:
        return None
    (target,) = lowest
    best: tuple | None = None
    for slow, (slow_stage, slow_speed) in replicas.items():
        if slow_stage != target:
            continue
        for fast, (fast_stage, fast_speed) in replicas.items():
            if fast_stage == target or fast_speed <= slow_speed:
                continue
            after = _capacities_after(capacity, fast_stage, target, fast_speed - slow_speed)
            key = (tuple(-c for c in after), fast_speed - slow_speed, fast, slow)
            if after[0] > before and (best is None or key < best):
                best = key
    if best is None:
        return None
    fast, slow, after = best[2], best[3], -best[0][0]
    fast_stage = replicas[fast][0]
    reason = (
        f"an exchange of {fast} (stage {fast_stage}) with {slow} (stage {target}) raises the weakest stage's "
        f"capacity from {before:.3g} to {after:.3g} samples/s"
    )
    return (
        Move(fast, fast_stage, target, before, after, reason=reason),
        Move(slow, target, fast_stage, before, after, reason=reason),
    )


def _same_moves(earlier: tuple[Move, ...], later: tuple[Move, ...]) -> bool:
    return len(earlier) == len(later) and all(a.same_as(b) for a, b in zip(earlier, later))


class ThroughputRebalancer:
    """Orders moves only once they have been the best, and good enough, on consecutive checks.

    The candidate of a check is :func:`plan_move`'s best move if its ``gain >= min_gain``;
    else :func:`plan_swap`'s exchange if its gain is (two moves ordered together). Moves are
    returned only when the same candidate (same replicas, from and to stages) was found on
    ``confirmations`` consecutive calls of :meth:`check`. A check without a candidate, or
    with a different one, starts the count again (a different candidate counts as its own
    first confirmation); returning moves also resets it. ``held``: after a check without a
    candidate, the single move that would have qualified but for
    :func:`~shared.policy.resilience.replica_floor` (it would leave its stage with one
    replica), else ``None``.
    """

    def __init__(self, min_gain: float = DEFAULT_MIN_GAIN, confirmations: int = 2):
        if not min_gain >= 1:
            raise ValueError(f"min_gain must be >= 1 (a ratio of minimum capacities), got {min_gain}")
        self.min_gain = min_gain
        self._confirmation: Confirmation[tuple[Move, ...]] = Confirmation(confirmations, same=_same_moves)
        self.held: Move | None = None

    @property
    def confirmations(self) -> int:
        return self._confirmation.confirmations

    def reset(self) -> None:
        """Forget the candidate seen so far (a check that did not ask this rule breaks the streak)."""
        self._confirmation.reset()

    def check(self, replicas: Replicas, num_stages: int) -> list[Move]:
        """Plan on the current throughputs; the moves to order now (often none)."""
        candidate: tuple[Move, ...] | None = None
        move = plan_move(replicas, num_stages)
        if move is not None and move.gain >= self.min_gain:
            candidate = (move,)
        else:
            swap = plan_swap(replicas, num_stages)
            if swap is not None and swap[0].gain >= self.min_gain:
                candidate = swap
        self.held = None
        if candidate is None and replica_floor(len(replicas), num_stages) > 1:
            unguarded = plan_move(replicas, num_stages, floor=1)
            if unguarded is not None and unguarded.gain >= self.min_gain:
                self.held = unguarded
        confirmed = self._confirmation.observe(candidate)
        return [] if confirmed is None else list(confirmed[-1])


def best_assignment(throughputs: list[float], num_stages: int) -> tuple[list[int], float]:
    """The assignment of replicas to stages with the largest minimum stage capacity.

    Exhaustive over all ``num_stages ** len(throughputs)`` assignments with every stage
    non-empty, so for small inputs only (benchmarks, tests). Returns ``(stage of each
    replica, that minimum capacity)``; among optima, the first in lexicographic order of
    the stage list. Raises ``ValueError`` unless ``1 <= num_stages <= len(throughputs)``.
    """
    if not 1 <= num_stages <= len(throughputs):
        raise ValueError(f"{len(throughputs)} replicas cannot fill {num_stages} stages (num_stages)")
    best: tuple[list[int], float] | None = None
    for stages in itertools.product(range(num_stages), repeat=len(throughputs)):
        capacity = [0.0] * num_stages
        counts = [0] * num_stages
        for stage, throughput in zip(stages, throughputs):
            capacity[stage] += throughput
            counts[stage] += 1
        if min(counts) > 0 and (best is None or min(capacity) > best[1]):
            best = (list(stages), min(capacity))
    assert best is not None, "some assignment fills every stage when replicas >= stages"
    return best
