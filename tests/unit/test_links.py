"""Slow links out of the weakest stage (shared/policy/links.py): the exchange of two
replicas of about one speed, and the policy's order of it."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.policy.links import link_exchange
from shared.policy.rebalancing import RebalancingPolicy
from shared.policy.resilience import slow_link
from shared.policy.view import Replica, SwarmView

# The heterogeneous arena formed with its 10 Mbit/s 2-unit peer asking first of the 2-unit
# ones (declared GFLOP/s of run h12): it filled the empty stage 3, whose round it held to
# 0.8-0.9 s a step; the 100 Mbit/s 2-unit peer went beside a 4-unit one.
FORCED = (
    ("s5", 0, 41.2, 20.0),
    ("s1", 0, 10.1, 20.0),
    ("s6", 1, 40.8, 50.0),
    ("s0", 1, 10.3, 100.0),
    ("s7", 2, 40.7, 100.0),
    ("s4", 2, 19.6, 100.0),
    ("s2", 3, 18.8, 10.0),
    ("s3", 3, 19.3, 50.0),
)


def view(replicas, num_stages: int = 4, pending: tuple[int, ...] = ()) -> SwarmView:
    return SwarmView(
        num_stages,
        tuple(Replica(sid, stage, 0.0, speed=speed, link_mbit=link) for sid, stage, speed, link in replicas),
        pending=pending,
    )


def exchanged(replicas, moves) -> tuple:
    to = {m.server_id: m.to_stage for m in moves}
    return tuple((sid, to.get(sid, stage), speed, link) for sid, stage, speed, link in replicas)


def test_the_slow_link_of_the_weakest_stage_changes_places_with_a_fast_one_of_its_speed():
    into, out = link_exchange(view(FORCED))
    assert (into.server_id, into.from_stage, into.to_stage) == ("s4", 2, 3)  # the fast one joins first
    assert (out.server_id, out.from_stage, out.to_stage) == ("s2", 3, 2)
    assert "s2 (stage 3, 10 Mbit/s, a slow link: the swarm's median 50 Mbit/s)" in into.reason
    assert into.reason == out.reason
    assert link_exchange(view(exchanged(FORCED, (into, out)))) is None  # once is enough
    # a run where the fast 2-unit peer declared 16.0 GFLOP/s and the slow one 20.4 (identical caps)
    noisy = tuple({"s4": ("s4", 2, 16.0, 100.0), "s2": ("s2", 3, 20.4, 10.0)}.get(r[0], r) for r in FORCED)
    assert [m.server_id for m in link_exchange(view(noisy))] == ["s4", "s2"]


def test_no_exchange_without_every_link_and_speed_or_while_joins_are_pending_or_speeds_differ():
    undeclared = (("s5", 0, 41.2, 0.0), *FORCED[1:])
    assert link_exchange(view(undeclared)) is None
    no_speed = (("s5", 0, 0.0, 20.0), *FORCED[1:])  # and no throughput measured either
    assert link_exchange(view(no_speed)) is None
    assert link_exchange(view(FORCED, pending=(1,))) is None
    # the fast 2-unit peer replaced by a 4-unit one: no partner of about the slow one's speed
    unlike = tuple(r if r[0] != "s4" else ("s4", 2, 40.0, 100.0) for r in FORCED)
    assert link_exchange(view(unlike)) is None
    # the slow peer beside a 4-unit one already (h15's placement): nothing to do
    placed = exchanged(FORCED, link_exchange(view(FORCED)))
    assert link_exchange(view(placed)) is None


def test_only_as_the_swarm_forms():
    """Once a replica has served (a throughput measured), a move costs a resync stall: no
    exchange, with declared speeds or with measured throughputs."""
    served = SwarmView(
        4, tuple(Replica(sid, stage, 1.0, speed=speed, link_mbit=link) for sid, stage, speed, link in FORCED)
    )
    assert link_exchange(served) is None
    measured = SwarmView(
        4, tuple(Replica(sid, stage, speed / 10, link_mbit=link) for sid, stage, speed, link in FORCED)
    )
    assert link_exchange(measured) is None
    assert link_exchange(view(FORCED)) is not None  # the same swarm as it forms


def test_the_policy_orders_a_link_exchange_at_once_and_in_turn_after_any_repair():
    policy = RebalancingPolicy()
    moves = policy.check(view(FORCED))
    assert [m.server_id for m in moves] == ["s4", "s2"] and policy.in_turn
    assert policy.check(view(exchanged(FORCED, moves))) == [] and not policy.in_turn
    # a stage with one replica while the swarm has two a stage: the repair comes first
    short = tuple(r if r[0] != "s3" else ("s3", 2, 19.3, 50.0) for r in FORCED)
    assert [m.to_stage for m in RebalancingPolicy(repair_confirmations=1).check(view(short))] == [3]


SPEEDS = st.sampled_from([10.0, 18.0, 20.0, 22.0, 40.0])
LINKS = st.sampled_from([5.0, 10.0, 20.0, 50.0, 100.0])


@settings(max_examples=300, deadline=None)
@given(
    st.integers(2, 4).flatmap(
        lambda stages: st.tuples(
            st.just(stages),
            st.lists(st.tuples(st.integers(0, stages - 1), SPEEDS, LINKS), min_size=stages, max_size=10),
        )
    )
)
def test_exchanges_end_keep_every_stage_count_and_never_take_a_slow_link_into_the_weakest_stage(case):
    stages, drawn = case
    replicas = tuple((f"r{i}", stage, speed, link) for i, (stage, speed, link) in enumerate(drawn))
    links = [link for *_, link in replicas]
    counts = sorted(sum(1 for r in replicas if r[1] == s) for s in range(stages))
    for _ in range(len(replicas) + 1):
        moves = link_exchange(view(replicas, stages))
        if moves is None:
            break
        into, out = moves
        by_id = {r[0]: r for r in replicas}
        assert into.to_stage == out.from_stage and out.to_stage == into.from_stage
        assert slow_link(by_id[out.server_id][3], links) is not None
        assert slow_link(by_id[into.server_id][3], links) is None
        replicas = exchanged(replicas, moves)
        assert sorted(sum(1 for r in replicas if r[1] == s) for s in range(stages)) == counts
    else:
        raise AssertionError(f"exchanges did not end: {replicas}")
