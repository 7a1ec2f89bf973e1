"""The trainer's view of the registry: refreshed from the coordinator, kept when it is away."""

from __future__ import annotations

import random

from aiohttp.test_utils import TestServer

from services.coordinator.app import create_app
from services.trainer.registry_mirror import RegistryMirror
from shared.wiring import ReplicaBalancer
from tests.conftest import coordinator_settings


def settings():
    """Averaging and rebalancing checks at their defaults (every 30 s), as this test always had them."""
    return coordinator_settings(num_stages=2, average_every_s=30.0, rebalance_every_s=30.0)


async def register(session, url: str, server_id: str, stage: int, server_url: str) -> None:
    body = {
        "run_id": "test",
        "server_id": server_id,
        "stage": stage,
        "url": server_url,
        "version": "t",
        "throughput": 1.0,
        "queue_length": 0,
    }
    async with session.post(url + "/register", json=body) as resp:
        assert resp.status == 200, await resp.text()


async def test_view_follows_the_registry_and_survives_its_absence(http_session):
    server = TestServer(create_app(settings()), host="127.0.0.1")
    await server.start_server()
    coordinator = str(server.make_url("")).rstrip("/")
    balancer = ReplicaBalancer(2, rng=random.Random(0))
    view = RegistryMirror(http_session, coordinator, balancer, refresh_s=60.0)
    try:
        assert await view.refresh() and view.replicas() == [[], []]
        await register(http_session, coordinator, "a", 0, "http://127.0.0.1:1001")
        await register(http_session, coordinator, "b", 1, "http://127.0.0.1:1002")
        assert await view.wait_complete(timeout_s=5.0)
        assert view.replicas() == [["http://127.0.0.1:1001"], ["http://127.0.0.1:1002"]]

        # a stage whose only replica is banned: the pipeline asks for a refresh at once
        balancer.report_failure(0, "http://127.0.0.1:1001")
        assert not balancer.has_usable(0)
        await register(http_session, coordinator, "c", 0, "http://127.0.0.1:1003")
        refreshes = view.refreshes
        await view.stage_empty(0)
        assert view.refreshes == refreshes + 1
        assert balancer.usable(0) == ["http://127.0.0.1:1003"]
    finally:
        await server.close()

    # the coordinator is gone: the last view stays in use
    assert not await view.refresh()
    assert view.failures == 1
    assert view.replicas() == [["http://127.0.0.1:1001", "http://127.0.0.1:1003"], ["http://127.0.0.1:1002"]]
    assert balancer.choose(1, batch_size=1) == "http://127.0.0.1:1002"


async def test_a_stage_listed_empty_keeps_its_last_known_replicas(http_session):
    """A coordinator restarted after more than a lease lists no servers until they heartbeat
    again: the trainer keeps the replicas it knew rather than failing microbatches."""
    server = TestServer(create_app(settings()), host="127.0.0.1")
    await server.start_server()
    coordinator = str(server.make_url("")).rstrip("/")
    balancer = ReplicaBalancer(2, rng=random.Random(0))
    view = RegistryMirror(http_session, coordinator, balancer, refresh_s=60.0)
    try:
        await register(http_session, coordinator, "a", 0, "http://127.0.0.1:1001")
        assert await view.refresh() and view.replicas() == [["http://127.0.0.1:1001"], []]
        async with http_session.post(coordinator + "/deregister", json={"server_id": "a"}) as resp:
            assert resp.status == 200
        await register(http_session, coordinator, "b", 1, "http://127.0.0.1:1002")
        assert await view.refresh()
        assert view.replicas() == [["http://127.0.0.1:1001"], ["http://127.0.0.1:1002"]]
    finally:
        await server.close()
