"""Unit tests of the rebalancing maths: stage capacities, the best single move, the
hysteresis that orders it, the exhaustive optimum, and where new servers join."""

from __future__ import annotations

import math
import random

import pytest

from services.coordinator.registry import Registry
from shared.policy.move import Move
from shared.policy.resilience import neediest_stage
from shared.policy.throughput import (
    ThroughputRebalancer,
    best_assignment,
    plan_move,
    plan_swap,
    replica_counts,
    stage_capacities,
    weakest_stage,
)


def replicas_of(speeds: list[float], stages: list[int]) -> dict[str, tuple[int, float]]:
    """Replica ``r{i}`` runs at ``speeds[i]`` on ``stages[i]``."""
    return {f"r{i}": (stage, speed) for i, (stage, speed) in enumerate(zip(stages, speeds))}


def apply(replicas: dict[str, tuple[int, float]], move: Move) -> None:
    stage, throughput = replicas[move.server_id]
    assert stage == move.from_stage, "the move starts where the replica is"
    replicas[move.server_id] = (move.to_stage, throughput)


# --- capacities and the joining rule -----------------------------------------------------


def test_stage_capacities_sum_throughput_per_stage():
    assert stage_capacities({"a": (0, 1.0), "b": (0, 2.5), "c": (2, 4.0)}, 3) == [3.5, 0.0, 4.0]


def test_stage_capacities_reject_a_stage_out_of_range():
    with pytest.raises(ValueError, match="num_stages"):
        stage_capacities({"a": (3, 1.0)}, 3)


def test_weakest_stage_breaks_ties_by_fewest_replicas_then_lowest_index():
    assert weakest_stage({"a": (0, 5.0), "b": (1, 2.0), "c": (2, 3.0)}, 3) == 1
    assert weakest_stage({"a": (0, 1.0), "b": (0, 1.0), "c": (1, 2.0)}, 2) == 1  # equal capacity, fewer replicas
    assert weakest_stage({"a": (0, 2.0), "b": (1, 2.0)}, 3) == 2  # empty stage
    assert weakest_stage({"a": (0, 2.0), "b": (1, 2.0)}, 2) == 0


def test_the_registry_hands_out_the_stage_where_a_loss_would_hurt_most():
    rng = random.Random(7)
    for trial in range(20):
        registry = Registry(":memory:", num_stages=3, heartbeat_s=1.0, clock=lambda: 0.0)
        members: list[list[float]] = [[], [], []]
        for i in range(rng.randrange(0, 6)):
            stage, speed = rng.randrange(3), float(rng.choice([0, 1, 2, 4]))
            registry.register(f"s{i}", stage, f"http://h{i}:80", "v", speed, 0)
            members[stage].append(speed)
        assert neediest_stage(members) == registry.assign_stage(), f"trial {trial}: {members}"
        registry.close()


# --- the best single move ----------------------------------------------------------------


def test_moves_one_of_three_equal_replicas_to_the_lone_stage():
    replicas = {"a": (0, 1.0), "b": (0, 1.0), "c": (0, 1.0), "d": (1, 1.0)}
    assert plan_move(replicas, 2) == Move("a", 0, 1, capacity_before=1.0, capacity_after=2.0)


def test_picks_the_move_that_raises_the_minimum_most_then_the_slowest_replica():
    # stage 0: 1 + 2 + 4, stage 1: 1. Moving 1 -> [6, 2]; moving 2 -> [5, 3]; moving 4 -> [3, 5].
    replicas = {"a": (0, 1.0), "b": (0, 2.0), "c": (0, 4.0), "d": (1, 1.0)}
    move = plan_move(replicas, 2)
    assert move == Move("b", 0, 1, capacity_before=1.0, capacity_after=3.0)
    assert move.gain == 3.0


def test_among_equal_minimums_keeps_the_other_stages_strong():
    # capacities [13, 1, 2]: every move into stage 1 leaves a minimum of 2 (stage 2), but
    # moving a 4 gives [9, 5, 2], from which one more move reaches [5, 5, 6].
    speeds, stages = [1, 2, 4, 1, 2, 4, 2], [0, 0, 0, 1, 0, 0, 2]
    assert plan_move(replicas_of(speeds, stages), 3) == Move("r2", 0, 1, capacity_before=1.0, capacity_after=2.0)


def test_never_empties_a_stage():
    assert plan_move({"a": (0, 1.0), "b": (1, 100.0), "c": (2, 5.0)}, 3) is None
    assert plan_move({"a": (0, 10.0), "b": (1, 0.5), "c": (1, 0.5), "d": (2, 9.0)}, 3) is None


def test_no_move_when_balanced_or_when_no_move_raises_the_minimum():
    assert plan_move({"a": (0, 2.0), "b": (0, 2.0), "c": (1, 2.0), "d": (1, 2.0)}, 2) is None
    assert plan_move({"a": (0, 3.0), "b": (1, 1.0), "c": (1, 2.0)}, 2) is None  # tied weakest stages
    # stage 0 (6) is the unique weakest, but any move from stage 1 (7) drops it below 6.
    assert (
        plan_move({"a": (0, 3.0), "b": (0, 3.0), "c": (1, 2.0), "d": (1, 2.0), "e": (1, 2.0), "f": (1, 1.0)}, 2) is None
    )


def test_fills_an_empty_stage_with_infinite_gain():
    move = plan_move({"a": (0, 1.0), "b": (0, 3.0), "c": (1, 2.0)}, 3)
    assert move == Move("a", 0, 2, capacity_before=0.0, capacity_after=1.0)
    assert move.gain == math.inf


def test_gain():
    assert Move("a", 0, 1, 2.0, 3.0).gain == 1.5
    assert Move("a", 0, 1, 0.0, 1.0).gain == math.inf
    assert Move("a", 0, 1, 0.0, 0.0).gain == 1.0


# --- hysteresis ----------------------------------------------------------------------------

MOVE_A = {"a": (0, 1.0), "b": (0, 1.0), "c": (0, 1.0), "d": (1, 1.0)}  # best: a 0 -> 1, gain 2
MOVE_B = {"a": (0, 1.0), "b": (1, 1.0), "c": (1, 1.0), "d": (1, 1.0)}  # best: b 1 -> 0, gain 2
BALANCED = {"a": (0, 1.0), "b": (0, 1.0), "c": (1, 1.0), "d": (1, 1.0)}


def test_a_move_is_ordered_on_its_second_consecutive_confirmation_only():
    rebalancer = ThroughputRebalancer()
    assert rebalancer.check(MOVE_A, 2) == []
    assert rebalancer.check(MOVE_A, 2) == [plan_move(MOVE_A, 2)]
    assert rebalancer.check(MOVE_A, 2) == []  # the count starts again after an order
    assert rebalancer.check(MOVE_A, 2) != []


def test_a_different_best_move_or_no_move_in_between_resets_the_count():
    rebalancer = ThroughputRebalancer()
    for replicas in (MOVE_A, MOVE_B, MOVE_A, BALANCED, MOVE_A):
        assert rebalancer.check(replicas, 2) == []
    assert [m.server_id for m in rebalancer.check(MOVE_A, 2)] == ["a"]


def test_a_move_below_min_gain_is_never_ordered():
    replicas = {"a": (0, 5.0), "b": (0, 1.0), "c": (0, 1.0), "d": (1, 5.0)}  # [7, 5] -> moving b: [6, 6], gain 1.2
    assert plan_move(replicas, 2).gain == pytest.approx(1.2)
    rebalancer = ThroughputRebalancer()
    assert all(rebalancer.check(replicas, 2) == [] for _ in range(5))
    assert ThroughputRebalancer(min_gain=1.1).check(replicas, 2) == []
    assert ThroughputRebalancer(min_gain=1.1, confirmations=1).check(replicas, 2) == [plan_move(replicas, 2)]


def test_rebalancer_rejects_bad_settings():
    with pytest.raises(ValueError, match="min_gain"):
        ThroughputRebalancer(min_gain=0.5)
    with pytest.raises(ValueError, match="confirmations"):
        ThroughputRebalancer(confirmations=0)


def test_noise_on_a_balanced_swarm_orders_no_move():
    speeds = [4.0, 6.0, 5.0, 5.0, 3.0, 7.0, 2.0, 8.0]  # 4 stages x 2 replicas, 10 each
    stages = [0, 0, 1, 1, 2, 2, 3, 3]
    rng = random.Random(1234)
    rebalancer = ThroughputRebalancer()
    for _ in range(200):
        noisy = [speed * rng.uniform(0.9, 1.1) for speed in speeds]
        assert rebalancer.check(replicas_of(noisy, stages), 4) == []


def rebalance(
    replicas: dict[str, tuple[int, float]], rebalancer: ThroughputRebalancer, checks: int = 30, num_stages: int = 3
) -> list[Move]:
    """Check ``checks`` times, applying every ordered move; returns the moves in order."""
    moves = []
    for _ in range(checks):
        for move in rebalancer.check(replicas, num_stages):
            apply(replicas, move)
            moves.append(move)
    return moves


@pytest.mark.parametrize(
    "speeds, stages, min_gain",
    [
        ([1, 2, 4, 1, 2, 4, 1, 2], [0, 0, 0, 0, 0, 0, 1, 2], 1 / 0.75),
        ([1, 2, 4, 1, 2, 4, 2], [0, 0, 0, 1, 0, 0, 2], 1 / 0.75),
        ([1, 2, 4, 4, 2, 1, 4], [2, 2, 2, 2, 2, 0, 1], 1.15),  # its moves gain 4, 1.25, 1.2
    ],
)
def test_repeated_moves_converge_near_the_optimum_then_stop(speeds, stages, min_gain):
    replicas = replicas_of(speeds, stages)
    _, optimum = best_assignment(speeds, 3)
    rebalancer = ThroughputRebalancer(min_gain=min_gain)
    moves = rebalance(replicas, rebalancer)
    assert 1 <= len(moves) <= 3
    assert min(stage_capacities(replicas, 3)) >= 0.95 * optimum
    assert rebalance(replicas, rebalancer, checks=20) == [], "it keeps moving"


def test_the_default_min_gain_can_stop_short_of_the_optimum():
    # [1 | 4 | 1+2+4+2+4] -> [1+4 | 4 | 9]; the next move ([5 | 6 | 7]) gains only 1.25 < 1/0.75,
    # so the swarm stays at 4 where 6 ([4+1+1 | 4+2 | 4+2]) is possible: hysteresis wins.
    speeds, stages = [1, 2, 4, 4, 2, 1, 4], [2, 2, 2, 2, 2, 0, 1]
    replicas = replicas_of(speeds, stages)
    assert len(rebalance(replicas, ThroughputRebalancer())) == 1
    assert stage_capacities(replicas, 3) == [5.0, 4.0, 9.0]
    assert best_assignment(speeds, 3)[1] == 6.0


# --- the exhaustive optimum ----------------------------------------------------------------


@pytest.mark.parametrize(
    "speeds, num_stages, stages, capacity",
    [
        ([1.0, 2.0, 3.0], 2, [0, 0, 1], 3.0),  # [1 + 2 | 3]
        ([5.0, 1.0, 1.0, 1.0], 2, [0, 1, 1, 1], 3.0),  # [5 | 1 + 1 + 1]
        ([4.0, 4.0, 1.0], 3, [0, 1, 2], 1.0),  # one replica per stage
        ([1.0, 2.0, 4.0, 1.0, 2.0, 4.0], 3, [0, 0, 1, 0, 0, 2], 4.0),  # [1 + 2 + 1 + 2 | 4 | 4]
    ],
)
def test_best_assignment_on_hand_checked_cases(speeds, num_stages, stages, capacity):
    assert best_assignment(speeds, num_stages) == (stages, capacity)


def test_best_assignment_needs_a_replica_per_stage():
    with pytest.raises(ValueError, match="num_stages"):
        best_assignment([1.0, 2.0], 3)


# --- exchanges where every stage is at its replica floor --------------------------------------

HETERO_SPEEDS = [1.0, 1.0, 2.0, 2.0, 2.0, 4.0, 4.0, 4.0]  # the arena's heterogeneous CPU caps


def test_a_pairing_of_slow_with_slow_is_undone_by_exchanges_no_single_move_can_make():
    """8 servers on 4 stages (floor 2): no single move may leave a stage one replica, so
    placed as they came ({1,1} on one stage) only exchanges raise the weakest stage; they
    reach the optimum's minimum (4 of the 20 units) and stop, every stage keeping 2."""
    replicas = replicas_of(HETERO_SPEEDS, [0, 0, 1, 1, 2, 2, 3, 3])  # capacities 2, 4, 6, 8
    assert plan_move(replicas, 4) is None
    swap = plan_swap(replicas, 4)
    assert swap is not None and swap[0].to_stage == 0 and swap[1].from_stage == 0
    assert swap[0].capacity_before == 2.0 and swap[0].gain >= 1 / 0.75
    moves = rebalance(replicas, ThroughputRebalancer(), num_stages=4)
    assert 2 <= len(moves) <= 6 and len(moves) % 2 == 0
    assert replica_counts(replicas, 4) == [2, 2, 2, 2]
    _, optimum = best_assignment(HETERO_SPEEDS, 4)  # any counts: {4,1} {4,1} {4,2} {2,2}, no stage reaches 5
    assert optimum == 4.0 and min(stage_capacities(replicas, 4)) == optimum
    assert rebalance(replicas, ThroughputRebalancer(), num_stages=4) == [], "it keeps moving"


def test_an_exchange_is_confirmed_like_a_move_and_ordered_as_two_moves_together():
    replicas = replicas_of(HETERO_SPEEDS, [0, 0, 1, 1, 2, 2, 3, 3])
    rebalancer = ThroughputRebalancer()
    assert rebalancer.check(replicas, 4) == []
    moves = rebalancer.check(replicas, 4)
    assert moves == list(plan_swap(replicas, 4)) and len(moves) == 2
    assert {moves[0].server_id, moves[1].server_id} <= set(replicas)
    assert (moves[0].from_stage, moves[0].to_stage) == (moves[1].to_stage, moves[1].from_stage)


@pytest.mark.parametrize(
    "replicas",
    [
        replicas_of([1.0, 1.0, 1.0, 1.0], [0, 0, 1, 1]),  # equal speeds: an exchange changes nothing
        replicas_of([1.0, 3.0, 2.0, 2.0], [0, 0, 1, 1]),  # tied weakest stages
        replicas_of([3.0, 3.0, 3.5, 3.5], [0, 0, 1, 1]),  # the best exchange gains less than min_gain
    ],
)
def test_no_exchange_without_a_gain_worth_two_state_downloads(replicas):
    rebalancer = ThroughputRebalancer()
    assert all(rebalancer.check(replicas, 2) == [] for _ in range(4))
