"""A small training swarm for the observability e2e tests: a coordinator, two stages (two
replicas of stage 0, one of stage 1, so stage 1 is the weakest) and one trainer that
trains until the test stops it. Every process is on loopback with mDNS off and is
stopped by the ``processes`` fixture."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

from shared.processes import wait_healthy
from tests.e2e.conftest import Processes, get_json, wait_until

START_S = 90  # several children import torch at once on 2 cores
REPLICAS = (2, 1)  # per stage
MODEL = {"SWARM_NUM_STAGES": str(len(REPLICAS)), "SWARM_WIRE_CODEC": "fp32"}  # fp32: no int8 warm-up at start


@dataclass
class SmallSwarm:
    coordinator: str
    servers: list[tuple[int, str]]  # (stage, url)
    trainer: subprocess.Popen


def start_small_swarm(
    processes: Processes, *, trainer_env: dict | None = None, log_format: str = "console"
) -> SmallSwarm:
    common = {**MODEL, "SWARM_LOG_FORMAT": log_format}
    _, coordinator = processes.coordinator(
        heartbeat_s=0.5, num_stages=len(REPLICAS), extra={**common, "SWARM_AVERAGE_EVERY_S": "3"}
    )
    started = []
    for stage, count in enumerate(REPLICAS):
        for _ in range(count):
            started.append(
                (
                    stage,
                    *processes.server(
                        stage, coordinator=coordinator, heartbeat_s=0.5, extra={**common, "SWARM_GLOBAL_BATCH": "8"}
                    ),
                )
            )
    urls = {url for _, _, url in started}

    def all_listed() -> bool:
        for _, proc, url in started:
            assert proc.poll() is None, f"{url} exited with status {proc.returncode}"
        listed = {r["url"] for s in get_json(coordinator + "/swarm")["stages"] for r in s["replicas"]}
        return urls <= listed

    wait_until(all_listed, START_S, "every stage server to register", poll_s=0.2)
    for _, proc, url in started:
        wait_healthy(url, proc, START_S)
    env = {
        **common,
        "SWARM_COORDINATOR": coordinator,
        "SWARM_MDNS": "false",
        "SWARM_HEARTBEAT_S": "0.5",
        "SWARM_STEPS": "100000",
        "SWARM_MICROBATCH_SIZE": "4",
        "SWARM_SEQ_LEN": "32",
        "SWARM_IN_FLIGHT": "4",
        "SWARM_LOG_EVERY": "1000",
        "SWARM_PROGRESS": "off",
        **(trainer_env or {}),
    }
    trainer = processes.start("trainer", "services.trainer", env)
    return SmallSwarm(coordinator, [(stage, url) for stage, _, url in started], trainer)


def trainer_step(coordinator: str) -> int:
    """The latest step the trainer reported to the coordinator (0 before its first report)."""
    trainers = get_json(coordinator + "/dashboard.json")["trainers"]
    return max((points[-1]["step"] for points in trainers.values()), default=0)
