"""The swarm simulator: SWARM wiring with rebalancing keeps its throughput under
preemption while fixed pipelines stop (the SWARM paper's claim), with the trainer's real
ReplicaBalancer and the topology planner inside."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from services.simulator import SimConfig, Simulation, simulate
from services.simulator.__main__ import main, render
from shared.wiring import ReplicaBalancer

# 200 peers across the 10 regions, a peer's mean lifetime 10 minutes, 5 simulated minutes.
PREEMPTED = SimConfig(
    num_peers=200,
    num_stages=8,
    microbatches_in_flight=400,
    trainers=16,
    duration_s=300.0,
    mean_lifetime_s=600.0,
    planner_evaluations=400,
    seed=1,
)


@pytest.fixture(scope="module")
def runs():
    return {mode: simulate(dataclasses.replace(PREEMPTED, mode=mode)) for mode in ("swarm", "fixed")}


def second_half(report) -> float:
    windows = report.tokens_per_s_windows
    return sum(windows[len(windows) // 2 :]) / (len(windows) - len(windows) // 2)


def test_swarm_keeps_its_throughput_under_preemption_while_fixed_pipelines_stop(runs):
    swarm, fixed = runs["swarm"], runs["fixed"]
    assert swarm.deaths > 40 and fixed.deaths > 40  # a fifth of the swarm was preempted
    assert second_half(swarm) >= 0.5 * max(swarm.tokens_per_s_windows)
    assert fixed.tokens_per_s_windows[-1] <= 0.1 * max(fixed.tokens_per_s_windows)
    assert second_half(swarm) >= 5 * second_half(fixed)
    assert swarm.lost_work_fraction < 0.05 < fixed.lost_work_fraction
    assert swarm.joins > 0 and swarm.moves > 0  # joiners were placed and the planner rebalanced


def test_report_shows_both_modes(runs):
    table = render([runs["swarm"], runs["fixed"]])
    for text in ("swarm", "fixed", "tokens/s", "stage utilisation", "lost work", "kept"):
        assert text in table
    assert len(runs["swarm"].stage_utilisation) == 8
    assert all(0.0 <= u <= 1.0 for u in runs["swarm"].stage_utilisation)


def test_without_preemption_nothing_is_lost_and_fixed_pipelines_keep_going():
    calm = dataclasses.replace(
        PREEMPTED, num_peers=64, microbatches_in_flight=128, trainers=8, duration_s=200.0, mean_lifetime_s=math.inf
    )
    for mode in ("swarm", "fixed"):
        report = simulate(dataclasses.replace(calm, mode=mode))
        assert report.deaths == report.joins == report.lost_microbatches == report.failed_hops == 0
        assert report.lost_work_fraction == 0.0
        assert second_half(report) >= 0.5 * max(report.tokens_per_s_windows)


def test_trainers_route_with_the_real_replica_balancer():
    sim = Simulation(dataclasses.replace(PREEMPTED, num_peers=32, duration_s=30.0))
    sim.run()
    assert sim.balancers and all(type(b) is ReplicaBalancer for b in sim.balancers)
    assert sum(len(b.estimates(0)) for b in sim.balancers) > 0  # they measured replicas of stage 0


def test_a_run_is_reproducible():
    config = dataclasses.replace(PREEMPTED, num_peers=48, duration_s=60.0, trainers=4, microbatches_in_flight=64)
    a, b = simulate(config), simulate(config)
    assert (a.tokens_per_s, a.deaths, a.moves, a.events) == (b.tokens_per_s, b.deaths, b.moves, b.events)


def test_cli_prints_a_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert (
        main(
            [
                "--peers",
                "40",
                "--stages",
                "4",
                "--duration",
                "60",
                "--in-flight",
                "64",
                "--trainers",
                "4",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert "swarm" in capsys.readouterr().out
    reports = json.loads(out.read_text())
    assert [r["mode"] for r in reports] == ["swarm", "fixed"]
    assert reports[0]["peers"] == 40 and len(reports[0]["stage_utilisation"]) == 4


def test_config_rejects_nonsense():
    with pytest.raises(ValueError, match="mode"):
        SimConfig(mode="ring")
    with pytest.raises(ValueError, match="num_peers"):
        SimConfig(num_peers=3, num_stages=8)
