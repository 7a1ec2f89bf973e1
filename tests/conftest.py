"""Shared fixtures: stage servers started in this process on loopback ports; and how
``make test`` shares the two cores between two pytest workers."""

from __future__ import annotations

import asyncio
import os
import random
import time

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from services.stage_server.app import create_app
from shared.config import CoordinatorSettings, StageServerSettings
from shared.wiring import ReplicaBalancer

# `make test` runs in two phases (Makefile). First two pytest workers (pytest-xdist, `--dist
# loadgroup`): a test that starts real processes and trains keeps both cores busy on its own,
# and those tests run one at a time in one group; the in-process tests (one core) and the
# process tests that mostly wait (CPU time / wall time measured on 2 cores) run one at a time
# in the other. Those two groups start at once, the larger first. Process tests whose checks
# are only of results (a loss, a file, an answer; no rate, latency or clock) are a group per
# file: each goes to whichever worker is free first once its group is done, so neither waits
# while the other still has the training tests' tail (the processes worker was the long pole
# by about 300 s). Then, with nothing beside them, the tests marked `alone`: their throughput
# or staleness checks hold on an idle machine only.
PROCESS_TESTS = ("tests/e2e/", "tests/chaos/", "tests/bench/")
# (tests/bench/test_arena_net.py and test_arena.py are marked `alone`: their links' latency
# measures as set only on idle cores, and each checks that the host's namespaces are as before.)
MOSTLY_WAITING = (
    "tests/chaos/test_server_kills.py",  # 0.58 cores: servers slowed by an injected delay, kills on a clock
)
RESULTS_ONLY = (  # their own generous start-up limits, and nothing timed in their checks
    "tests/e2e/test_resume_export.py",
    "tests/e2e/test_lora_finetune.py",
    "tests/e2e/test_llama_from_scratch.py",
    "tests/e2e/test_lm_eval.py",
    "tests/e2e/test_generate.py",
    "tests/e2e/test_progress_e2e.py",
    "tests/e2e/test_metrics.py",
    "tests/e2e/test_dashboard_prompt.py",
)
ONE_AT_A_TIME, IN_PROCESS = "processes", "in-process"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the groups, and before -m deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        path = item.path.relative_to(config.rootpath).as_posix()
        if path.startswith(RESULTS_ONLY):
            group = f"{ONE_AT_A_TIME}:{path}"  # a group of its own: the first worker free takes it
        elif path.startswith(PROCESS_TESTS) and not path.startswith(MOSTLY_WAITING):
            group = ONE_AT_A_TIME
        else:
            group = IN_PROCESS
        item.add_marker(pytest.mark.xdist_group(group))


if os.environ.get("PYTEST_XDIST_WORKER"):  # two workers on two cores: one torch thread each
    import torch

    torch.set_num_threads(1)


class VirtualClock:
    """A clock that tests move by hand (``clock.now += dt``): pure logic takes it instead of ``time.monotonic``."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def balancer_for(urls: list[list[str]], seed: int = 0) -> ReplicaBalancer:
    """A trainer's balancer that knows exactly these replicas per stage."""
    balancer = ReplicaBalancer(len(urls), rng=random.Random(seed))
    for stage, group in enumerate(urls):
        balancer.set_replicas(stage, group)
    return balancer


def stage_settings(stage: int, num_stages: int = 4, **overrides) -> StageServerSettings:
    """Settings built from keywords only, so the caller's SWARM_* environment does not leak in."""
    base = dict(
        model="tiny",
        num_stages=num_stages,
        stage=stage,
        wire_codec="fp32",
        global_batch=10**6,
        seed=0,
        run_id="test",
        mdns=False,
        coordinator="",
    )
    return StageServerSettings(**{**base, **overrides})


def coordinator_settings(**overrides) -> CoordinatorSettings:
    """A coordinator's settings built from keywords only, so the caller's SWARM_* environment
    does not leak in: in memory (no state file, no checkpoints), no mDNS, no signing, and no
    background averaging or rebalancing (POST /average still averages); a lease long enough
    for any test (60 s heartbeats). A test passes only what it needs different."""
    base = dict(
        run_id="test",
        num_stages=4,
        heartbeat_s=60.0,
        lease_heartbeats=3,
        max_servers=4096,
        state_db=":memory:",
        checkpoint_dir="",
        mdns=False,
        coordinator="",
        secret="",
        average_every_s=0,
        rebalance_every_s=0,
        tokenizer="",
        max_generations=4,
    )
    return CoordinatorSettings(**{**base, **overrides})


async def until(condition, timeout_s: float, what: str, poll_s: float = 0.02):
    """Poll ``condition()`` on the event loop until truthy (returned); fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        await asyncio.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


@pytest.fixture
async def start_stages():
    """``await start_stages([[settings, ...] per stage])`` -> (apps per stage, URLs per stage)."""
    servers: list[TestServer] = []

    async def start(groups: list[list[StageServerSettings]]):
        apps, urls = [], []
        for group in groups:
            apps.append([]), urls.append([])
            for settings in group:
                server = TestServer(create_app(settings), host="127.0.0.1")
                await server.start_server()
                servers.append(server)
                apps[-1].append(server.app)
                urls[-1].append(str(server.make_url("")).rstrip("/"))
        return apps, urls

    yield start
    for server in servers:
        await server.close()


@pytest.fixture
async def http_session():
    async with aiohttp.ClientSession() as session:
        yield session
