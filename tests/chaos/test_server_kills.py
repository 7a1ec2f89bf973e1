"""Chaos: about 2 minutes of training with 4 stages x 2 replicas while a random stage
server is killed with SIGKILL and restarted (same port, stage and settings) every 10 s.

Every scheduled microbatch completes or is reported (none lost), every restarted server
serves only after it downloaded its stage's state from its live peer, and the loss keeps
falling. The victim is drawn (seeded) among the servers whose stage's other replica
serves, so a stage never loses both replicas at once: the issue asks what the swarm does
when replicas die, not when a whole stage does (checkpoints cover that,
tests/e2e/test_resume_export.py). A restart takes 5-60 s on 2 busy cores (torch import,
state download), so a server still restarting is often hit again.
"""

from __future__ import annotations

import math
import random
import subprocess
import time

import pytest

from tests.chaos.swarm import ChaosSwarm, Member, health, read_events, steps_done, summary_of
from tests.e2e.conftest import wait_until

pytestmark = pytest.mark.e2e

STAGES, REPLICAS = 4, 2
HEARTBEAT_S = 0.5  # leases of 1.5 s: a killed server leaves the registry fast
CHAOS_S = 120.0  # the kills go on this long, or until the trainer is done
KILL_EVERY_S = 10.0
# global batches: more than CHAOS_S of training on 2 idle cores, so the kills go on for their 2 minutes (measured:
# 100 steps in 172 s with 11 kills; the kills slow the steps to ~1.7 s, the steps after them take ~0.6 s)
STEPS = 100
GLOBAL_BATCH, MICROBATCH = 32, 8  # samples per step, per microbatch
SEED = 6
# Every server works like a device slower than these cores (+0.05 s per forward pass of
# work): the run's length then depends little on how busy the 2 shared cores are, and the
# cores have time left for the restarts (each imports torch).
SERVER = {
    "SWARM_GLOBAL_BATCH": str(GLOBAL_BATCH),
    "SWARM_INJECT_DELAY_S": "0.05",
}  # GLOBAL_BATCH >= in_flight x microbatch: see "Staleness" in docs/architecture.md
TRAINER = {
    "SWARM_STEPS": str(STEPS),
    "SWARM_MICROBATCH_SIZE": str(MICROBATCH),
    "SWARM_SEQ_LEN": "64",
    "SWARM_IN_FLIGHT": "4",
    "SWARM_SEED": "1",
}


def serving(server: Member, listed: set[str]) -> bool:
    """The server runs, is listed by the coordinator and answers /health."""
    return server.alive and server.url in listed and (h := health(server.url)) is not None and h["status"] == "ok"


def kill_and_restart_every(swarm: ChaosSwarm, trainer: Member, rng: random.Random) -> list[str]:
    """Every KILL_EVERY_S for CHAOS_S (or until the trainer exits): SIGKILL a random server
    whose stage has all its other replicas serving, and start it again at once. A server
    still restarting (importing, downloading its state) may be hit again. Returns the
    victims' names."""
    victims = []
    started = time.monotonic()
    next_kill = started + KILL_EVERY_S
    while next_kill < started + CHAOS_S:
        try:  # the schedule: wait for the next kill, or for the end of training
            trainer.proc.wait(timeout=max(0.0, next_kill - time.monotonic()))
            break
        except subprocess.TimeoutExpired:
            pass
        next_kill += KILL_EVERY_S
        listed = swarm.listed()
        up = {s.name for s in swarm.servers if serving(s, listed)}
        candidates = [
            s for s in swarm.servers if all(p.name in up for p in swarm.servers if p.stage == s.stage and p is not s)
        ]
        if not candidates:  # (only if /health of both replicas of every stage was too slow to answer)
            continue
        victim = rng.choice(candidates)
        swarm.kill(victim)
        swarm.restart(victim)
        victims.append(victim.name)
    return victims


def test_training_survives_a_server_killed_and_restarted_every_10_s(processes):
    swarm = ChaosSwarm(processes, num_stages=STAGES, heartbeat_s=HEARTBEAT_S)
    swarm.start_coordinator({"SWARM_AVERAGE_EVERY_S": "5"})  # averaging rounds run (and lose members) too
    for stage in range(STAGES):
        for _ in range(REPLICAS):
            swarm.add_server(stage, SERVER)
    swarm.wait_serving()
    trainer = swarm.start_trainer("trainer", TRAINER)
    wait_until(lambda: steps_done(trainer) >= 1 or not trainer.alive, 120, "the trainer's first step", poll_s=0.2)

    began = time.monotonic()
    victims = kill_and_restart_every(swarm, trainer, random.Random(SEED))
    status = trainer.proc.wait(timeout=300)
    trained_s = time.monotonic() - began
    swarm.wait_serving()  # the last victim is back too

    summary = summary_of(trainer)
    failed_events = trainer.events("microbatch.failed")
    hop_failures = trainer.events("hop.failed") + trainer.events(
        "chain.rerouted"
    )  # stage 0's hops, and the later stages' (chain routing)
    losses = [x for x in summary["step_losses"] if x is not None]
    print(
        f"\nchaos: {len(victims)} kills in {trained_s:.0f} s of training, microbatches "
        f"{summary['microbatches_scheduled']} scheduled / {summary['microbatches_completed']} completed / "
        f"{summary['microbatches_failed']} failed, {len(hop_failures)} hops retried or rerouted; step loss "
        f"{sum(losses[:20]) / 20:.3f} -> {sum(losses[-20:]) / 20:.3f}, eval {summary['eval_loss_before']:.3f} -> "
        f"{summary['eval_loss_after']:.3f}"
    )

    # none lost: every scheduled microbatch completed or was reported, one line each
    assert status == (1 if summary["microbatches_failed"] else 0), (
        f"trainer exited with {status}; log: {trainer.logs[-1]}"
    )
    assert summary["steps"] == steps_done(trainer) == STEPS  # every step complete: each of its microbatches resolved
    assert summary["microbatches_completed"] + summary["microbatches_failed"] == summary["microbatches_scheduled"]
    # Stage 0's STEPS global batches: each sample in them from a completed microbatch, counted
    # once; none scheduled beyond the run's steps; what the kills cost (gradients and
    # reservations a killed replica held: the steps it had a part in hold fewer samples) bounded.
    steps = [e for e in swarm.coordinator.events("step.done") if e["stage"] == 0]
    stepped = sum(e["effective_batch"] for e in steps)
    completed, scheduled = summary["microbatches_completed"], summary["microbatches_scheduled"]
    assert len(steps) == STEPS
    assert stepped <= completed * MICROBATCH <= scheduled * MICROBATCH <= STEPS * GLOBAL_BATCH
    # two steps (the one-step lead) per kill
    assert STEPS * GLOBAL_BATCH - stepped <= 2 * GLOBAL_BATCH * len(victims), (stepped, victims)
    assert len(summary["failures"]) == len(failed_events) == summary["microbatches_failed"]
    assert summary["microbatches_failed"] <= summary["microbatches_scheduled"] // 50, summary["failures"][:5]

    # the chaos happened: a kill every 10 s, and kills hit microbatches in flight
    ticks = math.ceil(min(trained_s, CHAOS_S) / KILL_EVERY_S) - 1  # kills at 10, 20, ... s while training lasted
    assert abs(len(victims) - ticks) <= 1, (ticks, victims)
    assert hop_failures, "no hop hit a killed server: the test tested nothing"
    assert {e["code"] for e in hop_failures} <= {"unreachable", "timeout"}, {e["code"] for e in hop_failures}

    # no server ever served without the state of its live peer; none crashed a request
    for server in swarm.servers:
        assert server.alive, f"{server.name} exited with {server.proc.returncode}"
        for log in server.logs[1:]:  # its restarts; one killed before it registered never served
            events = [e["event"] for e in read_events(log)]
            if "membership.registered" in events:
                joined = [e for e in read_events(log) if e["event"] == "stage.joined"]
                assert joined and joined[0]["source"] == "peer", f"{log.name} served without joining from a peer"
                assert events.index("stage.joined") < events.index("membership.registered")
        assert not server.events("request.crashed"), server.events("request.crashed")[:2]

    # the loss keeps falling through the kills
    assert len(losses) >= STEPS - summary["microbatches_failed"]
    assert sum(losses[-20:]) / 20 < sum(losses[:20]) / 20 - 0.5, "the loss did not fall"
    thirds = [losses[i * len(losses) // 3 : (i + 1) * len(losses) // 3] for i in range(3)]
    means = [sum(t) / len(t) for t in thirds]
    # Falling, not flat-lined: the middle third well below the first, the last not above the
    # middle beyond noise (past ~2.8 the tiny model falls slowly: a third can tie the one before).
    assert means[1] < means[0] - 0.5 and means[2] < means[1] + 0.05, (
        f"the loss stopped falling: mean per third of the run {means}"
    )
    assert summary["eval_loss_after"] < summary["eval_loss_before"] - 1.0
