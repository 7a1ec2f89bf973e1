"""The cost model: DT-FM's reference values, its building blocks against brute force, and
the SWARM cost's reduction to DT-FM's when peers and stages are equal."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from shared.topology.cost import (
    DTFM_GPT3_XL,
    DTFM_GRADIENT_GB,
    Workload,
    _held_karp,
    _two_opt_path,
    bottleneck_matching,
    butterfly_time,
    dtfm_cost,
    dtfm_pair_cost,
    hop_time,
    matched_flows,
    shortest_path,
    spanning_tree_cost,
    step_cost,
    stochastic_flows,
)
from shared.topology.network import (
    INTRA_REGION,
    Link,
    Network,
    Peer,
    load_links,
    peers_in_regions,
    regional_network,
    world_network,
)

CITIES = ["Oregon", "Virginia", "Ohio", "Tokyo", "Seoul", "London", "Frankfurt", "Ireland"]
REGIONAL = ["Virginia", "Oregon", "California", "Ohio"]
# Reference values of DT-FM's published cost model (data/README.md of the project).
WORLD_PIPELINE_PER_CITY_S = 49.22
WORLD_STAGE_PER_CITY_S = 59.44
WORLD_RANDOM_MEAN_S = 172.0
REGIONAL_BEST_S = 34.80
REGIONAL_RANDOM_MEAN_S = 61.0

A_TASKLET = DTFM_GPT3_XL.tasklet_activation_gb(8)


def world() -> tuple[list[Peer], np.ndarray, np.ndarray]:
    peers = peers_in_regions({c: 8 for c in CITIES})
    rtt, bw = world_network().matrices(peers)
    return peers, rtt, bw


def regional() -> tuple[list[Peer], np.ndarray, np.ndarray]:
    peers = peers_in_regions({r: 16 for r in REGIONAL})
    rtt, bw = regional_network().matrices(peers)
    return peers, rtt, bw


def dtfm(groups, rtt, bw) -> float:
    return dtfm_cost(groups, rtt, bw, A_TASKLET, DTFM_GRADIENT_GB).total_s


def routed_dtfm(groups, rtt, bw) -> float:
    """DT-FM's cost with the routing as given: stage order as listed, pipeline j = the
    j-th device of every group (the paper's random scheduler scores placements so)."""
    dp = max(butterfly_time(rtt[np.ix_(g, g)], bw[np.ix_(g, g)], DTFM_GRADIENT_GB) for g in groups)
    pair = dtfm_pair_cost(rtt, bw, A_TASKLET)
    pp = sum(max(pair[a, b] for a, b in zip(g0, g1)) for g0, g1 in zip(groups, groups[1:]))
    return dp + 2 * pp


# --- DT-FM's reference figures -----------------------------------------------------------


def test_world_wide_one_pipeline_per_city_matches_dtfm_within_half_a_percent():
    _, rtt, bw = world()
    groups = [[city * 8 + stage for city in range(8)] for stage in range(8)]  # stage s: one GPU per city
    assert dtfm(groups, rtt, bw) == pytest.approx(WORLD_PIPELINE_PER_CITY_S, rel=0.005)


def test_world_wide_one_stage_per_city_matches_dtfm_within_half_a_percent():
    _, rtt, bw = world()
    groups = [[city * 8 + i for i in range(8)] for city in range(8)]  # stage = city
    result = dtfm_cost(groups, rtt, bw, A_TASKLET, DTFM_GRADIENT_GB)
    assert result.total_s == pytest.approx(WORLD_STAGE_PER_CITY_S, rel=0.005)
    assert result.data_parallel_s == pytest.approx(14 * (0.005 + 8 * DTFM_GRADIENT_GB / (2.0 * 8)))  # 7 peers, 2 ways


def test_regional_two_gpus_per_region_per_stage_matches_dtfm_best():
    _, rtt, bw = regional()
    groups = [[r * 16 + 2 * s + h for r in range(4) for h in range(2)] for s in range(8)]
    assert dtfm(groups, rtt, bw) == pytest.approx(REGIONAL_BEST_S, rel=0.005)


@pytest.mark.parametrize("scenario, reference", [(world, WORLD_RANDOM_MEAN_S), (regional, REGIONAL_RANDOM_MEAN_S)])
def test_random_placements_average_what_dtfm_reports(scenario, reference):
    _, rtt, bw = scenario()
    rng = random.Random(0)
    costs = []
    for _ in range(400):
        order = list(range(64))
        rng.shuffle(order)
        costs.append(routed_dtfm([order[i * 8 : i * 8 + 8] for i in range(8)], rtt, bw))
    assert sum(costs) / len(costs) == pytest.approx(reference, rel=0.03)


# --- building blocks ------------------------------------------------------------------------


def test_bottleneck_matching_equals_brute_force():
    rng = np.random.default_rng(1)
    for _ in range(200):
        k = int(rng.integers(1, 7))
        cost = rng.integers(0, 8, (k, k)).astype(float)
        value, match = bottleneck_matching(cost)
        brute = min(max(cost[i, p[i]] for i in range(k)) for p in itertools.permutations(range(k)))
        assert value == brute
        assert sorted(match) == list(range(k)) and max(cost[i, match[i]] for i in range(k)) == value


def _brute_path(c: np.ndarray) -> float:
    n = c.shape[0]
    return min(sum(c[p[i], p[i + 1]] for i in range(n - 1)) for p in itertools.permutations(range(n)))


@pytest.mark.parametrize("n", [2, 3, 5, 7, 8])
def test_shortest_path_is_exact(n):
    rng = np.random.default_rng(n)
    c = rng.random((n, n))
    c = c + c.T
    cost, order = shortest_path(c)
    assert sorted(order) == list(range(n))
    assert cost == pytest.approx(sum(c[a, b] for a, b in zip(order, order[1:])))
    assert cost == pytest.approx(_brute_path(c))
    assert _held_karp(c)[0] == pytest.approx(cost)
    assert spanning_tree_cost(c) <= cost + 1e-12
    assert _two_opt_path(c)[0] >= cost - 1e-12


def test_butterfly_time_is_dtfm_data_parallel_formula():
    rtt = np.array([[0.0, 0.01, 0.1], [0.01, 0.0, 0.05], [0.1, 0.05, 0.0]])
    bw = np.array([[1.0, 2.0, 0.5], [2.0, 1.0, 1.0], [0.5, 1.0, 1.0]])
    g = 0.6
    member = [sum(2 * (rtt[i, j] + 8 * g / (3 * bw[i, j])) for j in range(3) if j != i) for i in range(3)]
    assert butterfly_time(rtt, bw, g) == pytest.approx(max(member))
    assert butterfly_time(rtt[:1, :1], bw[:1, :1], g) == 0.0


# --- the SWARM cost -------------------------------------------------------------------------


def test_swarm_cost_reduces_to_dtfm_for_equal_peers_and_stages():
    """Equal peers, 8 replicas per stage, DT-FM's routing (its order and matchings): the
    SWARM cost is DT-FM's plus a compute term that no placement changes."""
    _, rtt, bw = world()
    rng = random.Random(3)
    throughput = np.full(64, 5.0)
    for _ in range(3):
        order = list(range(64))
        rng.shuffle(order)
        groups = [order[i * 8 : i * 8 + 8] for i in range(8)]
        reference = dtfm_cost(groups, rtt, bw, A_TASKLET, DTFM_GRADIENT_GB)
        stages = [groups[g] for g in reference.order]
        flows = [matched_flows(m) for m in reference.matchings]
        swarm = step_cost(stages, throughput, rtt, bw, DTFM_GPT3_XL, flows)
        assert swarm.compute_s == pytest.approx(DTFM_GPT3_XL.samples_per_step / (8 * 5.0))
        assert swarm.total_s - swarm.compute_s == pytest.approx(reference.total_s, rel=1e-9)


def test_swarm_cost_with_fixed_pipelines_scores_a_placement_as_dtfm_random_scheduler():
    _, rtt, bw = world()
    order = list(range(64))
    random.Random(5).shuffle(order)
    groups = [order[i * 8 : i * 8 + 8] for i in range(8)]
    identity = [matched_flows(list(range(8)))] * 7
    swarm = step_cost(groups, np.ones(64), rtt, bw, DTFM_GPT3_XL, identity)
    assert swarm.total_s - swarm.compute_s == pytest.approx(routed_dtfm(groups, rtt, bw))


def test_stochastic_hop_between_two_regions():
    """Two stages of two equal peers, one region each: every sender sends half the
    boundary, a quarter to each receiver, one after the other, plus one RTT."""
    link = Link(100.0, 0.5)
    net = Network({("A", "B"): link})
    peers = [Peer("a0", "A"), Peer("a1", "A"), Peer("b0", "B"), Peer("b1", "B")]
    rtt, bw = net.matrices(peers)
    w = Workload(samples_per_step=10, activation_gb_per_sample=0.1, gradient_gb=0.2)
    flows = stochastic_flows(np.ones(2), np.ones(2))
    expected = 0.1 + 8 * (w.boundary_gb / 2) / 0.5
    assert hop_time(flows, rtt[np.ix_([0, 1], [2, 3])], bw[np.ix_([0, 1], [2, 3])], w.boundary_gb) == pytest.approx(
        expected
    )
    cost = step_cost([[0, 1], [2, 3]], np.ones(4), rtt, bw, w)
    averaging = 2 * (INTRA_REGION.rtt_ms / 1e3 + 8 * 0.2 / (2 * INTRA_REGION.bandwidth_gbps))
    assert cost.total_s == pytest.approx(10 / 2 + 2 * expected + averaging)


def test_averaging_is_amortized_over_its_period_and_an_empty_stage_is_infinite():
    _, rtt, bw = world()
    stages = [list(range(32)), list(range(32, 64))]
    every = step_cost(stages, np.ones(64), rtt, bw, Workload(100, 0.001, 0.5, average_every_steps=1))
    fourth = step_cost(stages, np.ones(64), rtt, bw, Workload(100, 0.001, 0.5, average_every_steps=4))
    assert every.total_s - fourth.total_s == pytest.approx(every.averaging_s * 3 / 4)
    assert math.isinf(step_cost([[0, 1], []], np.ones(64), rtt, bw, DTFM_GPT3_XL).total_s)


def test_workload_rejects_nonsense():
    with pytest.raises(ValueError, match="samples_per_step"):
        Workload(0, 0.1, 0.1)
    with pytest.raises(ValueError, match="average_every_steps"):
        Workload(1, 0.1, 0.1, average_every_steps=0)


# --- network ---------------------------------------------------------------------------------


def test_shipped_matrix_has_every_pair_of_ten_regions():
    links = load_links()
    regions = {r for pair in links for r in pair}
    assert len(regions) == 10 and len(links) == 45
    assert links[("London", "Tokyo")] == Link(210.0, 0.366)


def test_network_links_are_symmetric_and_measurements_override_regions():
    net = world_network()
    tokyo, london, london2 = Peer("t", "Tokyo"), Peer("l", "London"), Peer("l2", "London")
    assert net.link(tokyo, london) == net.link(london, tokyo) == Link(210.0, 0.366)
    assert net.link(london, london2) == INTRA_REGION
    measured = net.with_measurements({("l", "t"): Link(190.0, 0.4)})
    assert measured.link(tokyo, london) == Link(190.0, 0.4)
    rtt, _ = measured.matrices([tokyo, london, london2])
    assert rtt[0, 1] == rtt[1, 0] == pytest.approx(0.19) and rtt[0, 2] == pytest.approx(0.21)
    assert measured.peer_classes([tokyo, london, london2]) == [0, 1, 2]
    assert net.peer_classes([tokyo, london, london2]) == [0, 1, 1]
    with pytest.raises(KeyError, match="Atlantis"):
        net.region_link("Atlantis", "Tokyo")


def test_regional_network_adds_california_and_its_own_virginia_oregon_link():
    net = regional_network()
    assert net.region_link("Oregon", "California") == Link(12.0, 1.25)
    assert net.region_link("Virginia", "Oregon") == Link(67.0, 1.15)
    assert world_network().region_link("Virginia", "Oregon") == Link(67.0, 0.79)
