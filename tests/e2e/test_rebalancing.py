"""Rebalancing end to end: 2 stages, 3 equal replicas on stage 0 and 1 on stage 1. The
coordinator moves one replica to stage 1, and the swarm's measured throughput rises.
The trainer keeps two global batches in flight (16 microbatches of 4, global batch 32):
with only one, every step drains the pipeline and waits for its all-reduce, so a move
gains little; the stale re-runs this costs stay few (docs/architecture.md, "Staleness")."""

from __future__ import annotations

import json
import time

import pytest

from tests.e2e.conftest import get_json, wait_until

# alone: its throughput before and after the move was measured on an idle machine (Makefile, `make test`)
pytestmark = [pytest.mark.e2e, pytest.mark.alone]

DELAY_S = 0.02  # injected seconds per forward of work: the servers' speed, independent of CPU contention


def replicas_per_stage(coordinator: str) -> list[int]:
    return [len(s["replicas"]) for s in get_json(coordinator + "/swarm")["stages"]]


def steps_per_s(metrics_file, since_s: float, until_s: float) -> float:
    """Trainer steps per second completed between two times (seconds since the trainer started)."""
    records = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    window = [r for r in records if since_s <= r["elapsed_s"] <= until_s]
    assert len(window) >= 5, f"too few steps between {since_s} and {until_s} s: {len(window)}"
    return (window[-1]["step"] - window[0]["step"]) / (window[-1]["elapsed_s"] - window[0]["elapsed_s"])


def test_coordinator_moves_a_replica_to_the_weak_stage_and_throughput_rises(processes, tmp_path):
    # the async schedule keeps two global batches in flight across step boundaries, so that the
    # steps' rate follows the weakest stage's capacity; under the sync default every step also
    # drains the pipeline and waits for its round, a fixed cost per step that a move does not
    # shrink (measured here: 1.29 -> 1.78 steps/s, 1.38x). Stage 1's lone replica gets a partner
    # on the second check (the resilience rule needs no throughput measured): checks every 10 s
    # leave the trainer some 10 s of steps before the move
    _, coordinator = processes.coordinator(
        heartbeat_s=0.5,
        num_stages=2,
        extra={"SWARM_REBALANCE_EVERY_S": "10", "SWARM_AVERAGE_EVERY_S": "0", "SWARM_SCHEDULE": "async"},
    )
    server_env = {
        "SWARM_NUM_STAGES": "2",
        "SWARM_INJECT_DELAY_S": str(DELAY_S),
        "SWARM_GLOBAL_BATCH": "32",
        "SWARM_WIRE_CODEC": "fp32",
    }
    for stage in (0, 0, 0, 1):
        processes.server(stage, coordinator=coordinator, heartbeat_s=0.5, extra=server_env)
    wait_until(lambda: replicas_per_stage(coordinator) == [3, 1], 120, "3 replicas on stage 0 and 1 on stage 1")
    metrics = tmp_path / "metrics.jsonl"
    trainer_env = {
        "SWARM_NUM_STAGES": "2",
        "SWARM_COORDINATOR": coordinator,
        "SWARM_MDNS": "false",
        "SWARM_STEPS": "100000",
        "SWARM_MICROBATCH_SIZE": "4",
        "SWARM_SEQ_LEN": "32",
        "SWARM_IN_FLIGHT": "16",
        "SWARM_HEARTBEAT_S": "0.5",
        "SWARM_METRICS_FILE": str(metrics),
        "SWARM_LOG_EVERY": "1000",
        "SWARM_WIRE_CODEC": "fp32",
    }
    processes.start("trainer", "services.trainer", trainer_env)
    wait_until(lambda: metrics.exists() and len(metrics.read_text().splitlines()) > 0, 120, "the trainer's first step")
    started = time.monotonic() - json.loads(metrics.read_text().splitlines()[0])["elapsed_s"]

    wait_until(lambda: replicas_per_stage(coordinator) == [2, 2], 90, "the coordinator to move a replica to stage 1")
    moved_at = time.monotonic() - started
    wait_until(
        lambda: time.monotonic() - started > moved_at + 14, 40, "14 seconds of training after the move", poll_s=0.5
    )
    before = steps_per_s(metrics, 0.0, moved_at - 3.0)
    # The swarm as moved, once settled: the rate climbs for several seconds after the move
    # (measured alone on 2 cores, 2026-11-26, in 4 s windows against the rate before: 1.14-1.32x
    # in the first 4 s, 1.59-1.75x from 5 to 9 s, 1.6-2.0x after).
    after = steps_per_s(metrics, moved_at + 4.0, moved_at + 14.0)
    print(f"\nrebalancing: {before:.2f} -> {after:.2f} steps/s after the move at {moved_at:.1f} s")
    # Measured alone on 2 cores, 2026-11-26: 1.69x, 1.73x, 1.66x (measured 1-8 s after the
    # move as before, it failed alone once in three: 1.34x).
    assert after > 1.4 * before, f"throughput {before:.2f} -> {after:.2f} steps/s"
    log = (tmp_path / "coordinator.log").read_text()
    # the servers report RTTs, so the coordinator places with the network cost model (SWARM_PLACEMENT=auto), but
    # four servers on two stages must not leave stage 1 with one replica while stage 0 has three: the resilience
    # rule moves one first, whatever the network (docs/architecture.md, "Rebalancing")
    assert "placement=topology" in log, "the servers' RTTs did not make the coordinator place by the network"
    assert "reason='stage 1 has one replica" in log, "the move was not ordered to keep stage 1 alive"
