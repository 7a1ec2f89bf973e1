"""Shared fixtures: stage servers started in this process on loopback ports."""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from services.stage_server.app import create_app
from shared.config import StageServerSettings
from shared.wiring import ReplicaBalancer


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
