"""The planner: optimality on small instances (exhaustive search), DT-FM's 64-GPU
scenarios, and replanning under measurement noise and churn.

Searches run on budgets of evaluations (with wall time to spare), so results depend on
the seeds only, not on how busy the machine is.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from shared.topology.cost import DTFM_GPT3_XL, DTFM_GRADIENT_GB, Workload, butterfly_time, dtfm_pair_cost
from shared.topology.exhaustive import exhaustive
from shared.topology.network import Link, Network, Peer, peers_in_regions, regional_network, world_network
from shared.topology.objective import State
from shared.topology.planner import build_objective, place_joiners, placement_cost, plan, replan
from shared.topology.search import MoveLimit, random_labels

CITIES = ["Oregon", "Virginia", "Ohio", "Tokyo", "Seoul", "London", "Frankfurt", "Ireland"]
WORLD_BEST_S = 49.22  # DT-FM's evolutionary scheduler, world-wide scenario
REGIONAL_BEST_S = 34.80  # and regional
SLACK = 120.0  # wall seconds a search may take at most; the evaluation budget ends it first
# A swarm workload (GPT-3 XL-like volumes, averaging every 4 steps) for the SWARM cost.
SWARM_WORKLOAD = Workload(samples_per_step=512, activation_gb_per_sample=0.004, gradient_gb=0.65, average_every_steps=4)


def stages_of(assignment: dict[str, int], num_stages: int) -> list[list[str]]:
    out: list[list[str]] = [[] for _ in range(num_stages)]
    for pid, stage in assignment.items():
        out[stage].append(pid)
    return out


# --- small instances against the exhaustive optimum -----------------------------------------


def test_dtfm_planner_is_near_optimal_on_30_small_instances():
    """12-15 peers from the 8 cities, 3-5 equal stages: within 5% of the optimum on 90%
    of instances and within 2% on average, where random placements are far off."""
    net = world_network()
    rng = random.Random(8)
    ratios, random_ratios = [], []
    for instance in range(30):
        n, stages = rng.choice([(12, 3), (12, 4), (15, 3), (15, 5)])
        peers = [Peer(f"p{i}", rng.choice(CITIES)) for i in range(n)]
        obj = build_objective(peers, net, DTFM_GPT3_XL, stages, model="dtfm", order_free=True)
        optimum = exhaustive(obj).score.total
        found = plan(
            peers, net, DTFM_GPT3_XL, stages, model="dtfm", time_budget_s=SLACK, max_evaluations=1500, seed=instance
        )
        assert found.cost_s >= optimum * (1 - 1e-9), "nothing beats the exhaustive optimum"
        ratios.append(found.cost_s / optimum)
        random_ratios.append(np.mean([obj.score(random_labels(obj, rng)).total for _ in range(20)]) / optimum)
    assert sum(r <= 1.05 for r in ratios) >= 27
    assert np.mean(ratios) <= 1.02
    assert np.mean(random_ratios) >= 1.15  # the instances are not trivial


def test_swarm_planner_is_near_optimal_on_small_heterogeneous_instances():
    """8 peers of 3 speeds in random cities, 3 stages of any size: the SWARM cost."""
    net = world_network()
    rng = random.Random(11)
    ratios = []
    for instance in range(10):
        peers = [Peer(f"p{i}", rng.choice(CITIES), rng.choice([4.0, 8.0, 16.0])) for i in range(8)]
        obj = build_objective(peers, net, SWARM_WORKLOAD, 3, model="swarm", order_free=True)
        optimum = exhaustive(obj).score.total
        found = plan(peers, net, SWARM_WORKLOAD, 3, time_budget_s=SLACK, max_evaluations=1500, seed=instance)
        assert placement_cost(found.assignment, peers, net, SWARM_WORKLOAD, 3) == pytest.approx(found.cost_s)
        ratios.append(found.cost_s / optimum)
    assert sum(r <= 1.05 for r in ratios) >= 9
    assert np.mean(ratios) <= 1.02


# --- DT-FM's 64-GPU scenarios ---------------------------------------------------------------------


def _random_routed_mean(peers: list[Peer], net: Network, samples: int = 200) -> float:
    """Mean DT-FM cost of random placements with random routing (the paper's baseline)."""
    rtt, bw = net.matrices(peers)
    pair = dtfm_pair_cost(rtt, bw, DTFM_GPT3_XL.tasklet_activation_gb(8))
    rng = random.Random(0)
    costs = []
    for _ in range(samples):
        order = list(range(64))
        rng.shuffle(order)
        groups = [order[i * 8 : i * 8 + 8] for i in range(8)]
        dp = max(butterfly_time(rtt[np.ix_(g, g)], bw[np.ix_(g, g)], DTFM_GRADIENT_GB) for g in groups)
        costs.append(dp + 2 * sum(max(pair[a, b] for a, b in zip(g0, g1)) for g0, g1 in zip(groups, groups[1:])))
    return float(np.mean(costs))


def test_world_wide_scenario_reaches_dtfm_best_and_beats_random_placement():
    peers = peers_in_regions({c: 8 for c in CITIES})
    net = world_network()
    found = plan(peers, net, DTFM_GPT3_XL, 8, model="dtfm", time_budget_s=SLACK, max_evaluations=4000, seed=0)
    assert found.cost_s <= WORLD_BEST_S * 1.02
    assert found.cost_s <= 0.35 * _random_routed_mean(peers, net)
    assert placement_cost(found.assignment, peers, net, DTFM_GPT3_XL, 8, model="dtfm") == pytest.approx(found.cost_s)
    assert all(len(s) == 8 for s in stages_of(found.assignment, 8))


def test_regional_scenario_reaches_dtfm_best():
    peers = peers_in_regions({r: 16 for r in ["Virginia", "Oregon", "California", "Ohio"]})
    found = plan(
        peers, regional_network(), DTFM_GPT3_XL, 8, model="dtfm", time_budget_s=SLACK, max_evaluations=4000, seed=0
    )
    assert found.cost_s <= REGIONAL_BEST_S * 1.02


# --- replanning: noise moves nothing, churn moves few ------------------------------------------------


COMPUTE_WEIGHTED = (1.0, 2.0, 4.0)  # GPU speeds (samples/s through a stage): compute weighs in the step
COMMUNICATION_BOUND = (4.0, 8.0, 16.0)  # GPUs 4x faster: traffic dominates the step


def _swarm_scenario(seed: int = 2, speeds: tuple[float, ...] = COMPUTE_WEIGHTED) -> list[Peer]:
    """64 peers in random cities with three GPU speeds."""
    rng = random.Random(seed)
    return [Peer(f"p{i}", rng.choice(CITIES), rng.choice(speeds)) for i in range(64)]


def _noisy(peers: list[Peer], net: Network, seed: int) -> tuple[list[Peer], Network]:
    """Every pair's RTT and bandwidth, and every throughput, measured within +-5%."""
    rng = random.Random(seed)
    measured = {}
    for i, a in enumerate(peers):
        for b in peers[i + 1 :]:
            link = net.link(a, b)
            measured[a.peer_id, b.peer_id] = Link(
                link.rtt_ms * rng.uniform(0.95, 1.05), link.bandwidth_gbps * rng.uniform(0.95, 1.05)
            )
    noisy_peers = [Peer(p.peer_id, p.region, p.throughput * rng.uniform(0.95, 1.05)) for p in peers]
    return noisy_peers, net.with_measurements(measured)


@pytest.fixture(scope="module")
def swarm_plan():
    peers = _swarm_scenario()
    return peers, plan(peers, world_network(), SWARM_WORKLOAD, 8, time_budget_s=SLACK, max_evaluations=30_000, seed=2)


@pytest.fixture(scope="module")
def communication_bound_plan():
    peers = _swarm_scenario(speeds=COMMUNICATION_BOUND)
    return peers, plan(peers, world_network(), SWARM_WORKLOAD, 8, time_budget_s=SLACK, max_evaluations=30_000, seed=2)


@pytest.fixture(scope="module")
def dtfm_plan():
    peers = peers_in_regions({c: 8 for c in CITIES})
    return peers, plan(
        peers, world_network(), DTFM_GPT3_XL, 8, model="dtfm", time_budget_s=SLACK, max_evaluations=4000, seed=0
    )


@pytest.mark.parametrize("noise_seed", [100, 101])
def test_measurement_noise_moves_no_server(swarm_plan, noise_seed):
    peers, fresh = swarm_plan
    noisy_peers, noisy_net = _noisy(peers, world_network(), noise_seed)
    result = replan(
        fresh.assignment,
        noisy_peers,
        noisy_net,
        SWARM_WORKLOAD,
        8,
        time_budget_s=SLACK,
        max_evaluations=20_000,
        seed=noise_seed,
    )
    assert result.moves == [] and result.assignment == fresh.assignment


def test_measurement_noise_moves_no_server_in_the_dtfm_world_wide_scenario(dtfm_plan):
    peers, fresh = dtfm_plan
    noisy_peers, noisy_net = _noisy(peers, world_network(), 7)
    result = replan(
        fresh.assignment,
        noisy_peers,
        noisy_net,
        DTFM_GPT3_XL,
        8,
        model="dtfm",
        time_budget_s=SLACK,
        max_evaluations=3000,
        seed=0,
    )
    assert result.moves == []


def test_measurement_noise_moves_no_server_in_a_communication_bound_swarm(communication_bound_plan):
    """Where noise favours a reshuffle most: with moves unlimited, the cheapest placement
    the search finds on these measurements looks ~6% cheaper (21 of 64 servers moved);
    its gain is spread over many moves, each earning little, and nobody moves."""
    peers, fresh = communication_bound_plan
    noisy_peers, noisy_net = _noisy(peers, world_network(), 100)
    result = replan(
        fresh.assignment, noisy_peers, noisy_net, SWARM_WORKLOAD, 8, time_budget_s=SLACK, max_evaluations=40_000, seed=0
    )
    assert result.moves == [] and result.assignment == fresh.assignment


def _churn(peers: list[Peer], churn_seed: int, speeds: tuple[float, ...]) -> tuple[list[Peer], list[Peer]]:
    """16 of the 64 ``peers`` leave, 16 new ones join: (the swarm now, the joiners)."""
    rng = random.Random(churn_seed)
    gone = set(rng.sample(range(64), 16))
    joiners = [Peer(f"j{i}", rng.choice(CITIES), rng.choice(speeds)) for i in range(16)]
    return [p for i, p in enumerate(peers) if i not in gone] + joiners, joiners


def _check_replan_after_churn(
    peers: list[Peer], fresh, churn_seed: int, speeds: tuple[float, ...], workload: Workload, model: str = "swarm"
) -> None:
    """After a quarter churn the replan is within 5% of a fresh plan of the new swarm
    (same evaluation budgets as the bench) and moves at most 20% of the servers."""
    now, joiners = _churn(peers, churn_seed, speeds)
    max_moves = math.floor(0.2 * len(now))
    result = replan(
        fresh.assignment,
        now,
        world_network(),
        workload,
        8,
        model=model,
        time_budget_s=SLACK,
        max_evaluations=40_000,
        max_moves=max_moves,
        seed=churn_seed,
    )
    again = plan(
        now, world_network(), workload, 8, model=model, time_budget_s=SLACK, max_evaluations=30_000, seed=churn_seed
    )
    assert result.cost_after_s <= 1.05 * again.cost_s
    assert len(result.moves) <= max_moves
    assert set(result.joined) == {p.peer_id for p in joiners}
    assert result.cost_after_s <= result.cost_before_s
    predicted = placement_cost(result.assignment, now, world_network(), workload, 8, model=model)
    if model == "swarm":
        assert predicted == pytest.approx(result.cost_after_s)
    else:  # DT-FM's cost picks its own pipeline order; the replan's keeps the stages' numbers
        assert predicted <= result.cost_after_s * (1 + 1e-9)
    for move in result.moves:
        assert (
            fresh.assignment[move.server_id] == move.from_stage and result.assignment[move.server_id] == move.to_stage
        )
    if model == "dtfm":
        assert all(len(stage) == 8 for stage in stages_of(result.assignment, 8))


@pytest.mark.parametrize("churn_seed", [201, 205])
def test_after_a_quarter_churn_the_replan_is_near_a_fresh_plan_and_moves_few(swarm_plan, churn_seed):
    """16 of 64 servers leave, 16 new ones join: the replan is within 5% of a fresh plan
    of the new swarm and moves at most 20% of the servers."""
    peers, fresh = swarm_plan
    _check_replan_after_churn(peers, fresh, churn_seed, COMPUTE_WEIGHTED, SWARM_WORKLOAD)


def test_after_a_quarter_churn_a_communication_bound_swarm_is_replanned_near_a_fresh_plan(communication_bound_plan):
    """Traffic dominates: the fresh plan's structure (which regions form which stage, in
    which order) differs from the current one, and 12 moves get near it only with the
    joiners and the right servers (the replan of df7bfc1, which searched without the move
    limit and pruned afterwards, reached 1.142x with no move)."""
    peers, fresh = communication_bound_plan
    _check_replan_after_churn(peers, fresh, 201, COMMUNICATION_BOUND, SWARM_WORKLOAD)


def test_after_a_quarter_churn_the_dtfm_world_wide_scenario_is_replanned_near_a_fresh_plan(dtfm_plan):
    """DT-FM's cost, equal stages: 2 to 10 moves (interchangeable servers traded) reach
    the fresh plan's structure (the replan of df7bfc1 reached 1.137x with 12 moves)."""
    peers, fresh = dtfm_plan
    _check_replan_after_churn(peers, fresh, 202, (1.0,), DTFM_GPT3_XL, model="dtfm")


def test_interchangeable_servers_are_traded_so_that_the_fewest_count_as_moved():
    """Peers of one region and speed are interchangeable: any labelling with the same
    class counts per stage costs the same, and the one with the most kept servers at
    home is found."""
    peers = [Peer(f"t{i}", "Tokyo", 2.0) for i in range(4)] + [Peer(f"l{i}", "London", 1.0) for i in range(4)]
    obj = build_objective(peers, world_network(), SWARM_WORKLOAD, 2, model="swarm", order_free=False)
    home = [0, 0, 1, 1, 1, 1, 0, 0]
    limit = MoveLimit(home, frozenset(range(6)), 2)  # t0-t3 and l0, l1 are kept servers; l2, l3 joined
    labels = [1, 1, 0, 0, 0, 0, 0, 1]  # every kept server away, though stage 0 only traded 2 Tokyo for 1 London
    fewest = limit.fewest_moves(obj, labels)
    assert State(obj, fewest).score.total == pytest.approx(State(obj, labels).score.total)
    assert sorted(zip(obj.classes, fewest)) == sorted(zip(obj.classes, labels))
    assert limit.away(labels) == 6 and limit.away(fewest) == 1
    assert fewest[:5] == [0, 0, 1, 1, 1]  # the Tokyo servers and l0 stay; l1 moves (stage 0 gains a London server)


# --- the API the coordinator calls ---------------------------------------------------------------------


def test_replan_of_an_unchanged_plan_moves_nothing(swarm_plan):
    peers, fresh = swarm_plan
    result = replan(
        fresh.assignment, peers, world_network(), SWARM_WORKLOAD, 8, time_budget_s=SLACK, max_evaluations=5000
    )
    assert result.moves == [] and result.joined == {} and result.cost_after_s == pytest.approx(fresh.cost_s)


def test_replan_refills_a_stage_that_everyone_left(swarm_plan):
    peers, fresh = swarm_plan
    left = [p for p in peers if fresh.assignment[p.peer_id] != 3]
    result = replan(
        fresh.assignment, left, world_network(), SWARM_WORKLOAD, 8, time_budget_s=SLACK, max_evaluations=3000
    )
    assert math.isinf(result.cost_before_s) and math.isfinite(result.cost_after_s)
    assert any(move.to_stage == 3 for move in result.moves)
    assert set(result.assignment.values()) == set(range(8))


def test_a_joiner_fills_an_empty_stage_first():
    peers = [Peer("a", "Tokyo", 2.0), Peer("b", "Tokyo", 2.0), Peer("c", "London", 1.0), Peer("new", "Seoul", 1.0)]
    placed = place_joiners({"a": 0, "b": 0, "c": 2}, peers, world_network(), SWARM_WORKLOAD, 3, max_evaluations=200)
    assert placed == {"new": 1}


def test_a_joiner_goes_where_the_step_is_cheapest():
    """Two stages, one in Tokyo and one in London: a joiner from Seoul or Ohio goes to the
    stage where the predicted step is shortest, and nobody else moves."""
    net = world_network()
    base = [Peer(f"t{i}", "Tokyo", 2.0) for i in range(3)] + [Peer(f"l{i}", "London", 1.0) for i in range(3)]
    current = {f"t{i}": 0 for i in range(3)} | {f"l{i}": 1 for i in range(3)}
    for region in ("Seoul", "Ohio", "Frankfurt"):
        peers = base + [Peer("new", region, 1.0)]
        placed = place_joiners(current, peers, net, SWARM_WORKLOAD, 2, max_evaluations=200)
        costs = [placement_cost(current | {"new": s}, peers, net, SWARM_WORKLOAD, 2) for s in (0, 1)]
        assert placed == {"new": int(np.argmin(costs))}


def test_plan_fills_every_stage_and_rejects_impossible_requests():
    peers = _swarm_scenario()[:20]
    found = plan(peers, world_network(), SWARM_WORKLOAD, 5, time_budget_s=SLACK, max_evaluations=500)
    assert set(found.assignment) == {p.peer_id for p in peers}
    assert all(stages_of(found.assignment, 5))
    with pytest.raises(ValueError, match="num_stages"):
        plan(peers[:3], world_network(), SWARM_WORKLOAD, 5)
    with pytest.raises(ValueError, match="equal stages"):
        plan(peers, world_network(), DTFM_GPT3_XL, 3, model="dtfm")
    with pytest.raises(ValueError, match="cost model"):
        plan(peers, world_network(), SWARM_WORKLOAD, 3, model="fastest")


def test_exhaustive_search_counts_placements_up_to_interchangeable_peers():
    """4 distinct peers into 2 non-empty unordered groups: S(4, 2) = 7 placements; with
    the objective counting them, exhaustive search evaluates exactly those."""
    peers = [Peer(f"p{i}", city, 1.0 + i) for i, city in enumerate(["Tokyo", "Seoul", "London", "Ohio"])]
    obj = build_objective(peers, world_network(), SWARM_WORKLOAD, 2, model="swarm", order_free=True)
    best = exhaustive(obj)
    assert obj.evaluations == 7
    every = [State(obj, [0] + list(bits)).score.total for bits in np.ndindex(2, 2, 2) if any(bits)]
    assert best.score.total == pytest.approx(min(every))
