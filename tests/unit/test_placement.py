"""The coordinator's topology placement (services/coordinator/placement.py, shared/policy/topology.py): the
registry's view turned into the planner's inputs, joiners placed by the network, moves
confirmed on consecutive checks and ordered without ever emptying a stage."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from services.coordinator.placement import GB, Joiner, placement_inputs, stage_for_joiner, uses_topology
from services.coordinator.registry import ServerReport
from shared.config import PlacementSettings
from shared.policy.move import Move
from shared.policy.topology import TopologyRebalancer, split_moves
from shared.policy.view import PlacementInputs
from shared.topology import INTRA_REGION, Peer, Replan, Workload, placement_cost, plan, world_network

MIN_GAIN = PlacementSettings().min_gain  # what the coordinator runs with
MAX_MOVES = PlacementSettings().max_moves


@dataclass(frozen=True)
class Server:  # the fields of a RegisteredServer that placement reads
    server_id: str
    stage: int
    url: str
    throughput: float


def servers(*specs: tuple[str, int, float]) -> list[Server]:
    return [Server(sid, stage, f"http://{sid}:1", throughput) for sid, stage, throughput in specs]


BIG_STAGE = ServerReport(parameters=50_000_000, samples_per_step=32)  # 0.19 GB of fp32 per averaging round


def inputs_for(live, rtt_ms=None, reports=None, *, num_stages=2, average_every_s=1.0, bandwidth_gbps=10.0, joiners=()):
    reports = {s.server_id: BIG_STAGE for s in live} if reports is None else reports
    return placement_inputs(
        live,
        rtt_ms or {},
        reports,
        num_stages=num_stages,
        average_every_s=average_every_s,
        averaging_codec="fp32",
        bandwidth_gbps=bandwidth_gbps,
        joiners=joiners,
    )


def two_clusters(near_ms: float = 1.0, far_ms: float = 150.0) -> dict[str, dict[str, float]]:
    """RTTs each of a, b, c, d measured to the others: {a, b} close together, {c, d} too, far apart."""
    cluster = {"a": 0, "b": 0, "c": 1, "d": 1}
    return {
        x: {f"http://{y}:1": near_ms if cluster[x] == cluster[y] else far_ms for y in cluster if y != x}
        for x in cluster
    }


# ------------------------------------------------------------------ inputs


def test_inputs_take_regions_throughputs_and_measured_rtts():
    live = servers(("a", 0, 100.0), ("b", 0, 0.0), ("c", 1, 300.0))
    reports = {
        "a": ServerReport("Tokyo", 10, 16, 1024.0),
        "b": ServerReport("London", 20, 32, 4096.0),
        "c": ServerReport("", 30, 32, 0.0),
    }
    rtt = {"a": {"http://b:1": 200.0, "http://c:1": 10.0}, "b": {"http://a:1/": 220.0}}
    got = inputs_for(live, rtt, reports)
    peer = {p.peer_id: p for p in got.peers}
    assert [peer[x].region for x in "abc"] == ["Tokyo", "London", "?c"]  # no region reported: a region of its own
    assert peer["b"].throughput == 200.0  # not measured yet: the median of the others
    assert got.current == {"a": 0, "b": 0, "c": 1}
    # a measured pair: the mean of both directions, with its regions' bandwidth
    ab = got.network.link(peer["a"], peer["b"])
    assert ab.rtt_ms == 210.0 and ab.bandwidth_gbps == world_network().region_link("Tokyo", "London").bandwidth_gbps
    # a pair nobody measured, one region unknown: the fallback (median measured RTT, the configured bandwidth)
    bc = got.network.link(peer["b"], peer["c"])
    assert (bc.rtt_ms, bc.bandwidth_gbps) == (sorted([200.0, 220.0, 10.0])[1], 10.0)
    w = got.workload
    assert w.samples_per_step == 32 and w.activation_gb_per_sample == 4096.0 / GB and w.gradient_gb == 30 * 4 / GB
    # averaging every second, a step of 32 samples over the weakest stage (300/s) takes 0.107 s: every 9.4 steps
    assert w.average_every_steps == pytest.approx(1.0 * 300.0 / 32)


def test_averaging_off_weighs_nothing_and_a_codec_shrinks_the_rounds():
    live = servers(("a", 0, 1.0), ("b", 1, 1.0))
    off = inputs_for(live, average_every_s=0).workload
    assert off.average_every_steps >= 1e9
    int8 = placement_inputs(
        live,
        {},
        {s.server_id: BIG_STAGE for s in live},
        num_stages=2,
        average_every_s=1.0,
        averaging_codec="int8",
        bandwidth_gbps=1.0,
    )
    assert int8.workload.gradient_gb == pytest.approx(inputs_for(live).workload.gradient_gb / 4)


def test_same_unlisted_region_is_one_place_and_nothing_measured_falls_back_to_intra_rtt():
    live = servers(("a", 0, 1.0), ("b", 1, 1.0), ("c", 1, 1.0))
    reports = {"a": ServerReport("lab-7"), "b": ServerReport("lab-7"), "c": ServerReport("")}
    got = inputs_for(live, reports=reports, bandwidth_gbps=0.5)
    a, b, c = got.peers
    assert got.network.link(a, b) == INTRA_REGION
    assert (got.network.link(a, c).rtt_ms, got.network.link(a, c).bandwidth_gbps) == (INTRA_REGION.rtt_ms, 0.5)


def test_topology_is_used_once_rtts_or_regions_are_reported():
    nothing = ServerReport()
    assert not uses_topology("auto", {"a": {}}, {"a": nothing})
    assert uses_topology("auto", {"a": {"http://b:1": 3.0}}, {"a": nothing})
    assert uses_topology("auto", {}, {"a": ServerReport("Ohio")})
    assert uses_topology("auto", {}, {}, Joiner("j", rtt_ms={"http://b:1": 3.0}))
    assert not uses_topology("throughput", {"a": {"http://b:1": 3.0}}, {"a": ServerReport("Ohio")})
    assert uses_topology("topology", {}, {})


# ------------------------------------------------------------------ joiners


@pytest.mark.parametrize("region,expected", [("Seoul", 0), ("Frankfurt", 1)])
def test_a_joiner_goes_to_the_stage_near_it_by_region(region, expected):
    """Stage 0 in Tokyo, stage 1 in London, averaging every step of a big stage: a joiner
    in Seoul joins the Tokyo stage, one in Frankfurt the London stage."""
    live = servers(("t1", 0, 50.0), ("t2", 0, 50.0), ("l1", 1, 50.0), ("l2", 1, 50.0))
    reports = {s.server_id: ServerReport("Tokyo" if s.stage == 0 else "London", 50_000_000, 32) for s in live}
    got = inputs_for(live, reports=reports, joiners=[Joiner("new", region)])
    assert stage_for_joiner(got, "new", 2, time_budget_s=5.0) == expected


@pytest.mark.parametrize("near,expected", [("ab", 0), ("cd", 1)])
def test_a_joiner_goes_to_the_stage_near_it_by_measured_rtts(near, expected):
    """No regions at all: the RTTs the joiner measured decide."""
    live = servers(("a", 0, 50.0), ("b", 0, 50.0), ("c", 1, 50.0), ("d", 1, 50.0))
    joiner = Joiner("new", rtt_ms={f"http://{x}:1": 1.0 if x in near else 150.0 for x in "abcd"})
    got = inputs_for(live, two_clusters(), joiners=[joiner])
    assert stage_for_joiner(got, "new", 2, time_budget_s=5.0) == expected


def test_a_joiner_fills_an_empty_stage_and_pending_hand_outs_count():
    live = servers(("a", 0, 50.0), ("b", 0, 50.0))
    got = inputs_for(live, num_stages=3, joiners=[Joiner("p0", stage=1), Joiner("new")])
    assert stage_for_joiner(got, "new", 3, time_budget_s=5.0) == 2  # stage 1 was handed out already


# ------------------------------------------------------------------ rebalancing


def test_moves_never_empty_a_stage():
    current = {"a": 0, "b": 0, "c": 1, "d": 2, "e": 2}
    moves = [Move("a", 0, 1), Move("b", 0, 2), Move("c", 1, 0), Move("d", 2, 0)]
    now, later = split_moves(current, moves)
    assert now == [Move("a", 0, 1), Move("d", 2, 0)] and later == [Move("b", 0, 2), Move("c", 1, 0)]
    for stage in set(current.values()):
        assert sum(1 for s in current.values() if s == stage) > sum(1 for m in now if m.from_stage == stage)


def crossed_swarm():
    """{a, b} and {c, d} are two far-apart clusters, but each stage holds one of each: its
    averaging rounds cross the 150 ms link every step."""
    return servers(("a", 0, 50.0), ("c", 0, 50.0), ("b", 1, 50.0), ("d", 1, 50.0))


def test_a_move_is_ordered_only_when_confirmed_on_two_consecutive_checks():
    rebalancer = TopologyRebalancer(min_gain=0.1, max_moves_fraction=0.5, time_budget_s=10.0, max_evaluations=3000)
    inputs = inputs_for(crossed_swarm(), two_clusters(), average_every_s=0.5)  # a round every ~1.6 steps
    assert rebalancer.check(inputs, 2) is None and rebalancer.seen == 1 and rebalancer.last.moves
    result = rebalancer.check(inputs, 2)
    assert result is not None and rebalancer.seen == 0
    stages = {sid: result.assignment[sid] for sid in "abcd"}
    assert stages["a"] == stages["b"] != stages["c"] == stages["d"], stages  # each stage inside one cluster
    assert result.cost_after_s * 1.1 < result.cost_before_s and len(result.moves) == 2
    # a check that finds nothing worth moving starts the count again
    settled = inputs_for(
        servers(("a", 0, 50.0), ("b", 0, 50.0), ("c", 1, 50.0), ("d", 1, 50.0)), two_clusters(), average_every_s=0.5
    )
    assert rebalancer.check(inputs, 2) is None and rebalancer.seen == 1
    assert rebalancer.check(settled, 2) is None and rebalancer.seen == 0
    assert rebalancer.check(inputs, 2) is None and rebalancer.seen == 1


def test_the_move_limit_holds():
    rebalancer = TopologyRebalancer(
        min_gain=0.1, max_moves_fraction=0.2, time_budget_s=10.0, confirmations=1, max_evaluations=3000
    )
    assert (
        rebalancer.check(inputs_for(crossed_swarm(), two_clusters(), average_every_s=0.5), 2) is None
    )  # one move (20% of 4, at least 1) gains nothing here
    assert rebalancer.last.moves == []


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_measurement_noise_moves_nothing(seed):
    """A settled swarm of 12 in three regions, measured RTTs and throughputs within +-5%: no move."""
    rng = random.Random(seed)
    regions = ["Oregon", "Ohio", "Virginia"]
    live = servers(*[(f"s{i}", i // 4, 100.0 * rng.uniform(0.95, 1.05)) for i in range(12)])
    reports = {s.server_id: ServerReport(regions[s.stage], 20_000_000, 32, 65536.0) for s in live}
    truth = world_network()
    region = {s.server_id: regions[s.stage] for s in live}
    rtt = {
        a.server_id: {
            b.url: truth.region_link(region[a.server_id], region[b.server_id]).rtt_ms * rng.uniform(0.95, 1.05)
            for b in live
            if b is not a
        }
        for a in live
    }
    inputs = inputs_for(live, rtt, reports, num_stages=3)
    rebalancer = TopologyRebalancer(
        min_gain=MIN_GAIN, max_moves_fraction=MAX_MOVES, time_budget_s=10.0, confirmations=1, max_evaluations=3000
    )
    assert rebalancer.check(inputs, 3) is None and rebalancer.last.moves == []
    assert placement_cost(inputs.current, inputs.peers, inputs.network, inputs.workload, 3) == pytest.approx(
        rebalancer.last.cost_before_s
    )


CITIES = ["Oregon", "Virginia", "Ohio", "Tokyo", "Seoul", "London", "Frankfurt", "Ireland"]
TRAFFIC_BOUND = Workload(samples_per_step=512, activation_gb_per_sample=0.004, gradient_gb=0.65, average_every_steps=4)


def test_after_a_quarter_churn_the_coordinator_replans_near_a_fresh_plan():
    """64 servers in 8 cities (GPUs of 4/8/16 samples/s: traffic dominates the step), planned
    afresh; 16 leave and 16 join one at a time, each placed as ``/assign`` places it (nobody
    else moves). The coordinator's check, at its default min gain and move limit, then
    gets within 5% of a fresh plan of the new swarm moving at most 20% of the servers,
    joiners included (they have downloaded their stage's state too). Evaluation budgets
    make it deterministic; the default wall-time budget allows about as many on this
    machine (~40,000 evaluations in ~2.6 s)."""
    net, rng = world_network(), random.Random(2)
    peers = [Peer(f"p{i}", rng.choice(CITIES), rng.choice([4.0, 8.0, 16.0])) for i in range(64)]
    before = plan(peers, net, TRAFFIC_BOUND, 8, time_budget_s=120.0, max_evaluations=30_000, seed=2)
    churn = random.Random(200)
    gone = set(churn.sample(range(64), 16))
    now = [p for i, p in enumerate(peers) if i not in gone]
    current = {p.peer_id: before.assignment[p.peer_id] for p in now}
    for i in range(16):
        joiner = Peer(f"j{i}", churn.choice(CITIES), churn.choice([4.0, 8.0, 16.0]))
        now.append(joiner)
        current[joiner.peer_id] = stage_for_joiner(
            PlacementInputs(now, net, TRAFFIC_BOUND, current), joiner.peer_id, 8, time_budget_s=120.0
        )
    rebalancer = TopologyRebalancer(
        min_gain=MIN_GAIN, max_moves_fraction=MAX_MOVES, time_budget_s=120.0, confirmations=1
    )
    result = rebalancer.check(PlacementInputs(now, net, TRAFFIC_BOUND, current), 8)
    fresh = plan(now, net, TRAFFIC_BOUND, 8, time_budget_s=120.0, max_evaluations=30_000, seed=0)
    assert result is not None and 0 < len(result.moves) <= 12
    assert result.cost_before_s > 1.05 * fresh.cost_s  # the joins alone left it off
    assert result.cost_after_s <= 1.05 * fresh.cost_s
    assert all(
        current[m.server_id] == m.from_stage and result.assignment[m.server_id] == m.to_stage for m in result.moves
    )
    assert placement_cost(result.assignment, now, net, TRAFFIC_BOUND, 8) == pytest.approx(result.cost_after_s)


def test_the_cheaper_of_the_confirming_replans_is_ordered(monkeypatch):
    """Each check searches with its own seed; when the second confirms the first, the
    replan cheapest under the latest inputs is ordered, unless the first started from an
    assignment that has changed since."""
    seeds = []
    scripted = iter(
        [
            Replan({"a": 0, "c": 0, "b": 1, "d": 1}, [Move("c", 1, 0), Move("b", 0, 1)], {}, 9.0, 5.0),  # the cheap one
            Replan({"a": 1, "c": 0, "b": 0, "d": 1}, [Move("a", 0, 1), Move("c", 1, 0)], {}, 9.0, 7.0),
            Replan({"a": 0, "c": 0, "b": 1, "d": 1}, [Move("c", 1, 0), Move("b", 0, 1)], {}, 9.0, 5.0),
            Replan({"a": 1, "c": 0, "b": 0, "d": 1}, [Move("a", 0, 1), Move("c", 1, 0)], {}, 9.0, 7.0),
        ]
    )

    def fake_replan(current, peers, network, workload, num_stages, *, seed, **kw):
        seeds.append(seed)
        return next(scripted)

    monkeypatch.setattr("shared.policy.topology.replan", fake_replan)
    costs = {(0, 0, 1, 1): 5.0, (1, 0, 0, 1): 7.0}  # the stages of a, c, b, d -> seconds per step
    monkeypatch.setattr(
        "shared.policy.topology.placement_cost",
        lambda assignment, *a, **kw: costs[tuple(assignment[x] for x in "acbd")],
    )
    rebalancer = TopologyRebalancer(min_gain=MIN_GAIN, max_moves_fraction=0.5, time_budget_s=1.0, seed=10)
    crossed = inputs_for(crossed_swarm(), two_clusters())
    assert rebalancer.check(crossed, 2) is None
    ordered = rebalancer.check(crossed, 2)
    assert seeds == [10, 11]
    assert (
        ordered.assignment == {"a": 0, "c": 0, "b": 1, "d": 1}
        and ordered.cost_after_s == 5.0
        and len(ordered.moves) == 2
    )
    # the first replan started from another assignment: the confirming one is ordered as it is
    assert (
        rebalancer.check(
            inputs_for(servers(("a", 0, 50.0), ("c", 1, 50.0), ("b", 0, 50.0), ("d", 1, 50.0)), two_clusters()), 2
        )
        is None
    )
    ordered = rebalancer.check(crossed, 2)
    assert seeds == [10, 11, 12, 13] and ordered.cost_after_s == 7.0 and ordered.assignment["a"] == 1
