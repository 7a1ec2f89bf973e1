"""The resilience rule (shared/policy/resilience.py) and how the policy applies it: a joiner
goes where a loss would hurt most, a stage short of replicas gets one from a stage with
spare, and while the swarm has two servers a stage no move leaves a stage with one."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.policy.move import Move
from shared.policy.rebalancing import RebalancingPolicy
from shared.policy.resilience import (
    join_stage,
    neediest_stage,
    repair_move,
    replica_floor,
    slow_link,
    standby_stage,
    thinned_stage,
)
from shared.policy.throughput import ThroughputRebalancer, plan_move, plan_swap
from shared.policy.view import PlacementInputs, Replica, SwarmView
from shared.topology import Peer, Replan, Workload, world_network


def view_of(*replicas: tuple[str, int, float], num_stages: int, pending: tuple[int, ...] = ()) -> SwarmView:
    return SwarmView(num_stages, tuple(Replica(sid, stage, speed) for sid, stage, speed in replicas), pending)


# --- where a loss would hurt most --------------------------------------------------------------


def test_the_floor_is_two_replicas_once_the_swarm_has_two_servers_a_stage():
    assert [replica_floor(n, 4) for n in (0, 3, 4, 7, 8, 20)] == [1, 1, 1, 1, 2, 2]


def test_an_empty_stage_first_then_one_replica_then_the_least_left_after_a_loss():
    assert neediest_stage([[5.0], [], [0.1]]) == 1  # empty
    assert neediest_stage([[5.0, 5.0], [4.0], [0.1, 0.1, 0.1]]) == 1  # one replica, although the strongest
    assert neediest_stage([[3.0], [1.0], [0.5, 0.5]]) == 1  # the weaker of the one-replica stages
    # two each: the weakest stage (least capacity) is 0, but losing a replica leaves stage 1 weaker
    assert neediest_stage([[3.0, 3.0], [6.0, 1.0]]) == 1
    # unmeasured servers (0 samples/s): the fewest replicas, then the lowest index
    assert neediest_stage([[0.0, 0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]) == 1
    assert neediest_stage([[1.0], [], []], stages=[0, 2]) == 2
    with pytest.raises(ValueError, match="no stage"):
        neediest_stage([])


def test_a_join_says_why_and_whether_the_network_may_choose():
    choice = join_stage([[1.0], [], [1.0]])
    assert (choice.stage, choice.reason, choice.free) == (1, "stage 1 has no replica", False)
    assert "one replica" in join_stage([[1.0, 1.0], [2.0]]).reason
    choice = join_stage([[3.0, 3.0], [6.0, 1.0]])
    assert choice.stage == 1 and choice.free and "after losing its strongest replica (1 samples/s)" in choice.reason


def test_a_slow_link_is_one_under_half_the_swarms_median_and_only_where_every_server_declared_one():
    assert slow_link(10.0, [10.0, 20.0, 50.0, 100.0]) == 35.0  # median 35: 10 < 17.5
    assert slow_link(20.0, [10.0, 20.0, 50.0, 100.0]) is None  # 20 >= 17.5
    assert slow_link(10.0, [10.0, 100.0, 100.0]) == 100.0
    assert slow_link(10.0, [10.0, 0.0, 100.0]) is None  # a server that declared none: links unknown
    assert slow_link(0.0, [0.0, 100.0]) is None  # the joiner declared none
    assert slow_link(10.0, [10.0]) is None  # alone: its own median


def test_a_slow_link_joins_the_strongest_stage_of_its_need_never_before_an_empty_one():
    one_each = [[4.0], [4.5], [2.0]]  # three stages with one replica: the 2.0 one is the neediest
    assert join_stage(one_each).stage == 2
    choice = join_stage(one_each, link_mbit=10.0, links=[100.0, 50.0, 100.0, 10.0])
    assert choice.stage == 1 and "most capacity of such stages" in choice.reason
    assert "10 Mbit/s link is a slow one (the swarm's median 75 Mbit/s)" in choice.reason
    fast = join_stage(one_each, link_mbit=100.0, links=[100.0, 50.0, 100.0, 100.0])
    assert fast.stage == 2 and "least capacity" in fast.reason  # a fast link: as before
    # need first: an empty stage, and a stage with one replica before any with two
    assert join_stage([[4.0], [], [2.0]], link_mbit=10.0, links=[100.0, 100.0, 10.0]).stage == 1
    assert join_stage([[4.0, 4.0], [1.0]], link_mbit=10.0, links=[100.0, 100.0, 100.0, 10.0]).stage == 1
    # two replicas each: the most left after losing the strongest (stage 0: 3 left, stage 1: 1)
    assert join_stage([[3.0, 3.0], [6.0, 1.0]], link_mbit=10.0, links=[100.0] * 4 + [10.0]).stage == 0


@pytest.mark.parametrize("num_stages, servers", [(4, 8), (3, 7), (1, 3), (5, 4)])
def test_joiners_fill_every_stage_before_any_gets_a_second_replica(num_stages, servers):
    """One by one (each registers before the next asks) or all at once (each asks before any
    registers: the hand-outs count as pending joins), the same stages, round-robin."""
    one_by_one: list[tuple[str, int, float]] = []
    for i in range(servers):
        one_by_one.append((f"s{i}", view_of(*one_by_one, num_stages=num_stages).join_stage().stage, 0.0))
    together: tuple[int, ...] = ()
    for _ in range(servers):
        together += (view_of(num_stages=num_stages, pending=together).join_stage().stage,)
    expected = [i % num_stages for i in range(servers)]
    assert [stage for _, stage, _ in one_by_one] == list(together) == expected


# --- repairs ------------------------------------------------------------------------------------


def test_a_lone_replica_gets_a_partner_from_a_stage_with_three():
    members = [[1.0, 1.0, 4.0], [2.0], [1.0, 1.0], [1.0, 1.0]]  # eight servers, stage 1 has one
    replicas = {"a": (0, 1.0), "b": (0, 1.0), "c": (0, 4.0), "d": (1, 2.0)}
    replicas |= {"e": (2, 1.0), "f": (2, 1.0), "g": (3, 1.0), "h": (3, 1.0)}
    move = repair_move(members, replicas)
    assert move == Move("a", 0, 1, capacity_before=2.0, capacity_after=2.0)  # the slowest of stage 0's: c stays
    assert "stage 1 has one replica" in move.reason and "stage 0 has 3 replicas" in move.reason


def test_an_empty_stage_gets_a_replica_and_a_pending_join_counts():
    replicas = {"a": (0, 0.0), "b": (0, 0.0), "c": (1, 0.0)}
    assert repair_move([[0.0, 0.0], [0.0], []], replicas) == Move("a", 0, 2, 0.0, 0.0)
    assert repair_move([[0.0, 0.0], [0.0], [0.0]], replicas) is None  # a server was handed stage 2
    # fewer servers than two a stage: a single replica is all a stage can have
    assert repair_move([[1.0, 1.0], [1.0], [1.0]], {"a": (0, 1.0), "b": (0, 1.0), "c": (1, 1.0), "d": (2, 1.0)}) is None
    # fewer servers than stages: nothing to repair
    assert repair_move([[1.0], [], []], {"a": (0, 1.0)}) is None


def test_thinned_stage_flags_a_plan_that_leaves_a_stage_below_the_floor():
    current = {"a": 0, "b": 0, "c": 1, "d": 1}  # two servers a stage: the floor is 2
    assert thinned_stage(current, [Move("a", 0, 1)], 2) == 0
    assert thinned_stage(current, [Move("a", 0, 1), Move("c", 1, 0)], 2) is None  # a swap keeps two each
    assert thinned_stage({"a": 0, "b": 0, "c": 1}, [Move("a", 0, 1)], 2) is None  # three servers: one may stay
    assert thinned_stage({"a": 0, "b": 1}, [Move("a", 0, 1)], 2) == 0  # never empty a stage


# --- the policy ---------------------------------------------------------------------------------


def test_no_throughput_move_leaves_a_stage_with_one_replica_and_the_policy_says_why():
    # stage 0 {2, 2}, stage 1 {2, 9}: moving c to stage 0 would give [6 | 9] but leave stage 1
    # one replica; no exchange raises stage 0 (d for a or b leaves stage 1 at 4)
    uneven = {"a": (0, 2.0), "b": (0, 2.0), "c": (1, 2.0), "d": (1, 9.0)}
    assert plan_move(uneven, 2) is None and plan_swap(uneven, 2) is None
    assert plan_move(uneven, 2, floor=1) == Move("c", 1, 0, 4.0, 6.0)  # what it would do without the floor
    policy = RebalancingPolicy(ThroughputRebalancer(confirmations=1))
    view = view_of(("a", 0, 2.0), ("b", 0, 2.0), ("c", 1, 2.0), ("d", 1, 9.0), num_stages=2)
    assert policy.check(view) == []
    assert policy.held == (
        "not moving c to stage 0: stage 1 would keep fewer than 2 replicas, and the swarm has that many a stage"
    )
    # with a third replica on stage 1, one may move, and the move says why
    (move,) = policy.check(dataclasses.replace(view, replicas=view.replicas + (Replica("e", 1, 2.0),)))
    assert move == Move("c", 1, 0, 4.0, 6.0) and policy.held is None
    assert move.reason == "raises the weakest stage's capacity (stage 0) from 4 to 6 samples/s"


def test_where_no_move_may_leave_a_stage_one_replica_an_exchange_pairs_fast_with_slow():
    fast_and_slow = view_of(("a", 0, 10.0), ("b", 0, 10.0), ("c", 1, 1.0), ("d", 1, 1.0), num_stages=2)
    policy = RebalancingPolicy(ThroughputRebalancer(confirmations=1))
    moves = policy.check(fast_and_slow)
    assert moves == [Move("a", 0, 1, 2.0, 11.0), Move("c", 1, 0, 2.0, 11.0)] and policy.held is None
    assert (
        moves[0].reason
        == "an exchange of a (stage 0) with c (stage 1) raises the weakest stage's capacity from 2 to 11 samples/s"
    )


def test_a_repair_is_confirmed_on_two_checks_and_comes_before_the_throughput_rule():
    lopsided = view_of(("a", 0, 1.0), ("b", 0, 1.0), ("c", 0, 1.0), ("d", 1, 9.0), num_stages=2)
    policy = RebalancingPolicy(ThroughputRebalancer(confirmations=1))
    assert policy.check(lopsided) == []  # the throughput rule waits while a stage is short
    (move,) = policy.check(lopsided)
    assert move == Move("a", 0, 1, 3.0, 2.0)  # the minimum capacity falls: staying alive comes first
    assert policy.check(dataclasses.replace(lopsided, pending=(1,))) == []  # a server is on its way to stage 1


class ScriptedTopology:
    def __init__(self, replan: Replan):
        self.replan = replan

    def check(self, inputs: PlacementInputs, num_stages: int) -> Replan:
        return self.replan


def test_a_held_topology_replan_gives_way_to_an_exchange_confirmed_on_consecutive_held_checks():
    """With two servers a stage the planner's moves would thin a stage, so it never moves
    anything; a slow pair is then split by the throughput rule's exchange, which keeps the counts."""
    current = {"a": 0, "b": 0, "c": 1, "d": 1}
    speeds = {"a": 10.0, "b": 10.0, "c": 1.0, "d": 1.0}
    peers = [Peer(sid, "Ohio", 1.0) for sid in current]
    inputs = PlacementInputs(peers, world_network(), Workload(32, 1e-6, 1e-3, 10.0), current)
    view = dataclasses.replace(
        view_of(*((sid, stage, speeds[sid]) for sid, stage in current.items()), num_stages=2), topology=inputs
    )
    thinning = Replan({**current, "a": 1}, [Move("a", 0, 1)], {}, 2.0, 1.0)
    scripted = ScriptedTopology(thinning)
    policy = RebalancingPolicy(topology=scripted)
    assert policy.check(view) == [] and policy.held.startswith("not replanning: stage 0 would keep fewer")
    moves = policy.check(view)  # the exchange's second consecutive confirmation
    assert moves == [Move("a", 0, 1, 2.0, 11.0), Move("c", 1, 0, 2.0, 11.0)]
    assert policy.held.endswith("; exchanging two replicas instead") and policy.replan is None
    # a check whose replan is not held (here: no replan) breaks the streak
    assert policy.check(view) == []
    scripted.replan = None
    assert policy.check(view) == []
    scripted.replan = thinning
    assert policy.check(view) == [], "an exchange confirmed across a check that did not hold it"


def test_a_topology_replan_that_leaves_a_stage_with_one_replica_is_not_ordered():
    current = {"a": 0, "b": 0, "c": 1, "d": 1}
    peers = [Peer(sid, "Ohio", 1.0) for sid in current]
    inputs = PlacementInputs(peers, world_network(), Workload(32, 1e-6, 1e-3, 10.0), current)
    view = dataclasses.replace(
        view_of(*((sid, stage, 1.0) for sid, stage in current.items()), num_stages=2), topology=inputs
    )
    thinning = Replan({**current, "a": 1}, [Move("a", 0, 1)], {}, 2.0, 1.0)
    policy = RebalancingPolicy(topology=ScriptedTopology(thinning))
    assert policy.check(view) == [] and policy.replan is None
    assert (
        policy.held == "not replanning: stage 0 would keep fewer than 2 replicas, and the swarm has that many a stage"
    )
    swap = Replan({**current, "a": 1, "c": 0}, [Move("a", 0, 1), Move("c", 1, 0)], {}, 2.0, 1.0)
    moves = RebalancingPolicy(topology=ScriptedTopology(swap)).check(view)
    assert moves == [Move("a", 0, 1), Move("c", 1, 0)]
    assert moves[0].reason == "the network cost model predicts 2 -> 1 s per step"


swarms = st.integers(1, 4).flatmap(
    lambda num_stages: st.tuples(
        st.just(num_stages),
        st.lists(st.tuples(st.integers(0, num_stages - 1), st.sampled_from([0.0, 0.5, 1.0, 3.0])), max_size=12),
    )
)


@settings(max_examples=300, deadline=None)
@given(swarms)
def test_no_check_leaves_a_stage_below_the_floor_and_repairs_reach_it(swarm):
    """Whatever the swarm, no check's moves (ordered together: a move, or an exchange of two
    replicas) leave a stage below the floor or take one already below it lower, and ordering
    its moves until none comes reaches a placement where every stage has the floor."""
    num_stages, placed = swarm
    replicas = {f"s{i}": (stage, speed) for i, (stage, speed) in enumerate(placed)}
    floor = replica_floor(len(replicas), num_stages)
    policy = RebalancingPolicy(ThroughputRebalancer(confirmations=1), repair_confirmations=1)
    for _ in range(4 * len(replicas) + 1):
        view = view_of(*((sid, stage, speed) for sid, (stage, speed) in replicas.items()), num_stages=num_stages)
        moves = policy.check(view)
        if not moves:
            break
        before = view.replica_counts()
        for move in moves:
            assert replicas[move.server_id][0] == move.from_stage, (move, replicas)
            replicas[move.server_id] = (move.to_stage, replicas[move.server_id][1])
        after = [sum(stage == s for stage, _ in replicas.values()) for s in range(num_stages)]
        assert all(a >= min(floor, b) for a, b in zip(after, before)), (moves, before, after)
    counts = [sum(stage == s for stage, _ in replicas.values()) for s in range(num_stages)]
    if len(replicas) >= num_stages:
        assert min(counts) >= floor, counts


def test_a_standby_waits_while_every_stage_has_two_replicas_then_goes_where_a_loss_hurts_most():
    assert standby_stage([[1.0, 1.0], [2.0, 1.0, 1.0]]) is None
    choice = standby_stage([[1.0, 1.0], [2.0], []])
    assert choice is not None and choice.stage == 2 and "no replica" in choice.reason
    assert standby_stage([[1.0, 1.0], [2.0]]).stage == 1
    assert standby_stage([[1.0], [2.0]]).stage == 0  # fewer servers than two a stage: every standby is taken
