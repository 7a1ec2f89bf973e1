"""The placement policy (shared/policy): one weakest-stage rule, one Move, one entry point
``RebalancingPolicy.check(view) -> moves``, and the processes that all reach it: the
coordinator's rebalancing loop, its registry, dashboard and metrics, and the simulator."""

from __future__ import annotations

import dataclasses
import math

import pytest

from services.coordinator.assignment import rebalancing_policy, swarm_view
from services.coordinator.dashboard import RecentEvents, TrainingProgress, dashboard_view
from services.coordinator.metrics import CoordinatorMetrics
from services.coordinator.registry import Registry
from services.simulator.records import SimConfig, SimPeer, StageCost
from services.simulator.sim import Simulation
from shared.config import PlacementSettings
from shared.metrics import Metrics
from shared.policy.hysteresis import Confirmation
from shared.policy.move import Move
from shared.policy.rebalancing import RebalancingPolicy
from shared.policy.throughput import ThroughputRebalancer, weakest
from shared.policy.topology import TopologyRebalancer
from shared.policy.view import PlacementInputs, Replica, SwarmView
from shared.topology import Peer, Replan, Workload, world_network
from tests.conftest import coordinator_settings


def view_of(*replicas: tuple[str, int, float], num_stages: int = 2, pending: tuple[int, ...] = ()) -> SwarmView:
    return SwarmView(num_stages, tuple(Replica(sid, stage, speed) for sid, stage, speed in replicas), pending)


LOPSIDED = view_of(("a", 0, 1.0), ("b", 0, 1.0), ("c", 0, 1.0), ("d", 1, 1.0))  # best: a 0 -> 1, gain 2
A_TO_1 = Move("a", 0, 1, capacity_before=1.0, capacity_after=2.0)


# --- the weakest-stage rule ------------------------------------------------------------------


def test_weakest_is_least_capacity_then_fewest_replicas_then_lowest_index():
    assert weakest([5.0, 2.0, 3.0], [1, 1, 1]) == 1
    assert weakest([2.0, 2.0, 4.0], [2, 1, 1]) == 1
    assert weakest([2.0, 2.0], [1, 1]) == 0
    assert weakest([], []) is None
    with pytest.raises(ValueError, match="one of each per stage"):
        weakest([1.0], [1, 1])


def test_pending_joins_count_as_a_replica_at_the_mean_throughput():
    view = view_of(("a", 0, 4.0), ("b", 1, 2.0), num_stages=3, pending=(2, 1))
    assert view.capacities() == [4.0, 5.0, 3.0] and view.replica_counts() == [1, 2, 1]
    assert view.weakest_stage() == 2
    assert view_of(num_stages=2, pending=(0,)).weakest_stage() == 1  # no replicas: a hand-out counts at 0


def test_a_view_rejects_stages_outside_the_run():
    with pytest.raises(ValueError, match="num_stages"):
        view_of(("a", 2, 1.0), num_stages=2)
    with pytest.raises(ValueError, match="num_stages"):
        view_of(num_stages=2, pending=(5,))
    with pytest.raises(ValueError, match="num_stages"):
        SwarmView(0)


def test_only_the_throughput_rules_moves_have_a_gain():
    assert A_TO_1.gain == 2.0
    with pytest.raises(ValueError, match="no capacities"):
        Move("a", 0, 1).gain  # noqa: B018 - the property raises
    assert Move("a", 0, 1).same_as(A_TO_1) and not Move("a", 0, 2).same_as(A_TO_1)


# --- confirmation on consecutive checks --------------------------------------------------------


def test_confirmation_needs_consecutive_candidates_and_starts_again_after_one():
    confirm = Confirmation(2, same=lambda x, y: x == y)
    assert confirm.observe("x") is None and confirm.seen == 1
    assert confirm.observe("x") == ["x", "x"] and confirm.seen == 0
    assert confirm.observe("x") is None  # counted afresh after a confirmation
    assert confirm.observe(None) is None and confirm.seen == 0  # nothing worth it: the count resets
    assert confirm.observe("x") is None
    assert confirm.observe("y") is None and confirm.seen == 1  # a different candidate is its own first
    assert confirm.observe("y") == ["y", "y"]
    assert Confirmation(1).observe("z") == ["z"]
    with pytest.raises(ValueError, match="confirmations"):
        Confirmation(0)


# --- the entry point ------------------------------------------------------------------------


def test_check_orders_a_move_on_the_second_consecutive_check_only():
    policy = RebalancingPolicy()
    assert policy.check(LOPSIDED) == []
    assert policy.check(LOPSIDED) == [A_TO_1]
    assert policy.check(LOPSIDED) == []  # the count starts again once a move is ordered
    balanced = view_of(("a", 0, 1.0), ("b", 0, 1.0), ("c", 1, 1.0), ("d", 1, 1.0))
    assert policy.check(balanced) == [] and policy.check(LOPSIDED) == []  # a check without a move in between
    assert policy.check(LOPSIDED) == [A_TO_1]


def test_check_never_empties_a_stage():
    policy = RebalancingPolicy(ThroughputRebalancer(confirmations=1), repair_confirmations=1)
    lone = view_of(("a", 0, 1.0), ("b", 1, 100.0), num_stages=3)  # stage 2 is empty, the others have one each
    assert policy.check(lone) == [] and policy.check(lone) == []
    # stage 2 is empty (the resilience rule fills it); stage 1's only replica stays, one of stage 0's moves
    moves = policy.check(view_of(("a", 0, 1.0), ("b", 0, 1.0), ("c", 1, 0.5), num_stages=3))
    assert moves == [Move("a", 0, 2, capacity_before=0.0, capacity_after=0.5)]


def test_check_orders_no_move_below_the_gain_threshold():
    # moving b: [7, 5, 7] -> [6, 6, 7], x1.2 (fewer than two servers a stage: stage 1 may keep one replica)
    near = view_of(("a", 0, 5.0), ("b", 0, 1.0), ("c", 0, 1.0), ("d", 1, 5.0), ("e", 2, 7.0), num_stages=3)
    strict = RebalancingPolicy()
    assert all(strict.check(near) == [] for _ in range(5))
    lenient = RebalancingPolicy(ThroughputRebalancer(min_gain=1.1))
    assert lenient.check(near) == [] and lenient.check(near) == [Move("b", 0, 1, 5.0, 6.0)]


class ScriptedTopology:
    """A topology rule that returns the given replans, one per check, and counts its checks."""

    def __init__(self, *replans: Replan | None):
        self.replans, self.checks = list(replans), 0

    def check(self, inputs: PlacementInputs, num_stages: int) -> Replan | None:
        self.checks += 1
        return self.replans.pop(0)


def topology_view(*replicas: tuple[str, int, float]) -> SwarmView:
    peers = [Peer(sid, "Ohio", speed or 1.0) for sid, _, speed in replicas]  # unmeasured: as typical (the coordinator)
    current = {sid: stage for sid, stage, _ in replicas}
    inputs = PlacementInputs(peers, world_network(), Workload(32, 1e-6, 1e-3, 10.0), current)
    return dataclasses.replace(view_of(*replicas), topology=inputs)


def test_fewer_servers_than_stages_are_not_replanned():
    """Servers leave (a swarm stopping, a churn) until fewer are left than stages: the network
    planner, which fills every stage, is not asked (it raised ValueError('2 peers cannot fill
    4 stages'), logged as rebalance.failed at every period); the hold says why."""
    rule = TopologyRebalancer(min_gain=0.05, max_moves_fraction=0.5, time_budget_s=0.5)
    policy = RebalancingPolicy(topology=rule)
    view = dataclasses.replace(topology_view(("a", 0, 1.0), ("b", 1, 1.0)), num_stages=4)
    with pytest.raises(ValueError, match="cannot fill"):
        rule.check(view.topology, view.num_stages)  # what the policy used to ask
    assert policy.check(view) == []
    assert policy.held == "not replanning: 2 servers cannot fill 4 stages"


def test_a_topology_replan_never_empties_a_stage_and_waits_for_unmeasured_servers():
    moves = [Move("c", 1, 0), Move("a", 0, 1), Move("b", 0, 1)]
    rule = ScriptedTopology(Replan({"a": 1, "b": 1, "c": 0}, moves, {}, 2.0, 1.0))
    policy = RebalancingPolicy(topology=rule)
    assert policy.check(topology_view(("a", 0, 1.0), ("b", 0, 1.0), ("c", 1, 0.0))) == []
    assert rule.checks == 0  # c has not measured its throughput: no check at all
    assert policy.check(topology_view(("a", 0, 1.0), ("b", 0, 1.0), ("c", 1, 1.0))) == [Move("a", 0, 1)]
    assert policy.deferred == [Move("c", 1, 0), Move("b", 0, 1)]  # c is stage 1's only member; b stage 0's last
    assert policy.replan is not None and policy.replan.cost_after_s == 1.0
    with pytest.raises(ValueError, match="topology"):
        RebalancingPolicy().check(topology_view(("a", 0, 1.0), ("b", 1, 1.0)))


# --- every process decides through the policy ---------------------------------------------------


def test_coordinator_registry_dashboard_metrics_and_simulator_agree():
    """One swarm (stage 0: three replicas at 1 sample/s, stage 1: one), as each process
    sees it: all name stage 1 the weakest and order the same move, a 0 -> 1, on the second check."""
    # average_every_s at its default: the topology planner's cost reads it
    settings = coordinator_settings(num_stages=2, average_every_s=30.0, placement=PlacementSettings(mode="auto"))
    registry = Registry(":memory:", num_stages=2, heartbeat_s=1.0, clock=lambda: 0.0)
    for sid, stage in [("a", 0), ("b", 0), ("c", 0), ("d", 1)]:
        registry.register(sid, stage, f"http://{sid}:1", "v", 1.0, 0)

    coordinator_view = swarm_view(registry, settings, registry.live())  # the rebalancing loop's view
    assert coordinator_view == LOPSIDED
    coordinator = rebalancing_policy(settings)
    assert coordinator.check(coordinator_view) == []
    assert coordinator.check(coordinator_view) == [A_TO_1]

    sim = Simulation(
        SimConfig(num_peers=4, num_stages=2, mean_lifetime_s=math.inf), stage_cost=StageCost(1e9, 1e3, 1e6, 128)
    )
    for sid, stage, speed in [("a", 0, 1.0), ("b", 0, 1.0), ("c", 0, 1.0), ("d", 1, 1.0)]:
        sim.peers[sid] = SimPeer(Peer(sid, "Ohio", speed), 0, stage, "serving")
    sim_view = sim.swarm_view()
    assert dataclasses.replace(sim_view, topology=None) == coordinator_view
    assert sim_view.topology is not None and sim_view.topology.current == {"a": 0, "b": 0, "c": 0, "d": 1}
    assert sim.policy.check(coordinator_view) == [] and sim.policy.check(coordinator_view) == [A_TO_1]

    metrics = {
        family.name: family
        for family in CoordinatorMetrics(
            Metrics("coordinator"), registry, RecentEvents(), TrainingProgress(), {}
        ).collect()
    }
    board = dashboard_view("run", registry.view(), TrainingProgress(), RecentEvents(), now=0.0)
    assert (
        coordinator_view.weakest_stage()
        == sim_view.weakest_stage()
        == board["weakest_stage"]
        == metrics["swarm_coordinator_weakest_stage"].samples[0].value
        == registry.assign_stage()
        == 1
    )
    # with that hand-out pending, stage 1 counts two replicas and 2.0 samples/s against stage 0's 3.0: still the weakest
    pending = registry.pending_joins()
    assert [p.stage for p in pending] == [1]
    assert registry.swarm(pending).weakest_stage() == registry.assign_stage() == 1
    registry.close()
