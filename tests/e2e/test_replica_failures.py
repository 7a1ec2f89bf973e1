"""Replicas come and go, training goes on: `swarm up` with 4 stages x 2 replicas and 2
trainers; one replica of every stage is killed with SIGKILL while they train."""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import re
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from shared import checkpoint
from tests.e2e.conftest import SWARM, get_json, processes_of_run, stop_swarm_up, wait_until

pytestmark = pytest.mark.e2e

STEPS = 60


def stage_server_pids(run_id: str) -> dict[int, list[int]]:
    """PIDs of this run's stage servers, by stage."""
    by_stage: dict[int, list[int]] = {}
    for pid in processes_of_run(run_id):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"services.stage_server" in cmdline:
            by_stage.setdefault(int(env[b"SWARM_STAGE"]), []).append(pid)
    return by_stage


def unread_bytes(pid: int) -> int:
    """Bytes that arrived on ``pid``'s established TCP connections and that it has not read (a
    request waiting for a stopped process), from ``/proc/net/tcp{,6}``."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            if (target := os.readlink(fd)).startswith("socket:["):
                inodes.add(target[8:-1])
    unread = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            cols = row.split()
            if cols[3] == "01" and cols[9] in inodes:  # ESTABLISHED
                unread += int(cols[4].split(":")[1], 16)
    return unread


def test_training_goes_on_when_a_replica_of_every_stage_is_killed(tmp_path):
    run_dir = tmp_path / f"e2e-kill-{os.getpid()}"
    args = [
        *SWARM,
        "up",
        "--stages",
        "4",
        "--replicas",
        "2",
        "--trainers",
        "2",
        "--steps",
        str(STEPS),
        "--heartbeat-s",
        "1",
        "--run-dir",
        str(run_dir),
    ]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()
    output: list[str] = []
    threading.Thread(target=lambda: [(lines.put(x), output.append(x)) for x in proc.stdout], daemon=True).start()
    try:
        coordinator = None
        trainers_past_step_10 = set()
        while len(trainers_past_step_10) < 2:  # both trainers are training
            line = lines.get(timeout=240)
            if found := re.search(r"coordinator (http://\S+),", line):
                coordinator = found[1]
            if "train.step" in line and "step=10 " in line:
                trainers_past_step_10.add(re.search(r"trainer=(\w+)", line)[1])
        assert coordinator, "swarm up did not print the coordinator URL"
        servers = stage_server_pids(run_dir.name)
        assert sorted(servers) == [0, 1, 2, 3] and all(len(p) == 2 for p in servers.values())
        victims = [pids[0] for pids in servers.values()]
        # Stopped first, killed once a trainer's request waits unread at one of them: so at
        # least one hop is in flight to a replica when it dies, whatever the machine's pace
        # (a killed replica that no hop reached would test nothing).
        for pid in victims:
            os.kill(pid, signal.SIGSTOP)
        try:
            wait_until(lambda: sum(map(unread_bytes, victims)) > 0, 30, "a request to wait at a stopped replica")
        finally:
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
        # the registry drops the killed replicas (leases of 3 heartbeats of 1 s)
        wait_until(
            lambda: all(len(s["replicas"]) == 1 for s in get_json(coordinator + "/swarm")["stages"]),
            15,
            "the registry to drop the killed replicas",
        )
        assert proc.wait(timeout=400) == 0, "".join(output[-40:])
    finally:
        stop_swarm_up(proc)

    summaries = [json.loads((run_dir / f"summary-{t}.json").read_text()) for t in (0, 1)]
    # the two trainers fed the run's global steps together (STEPS x 4 microbatches between them)
    assert sum(x["microbatches_completed"] for x in summaries) >= STEPS * 4
    meta = checkpoint.read_meta(checkpoint.latest_checkpoint(run_dir / "checkpoints"))
    assert set(meta["stage_steps"].values()) == {STEPS}, meta  # every stage took every step of the run
    for summary in summaries:
        # every scheduled microbatch completed: the hops that hit a killed replica were retried
        assert summary["microbatches_completed"] == summary["microbatches_scheduled"]
        assert summary["microbatches_failed"] == 0 and summary["steps"] == STEPS
        losses = [
            x for x in summary["step_losses"] if x is not None and not math.isnan(x)
        ]  # a step it fed nothing of: NaN
        after_kill = losses[15:]
        assert sum(after_kill[-10:]) / 10 < sum(after_kill[:10]) / 10 - 0.05, "the loss stopped falling after the kills"
        assert summary["eval_loss_after"] < summary["eval_loss_before"] - 1.0
        # what the swarm lost, per stage, as the coordinator counted it: a replica of every
        # stage survived, holding the stage's step, so no step's update was lost
        assert [x["stage"] for x in summary["swarm_losses"]] == [0, 1, 2, 3]
        assert all(x["steps_lost_total"] == 0 and x["steps_lost"] == [] for x in summary["swarm_losses"])
    assert any("hop.failed" in x or "chain.rerouted" in x for x in output), (
        "no hop hit a killed replica: the test did not test anything"
    )
    assert processes_of_run(run_dir.name) == []
