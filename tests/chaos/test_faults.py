"""Faults on a small swarm: a slow replica, a replica that returns garbage, a trainer killed
mid-step, 32 concurrent microbatch streams against servers with a small queue, and the
coordinator killed and restarted mid-run.

The tests share one swarm (a coordinator with checkpoints, and one server of each of 2
stages with ``SWARM_MAX_QUEUE=4``), started once for the module: each process start costs
seconds of torch import on 2 cores. Each test leaves the swarm as it found it (faulty
replicas it adds are stopped at its end), and checks that the shared servers are serving
when it starts. The coordinator test comes last: it restarts the coordinator.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from shared.codec import encode_tensor, pack_message
from shared.http import MSGPACK
from tests.chaos.swarm import ChaosSwarm, Member, health, read_events, steps_done, summary_of, vm_rss_mib
from tests.e2e.conftest import Processes, get_json, processes_of_run, wait_until

pytestmark = pytest.mark.e2e

HEARTBEAT_S = 1.0  # leases of 3 s
# These tests load the servers as hard as a trainer can: the async schedule with a bound of
# 16 steps (coordinator and servers alike) admits the load test's 32 microbatches in flight,
# where the sync default would admit one global batch (2 microbatches) and no queue would fill.
STALENESS = "16"
SERVER = {"SWARM_MAX_QUEUE": "4", "SWARM_GLOBAL_BATCH": "16", "SWARM_MAX_STALENESS": STALENESS}
TRAINER = {"SWARM_MICROBATCH_SIZE": "8", "SWARM_SEQ_LEN": "64", "SWARM_IN_FLIGHT": "4"}
MICROBATCHES_PER_STEP = 2  # SWARM_GLOBAL_BATCH / SWARM_MICROBATCH_SIZE
CHECKPOINT_EVERY_S = 5.0


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    processes = Processes(f"chaos-faults-{os.getpid()}", tmp_path_factory.mktemp("faults"))
    try:
        swarm = ChaosSwarm(processes, num_stages=2, heartbeat_s=HEARTBEAT_S)
        swarm.start_coordinator(
            {
                "SWARM_CHECKPOINT_DIR": str(processes.log_dir / "checkpoints"),
                "SWARM_CHECKPOINT_EVERY_S": str(CHECKPOINT_EVERY_S),
                "SWARM_SCHEDULE": "async",
                "SWARM_MAX_STALENESS": STALENESS,
            }
        )
        for stage in (0, 1):
            swarm.add_server(stage, SERVER)
        swarm.wait_serving()
        yield swarm
    finally:
        processes.stop_all()
    assert processes_of_run(processes.run_id) == [], "a process of this module outlived it"


def shared_servers(swarm: ChaosSwarm) -> list[Member]:
    """The module's own servers (one per stage), checked to be serving."""
    servers = swarm.servers[:2]
    swarm.wait_serving(servers, timeout_s=30)
    return servers


def stats(server: Member) -> dict:
    return get_json(server.url + "/health")["stats"]


def hops(server: Member) -> int:
    """Forwards and backwards the server computed and answered (a backward of a re-run
    microbatch is answered, not accumulated again: it counts in ``backwards_run`` only)."""
    s = stats(server)
    return s["forwards"] + s["backwards_run"]


def stop(swarm: ChaosSwarm, servers: list[Member]) -> None:
    """SIGTERM (drain, deregister) and remove from the swarm."""
    for s in servers:
        if s.alive:
            s.proc.send_signal(signal.SIGTERM)
    for s in servers:
        s.proc.wait(timeout=30)
        swarm.servers.remove(s)


def check_none_lost(trainer: Member, steps: int, *, fed_all: bool = True) -> dict:
    """The trainer exited 0 with every scheduled microbatch completed; returns its summary.
    ``fed_all=False``: another trainer's microbatches (killed, their samples accumulated)
    filled part of these steps, and the coordinator's admission had this one feed the rest."""
    status = trainer.proc.wait(timeout=240)
    assert status == 0, f"{trainer.name} exited with {status}; log: {trainer.logs[-1]}"
    summary = summary_of(trainer)
    assert summary["microbatches_failed"] == 0 and not summary["failures"], summary["failures"][:3]
    # every step's samples fed; more if a step took more than the global batch (replicas
    # that stepped alone while the coordinator was away, then joined its count): topped up
    assert (
        summary["microbatches_completed"]
        == summary["microbatches_scheduled"]
        >= (steps * MICROBATCHES_PER_STEP if fed_all else 1)
    )
    assert steps_done(trainer) == steps
    return summary


# ---------------------------------------------------------------- a slow and a garbage replica
def test_a_slow_replica_gets_less_work_and_a_garbage_replica_is_banned(swarm):
    fast0, fast1 = shared_servers(swarm)
    slow0 = swarm.add_server(
        0, {**SERVER, "SWARM_INJECT_DELAY_S": "0.2"}
    )  # +0.2 s a forward, 0.4 s a backward: ~10x a hop here
    garbage1 = swarm.add_server(
        1, {**SERVER, "SWARM_INJECT_GARBAGE": "1"}
    )  # every /forward, /backward reply is random bytes
    try:
        swarm.wait_serving([slow0, garbage1])
        before = {s.name: hops(s) for s in (fast0, fast1)}
        steps = 40
        trainer = swarm.start_trainer("trainer-faulty", {**TRAINER, "SWARM_STEPS": str(steps)})
        check_none_lost(trainer, steps)
        work = {s.name: hops(s) - before.get(s.name, 0) for s in (fast0, fast1, slow0, garbage1)}
    finally:
        stop(swarm, [slow0, garbage1])
    failures = trainer.events("hop.failed") + trainer.events(
        "chain.rerouted"
    )  # stage 0's hops, and the later stages' (chain routing)
    print(
        f"\nfaulty replicas: hops served {work}; {len(failures)} hops failed: "
        f"{sorted({(e['code'], e['replica']) for e in failures})}"
    )

    # the trainer measured the slow replica and sent it a fraction of the work
    assert 0 < work[slow0.name] < work[fast0.name] / 2, work
    # every garbage reply was a failed hop, retried on the other replica; the garbage
    # replica was banned (backoff doubling per failure) and got almost nothing after.
    # (503s may come too: the checkpointer's GET /state shares the queue of 4 with 4 microbatches)
    garbage = [e for e in failures if e["code"] == "bad_reply"]
    assert {e["code"] for e in failures} <= {"bad_reply", "overloaded"}, failures[:3]
    assert garbage and {e["replica"] for e in garbage} == {garbage1.url}, garbage[:3]
    assert len(garbage) == work[garbage1.name], "a garbage reply was taken for a good one (or a good one for garbage)"
    assert work[garbage1.name] <= 12, work  # bans of 1, 2, 4, 8, ... s over the run


# ---------------------------------------------------------------- a trainer killed mid-step
def test_servers_keep_serving_when_a_trainer_is_killed_mid_step(swarm):
    servers = shared_servers(swarm)
    killed = swarm.start_trainer("trainer-killed", {**TRAINER, "SWARM_STEPS": "100000", "SWARM_IN_FLIGHT": "8"})
    wait_until(lambda: steps_done(killed) >= 5, 120, "the trainer's 5th step", poll_s=0.1)
    # kill it while the servers hold its work: requests queued or computing
    wait_until(
        lambda: sum(h["queue_depth"] for s in servers if (h := health(s.url))) >= 2,
        30,
        "work queued on the servers",
        poll_s=0.005,
    )
    killed.proc.kill()
    assert killed.proc.wait(timeout=10) == -signal.SIGKILL
    trained = steps_done(killed)

    # the servers finish or drop the orphaned work: queues back to 0, every server alive
    wait_until(
        lambda: all((h := health(s.url)) and h["queue_depth"] == 0 for s in servers),
        30,
        "the servers' queues to drain",
        poll_s=0.1,
    )
    for s in servers:
        assert s.alive, f"{s.name} exited with {s.proc.returncode}"
        assert not s.events("request.crashed"), s.events("request.crashed")[:2]
        assert not [e for e in s.events() if e.get("level") in ("error", "critical")], [
            e for e in s.events() if e.get("level") in ("error", "critical")
        ][:2]

    # a trainer restarted where the killed one was trains on: nothing failed, no hop but a 503
    steps = trained + 20
    trainer = swarm.start_trainer(
        "trainer-after-kill", {**TRAINER, "SWARM_STEPS": str(steps), "SWARM_START_STEP": str(trained)}
    )
    check_none_lost(trainer, steps - trained, fed_all=False)
    # (a 503 may come: the checkpointer's GET /state shares the queue of 4 with 4 microbatches in flight)
    assert {e["code"] for e in trainer.events("hop.failed") + trainer.events("chain.rerouted")} <= {"overloaded"}, (
        trainer.events("hop.failed")[:3]
    )
    print(
        f"\ntrainer killed after {trained} steps with work queued; the next trained steps {trained}..{steps - 1}, "
        f"{len(trainer.events('hop.failed'))} hops retried after a 503"
    )


# ---------------------------------------------------------------- load: 32 streams
LOAD_STEPS = 64
# RSS: an idle tiny-model server holds ~400 MiB (torch). What the load may add: 32 request
# bodies of 256 KiB, 16 cached forward graphs of a few MiB, allocator slack (measured:
# +20..110 MiB). Past these bounds something piles up: requests beyond the queue, graphs.
RSS_LOAD_MIB = 512  # peak during the load over the server's RSS before it
RSS_GROWTH_MIB = 64  # peak in the second half of the load over the first: growth without bound


def metric_counts(url: str, endpoint: str) -> dict[str, float]:
    """Requests answered by status for one endpoint, from the server's /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    counts: dict[str, float] = {}
    for found in re.finditer(r"^swarm_http_requests_total\{([^}]*)\} (\S+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', found[1]))
        if labels.get("endpoint") == endpoint:
            counts[labels["status"]] = counts.get(labels["status"], 0) + float(found[2])
    return counts


def probe_forward(url: str, run_id: str) -> tuple[int, dict]:
    """One eval forward to stage 0 (nothing cached): (status, headers)."""
    body = pack_message(
        {
            "run_id": run_id,
            "stage": 0,
            "microbatch_id": "probe",
            "seed": 0,
            "eval": True,
            "inputs": encode_tensor(torch.zeros(8, 64, dtype=torch.long), "raw"),
        }
    )
    request = urllib.request.Request(url + "/forward", data=body, headers={"Content-Type": MSGPACK}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers)


def test_32_concurrent_streams_get_503_beyond_the_queue_and_none_is_lost(swarm):
    servers = shared_servers(swarm)
    paths = ("/forward", "/backward")
    before = {(s.name, p): metric_counts(s.url, p) for s in servers for p in paths}
    idle_rss = {s.name: vm_rss_mib(s.proc.pid) for s in servers}
    rss: dict[str, list[tuple[float, float]]] = {s.name: [] for s in servers}
    # 32 microbatches in flight against queues of 4: most requests meet a full queue. The
    # trainer retries a 503 after its backoff (0.05 s doubling to 2 s): 40 retries give
    # a microbatch over a minute of patience, however the streams interleave.
    # relay routing: the 503s of the queues are the trainer's own to wait out, on /forward and /backward
    trainer = swarm.start_trainer(
        "trainer-load",
        {
            **TRAINER,
            "SWARM_STEPS": str(LOAD_STEPS),
            "SWARM_IN_FLIGHT": "32",
            "SWARM_MAX_RETRIES": "40",
            "SWARM_ROUTING": "relay",
        },
    )

    # meanwhile: a probe until it meets a 503 (to see its Retry-After), and the RSS of each server
    overloaded: list[dict] = []

    def probe() -> None:
        while trainer.alive and not overloaded:
            status, headers = probe_forward(servers[0].url, swarm.processes.run_id)
            if status == 503:
                overloaded.append(headers)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    wait_until(lambda: trainer.events("train.start") or not trainer.alive, 120, "the load to start", poll_s=0.05)
    started = time.monotonic()
    while trainer.alive:
        for s in servers:
            if (mib := vm_rss_mib(s.proc.pid)) is not None:
                rss[s.name].append((time.monotonic() - started, mib))
        try:
            trainer.proc.wait(timeout=0.2)  # the sampling period
        except subprocess.TimeoutExpired:
            pass
    prober.join(timeout=35)
    summary = check_none_lost(trainer, LOAD_STEPS)

    after = {(s.name, p): metric_counts(s.url, p) for s in servers for p in paths}
    answered = {k: {status: after[k].get(status, 0) - before[k].get(status, 0) for status in after[k]} for k in after}
    refused = sum(n for counts in answered.values() for status, n in counts.items() if status == "503")
    retried = trainer.events("hop.failed")
    peaks = {name: max(m for _, m in samples) for name, samples in rss.items()}
    halves = {
        name: (
            max(m for t, m in samples if t < samples[-1][0] / 2),
            max(m for t, m in samples if t >= samples[-1][0] / 2),
        )
        for name, samples in rss.items()
    }
    print(
        f"\nload: 32 streams, {summary['microbatches_completed']}/{summary['microbatches_scheduled']} microbatches in "
        f"{summary['elapsed_s']:.1f} s; answers by server and endpoint {answered}; RSS MiB before {idle_rss}, peak "
        f"{peaks}, peak in first/second half {halves}, {sum(map(len, rss.values()))} samples"
    )

    # the servers refused what their queue could not hold, and nothing else went wrong but
    # the staleness bound: a backward refused as stale (409 stale_forward; the admission keeps
    # the 256 samples in flight within the bound, so there are few if any) ran its microbatch
    # again from the start, counted by the trainer, and it was not lost (check_none_lost)
    assert refused > 0, f"no 503: 32 streams never filled a queue of 4 ({answered})"
    others = {
        key: {
            status: n
            for status, n in counts.items()
            if n and status not in ("200", "503") and not (status == "409" and key[1] == "/backward")
        }
        for key, counts in answered.items()
    }
    assert not any(others.values()), others
    stale = sum(
        n
        for (_, path), counts in answered.items()
        for status, n in counts.items()
        if path == "/backward" and status == "409"
    )
    assert stale == summary["microbatch_reruns"], (
        stale,
        summary["microbatch_reruns"],
    )  # every refusal re-ran its microbatch, once
    assert retried and all(e["status"] == 503 and e["code"] == "overloaded" for e in retried), {
        (e["status"], e["code"]) for e in retried
    }
    assert overloaded and int(overloaded[0].get("Retry-After", "0")) >= 1, overloaded[:1]
    # memory stays bounded: the load adds little, and it does not grow from the first half to the second
    for name, (first, second) in halves.items():
        assert peaks[name] < idle_rss[name] + RSS_LOAD_MIB, (
            f"{name}: RSS {idle_rss[name]:.0f} MiB idle, {peaks[name]:.0f} MiB under load"
        )
        assert second <= first + RSS_GROWTH_MIB, f"{name}: RSS grew from {first:.0f} to {second:.0f} MiB"


# ---------------------------------------------------------------- the coordinator killed mid-run
def post_checkpoint(coordinator: str) -> dict:
    request = urllib.request.Request(
        coordinator + "/checkpoint", data=b"{}", headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.loads(resp.read())


def test_training_goes_on_while_the_coordinator_is_killed_and_restarted(swarm):
    servers = shared_servers(swarm)
    coordinator = swarm.coordinator
    steps = 150
    trainer = swarm.start_trainer("trainer-coordinator-kill", {**TRAINER, "SWARM_STEPS": str(steps)})
    wait_until(lambda: steps_done(trainer) >= 10, 120, "10 steps of training", poll_s=0.1)
    # a checkpoint of this run's progress exists: asked for now rather than awaited from the
    # periodic checkpointer, so that the kill comes early in the trainer's run (waiting up to
    # two periods for a later checkpoint once let the trainer get within 10 steps of its end
    # before the kill, and it could not train 10 steps more while the coordinator was down)
    saved = post_checkpoint(coordinator.url)
    before = get_json(coordinator.url + "/run")
    assert before["step"] >= saved["step"] >= 10 and Path(before["checkpoint"]).is_dir(), (saved, before)
    failed_before = {s.name: len(s.events("membership.failed")) for s in servers}
    registered_before = {s.name: len(s.events("membership.registered")) for s in servers}

    swarm.kill(coordinator)
    killed_at, steps_at_kill = time.monotonic(), steps_done(trainer)
    assert steps_at_kill <= steps - 30, (
        f"the trainer is at step {steps_at_kill} of {steps} already: too close to its end"
    )
    # down for longer than a lease: the servers' heartbeats fail and their leases run out;
    # the trainer keeps training on its last view of the swarm
    lease_s = 3 * HEARTBEAT_S
    wait_until(
        lambda: (
            time.monotonic() - killed_at > lease_s + HEARTBEAT_S
            and steps_done(trainer) >= steps_at_kill + 10
            and all(len(s.events("membership.failed")) > failed_before[s.name] for s in servers)
        ),
        60,
        "training and failed heartbeats while the coordinator is down",
        poll_s=0.1,
    )
    assert trainer.alive
    trained_while_down = steps_done(trainer) - steps_at_kill
    swarm.restart(coordinator)
    swarm.wait_coordinator()
    down_s = time.monotonic() - killed_at
    after = get_json(coordinator.url + "/run")
    saved_since = [e for e in read_events(coordinator.logs[-1]) if e.get("event") == "checkpoint.saved"]

    # the restarted coordinator comes back with the run: its id, step and checkpoint
    assert after["run_id"] == before["run_id"] == swarm.processes.run_id
    if not saved_since:  # (a new checkpoint may already have been taken: then it is a later one)
        assert (after["step"], after["checkpoint"]) == (before["step"], before["checkpoint"])
    assert after["step"] >= before["step"] and Path(after["checkpoint"]).is_dir()
    # ...and its assignment, as the servers heartbeat again (404: the lease ran out) and re-register
    wait_until(
        lambda: get_json(coordinator.url + "/run")["assignment"] == before["assignment"],
        30,
        f"the assignment {before['assignment']}",
        poll_s=0.1,
    )
    wait_until(
        lambda: all(len(s.events("membership.registered")) == registered_before[s.name] + 1 for s in servers),
        10,
        "each server to log its new registration",
    )

    # training went on through the restart without losing a microbatch (a stage listed
    # empty before its server heartbeats again does not empty the trainer's view)
    summary = check_none_lost(trainer, steps)
    assert trainer.events("registry.unreachable"), "the trainer never noticed the coordinator was down"
    # and the restarted coordinator checkpoints the run on, the steps trained since the kill included
    saved = post_checkpoint(coordinator.url)
    assert saved["step"] > before["step"] and get_json(coordinator.url + "/run")["checkpoint"] == saved["path"], (
        before,
        saved,
    )
    print(
        f"\ncoordinator killed at step {steps_at_kill}, down {down_s:.1f} s while the trainer trained "
        f"{trained_while_down} steps; /run before {before}, right after the restart {after}; training ended "
        f"{summary['microbatches_completed']}/{summary['microbatches_scheduled']}"
    )
