"""Round-trip times: a stage server times its own stage's and its neighbours' replicas and
reports them in its heartbeat; the coordinator keeps them (validated) and shows them in
GET /swarm, for topology-aware placement."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestServer

from services.coordinator.app import create_app as create_coordinator
from services.coordinator.registry import Registry
from services.stage_server.app import create_app
from services.stage_server.latency import LatencyProbe, peers_to_probe
from shared.errors import BadPayload
from tests.conftest import coordinator_settings, stage_settings


def view(*stages):
    return {"stages": [{"stage": i, "replicas": [{"url": u} for u in urls]} for i, urls in enumerate(stages)]}


def test_peers_are_own_stage_then_neighbours_without_self_and_bounded():
    v = view(["http://a0"], ["http://b0", "http://b1"], ["http://c0"], ["http://d0"])
    assert peers_to_probe(v, 1, "http://b0") == ["http://b1", "http://a0", "http://c0"]
    assert peers_to_probe(v, 0, "http://a0/") == ["http://b0", "http://b1"]
    assert peers_to_probe(v, 3, "http://d0") == ["http://c0"]
    assert len(peers_to_probe(view([f"http://x{i}" for i in range(40)]), 0, "http://x0", limit=16)) == 16


def test_registry_keeps_valid_round_trip_times_and_refuses_bad_ones():
    registry = Registry(":memory:", num_stages=2, heartbeat_s=1.0, clock=lambda: 0.0)
    registry.register("s", 0, "http://127.0.0.1:1", "v", 1.0, 0)
    registry.heartbeat("s", 1.0, 0, rtt_ms={"http://127.0.0.1:2": 12.5})
    assert registry.view()["stages"][0]["replicas"][0]["rtt_ms"] == {"http://127.0.0.1:2": 12.5}
    for bad in [
        [1],
        {"http://127.0.0.1:2": float("nan")},
        {"http://127.0.0.1:2": -1},
        {"not a url": 1.0},
        {f"http://h{i}:1": 1.0 for i in range(65)},
    ]:
        with pytest.raises(BadPayload):
            registry.heartbeat("s", 1.0, 0, rtt_ms=bad)
    assert registry.view()["stages"][0]["replicas"][0]["rtt_ms"] == {
        "http://127.0.0.1:2": 12.5
    }  # unchanged by refusals
    registry.deregister("s")
    assert registry.view()["stages"][0]["replicas"] == [] and registry.rtt_ms == {}
    registry.close()


async def test_a_probe_times_registered_peers_over_http(http_session):
    servers = []
    try:
        coordinator_server = TestServer(
            create_coordinator(coordinator_settings(num_stages=2)),
            host="127.0.0.1",
        )
        await coordinator_server.start_server()
        servers.append(coordinator_server)
        coordinator = str(coordinator_server.make_url("")).rstrip("/")
        urls = []
        for i, stage in enumerate([0, 0, 1]):
            s = TestServer(create_app(stage_settings(stage, num_stages=2)), host="127.0.0.1")
            await s.start_server()
            servers.append(s)
            urls.append(str(s.make_url("")).rstrip("/"))
            body = {
                "run_id": "test",
                "server_id": f"s{i}",
                "stage": stage,
                "url": urls[-1],
                "version": "t",
                "throughput": 1.0,
                "queue_length": 0,
            }
            async with http_session.post(coordinator + "/register", json=body) as resp:
                assert resp.status == 200
        probe = LatencyProbe(http_session, coordinator, stage=0, own_url=urls[0], every=2)
        rtt = await probe.maybe_probe()
        assert set(rtt) == {urls[1], urls[2]} and all(0 < ms < 2000 for ms in rtt.values())
        assert await probe.maybe_probe() == rtt  # not a probing beat: the same values
        heartbeat = {"server_id": "s0", "throughput": 1.0, "queue_length": 0, "rtt_ms": rtt}
        async with http_session.post(coordinator + "/heartbeat", json=heartbeat) as resp:
            assert resp.status == 200
        async with http_session.get(coordinator + "/swarm") as resp:
            replica = next(r for r in (await resp.json())["stages"][0]["replicas"] if r["server_id"] == "s0")
        assert replica["rtt_ms"] == rtt
    finally:
        for s in servers:
            await s.close()
