"""A swarm of `--stage auto` servers forms whatever the pace they arrive at (issue 28), as the
README's "Running the parts by hand" and k8s/ start them: real processes on loopback, mDNS off.

Before the fix, a server that joined after others had registered measured its RTTs to them,
so the coordinator placed it with the network planner, which cannot place 3 peers on 4
stages: `/assign` answered 500 and the server exited."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from shared.processes import wait_healthy
from tests.e2e.conftest import get_json, wait_until

pytestmark = pytest.mark.e2e

START_S = 90  # several children import torch at once on 2 cores
SERVER = {"SWARM_NUM_STAGES": "4", "SWARM_WIRE_CODEC": "fp32", "SWARM_GLOBAL_BATCH": "8"}


def listed(coordinator: str) -> dict[str, int]:
    """URL -> stage of every live replica."""
    return {r["url"]: s["stage"] for s in get_json(coordinator + "/swarm")["stages"] for r in s["replicas"]}


def all_listed(coordinator: str, servers: list) -> dict[str, int] | None:
    """The stage of each server once every one is listed (a server that exited fails the test)."""
    for proc, url in servers:
        assert proc.poll() is None, f"{url} exited with status {proc.returncode}"
    stages = listed(coordinator)
    return stages if all(url in stages for _, url in servers) else None


def join(processes, coordinator: str, servers: list, count: int, pace: str, per_stage: int | None) -> None:
    """Start ``count`` more ``--stage auto`` servers, each once the one before registered ("one
    by one") or together ("all at once"); wait until all are listed, ``per_stage`` on every
    stage (if given)."""
    for _ in range(count):
        servers.append(processes.server("auto", coordinator=coordinator, extra=SERVER))
        if pace == "one by one":
            wait_until(lambda: all_listed(coordinator, servers), START_S, "the server to register", poll_s=0.2)

    def placed() -> bool:
        stages = all_listed(coordinator, servers)
        if stages is None or per_stage is None:
            return stages is not None
        return Counter(stages.values()) == {stage: per_stage for stage in range(4)}

    wait_until(placed, START_S, f"the servers to register, {per_stage} on every stage", poll_s=0.2)


def test_stage_auto_servers_fill_every_stage_at_any_pace_then_train(processes, tmp_path):
    """Into a 4-stage run: 2 servers at once (fewer than the stages), 2 more one by one (each
    times the servers before it, as the bug needed), then 4 at once: every stage gets a
    replica, then a second, and a trainer trains through them."""
    # rebalancing on: a stage that an unlucky join leaves short (a hand-out that lapsed before
    # its server registered) gets a replica from a stage with spare
    _, coordinator = processes.coordinator(heartbeat_s=1.0, num_stages=4, extra={"SWARM_REBALANCE_EVERY_S": "1"})
    servers: list = []
    join(processes, coordinator, servers, 2, "all at once", per_stage=None)
    join(processes, coordinator, servers, 2, "one by one", per_stage=1)
    join(processes, coordinator, servers, 4, "all at once", per_stage=2)
    for proc, url in servers:
        wait_healthy(url, proc, START_S)

    summary = tmp_path / "summary.json"
    trainer = processes.start(
        "trainer",
        "services.trainer",
        {
            **SERVER,
            "SWARM_COORDINATOR": coordinator,
            "SWARM_MDNS": "false",
            "SWARM_STEPS": "3",
            "SWARM_MICROBATCH_SIZE": "4",
            "SWARM_SEQ_LEN": "32",
            "SWARM_HEARTBEAT_S": "1.0",
            "SWARM_PROGRESS": "off",
            "SWARM_SUMMARY_FILE": str(summary),
        },
    )
    assert trainer.wait(timeout=180) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    assert json.loads(summary.read_text())["steps"] == 3
    coordinator_log = (tmp_path / "coordinator.log").read_text()
    assert "placement.joiner" in coordinator_log and "has no replica" in coordinator_log, coordinator_log[-3000:]
    assert "request.crashed" not in coordinator_log
