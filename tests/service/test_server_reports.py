"""What a stage server tells the coordinator for topology placement: its region and its
stage's work (parameters, samples per step, the measured wire size of the activation
crossing its boundary) in every registration and heartbeat; and what a server started
with ``--stage auto`` measures before it asks for a stage."""

from __future__ import annotations

import torch
from aiohttp.test_utils import TestServer

from services.coordinator.app import create_app as create_coordinator
from services.coordinator.routes import REGISTRY
from services.stage_server.app import create_app
from services.stage_server.latency import probe_swarm, spread_over_stages
from services.stage_server.metrics import STAGE_METRICS
from services.stage_server.routes import RUNTIME
from shared.codec import encode_tensor, pack_message
from tests.conftest import coordinator_settings, stage_settings, until

MSGPACK = {"Content-Type": "application/msgpack"}
B, T, D_MODEL = 4, 8, 128


async def start(app) -> tuple[TestServer, str]:
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server, str(server.make_url("")).rstrip("/")


async def test_heartbeats_carry_region_parameters_and_measured_activation_size(http_session):
    servers = []
    try:
        coordinator_server, coordinator = await start(
            create_coordinator(coordinator_settings(num_stages=3, heartbeat_s=0.05, lease_heartbeats=100))
        )
        servers.append(coordinator_server)
        registry = coordinator_server.app[REGISTRY]
        stage_app = create_app(
            stage_settings(1, num_stages=3, coordinator=coordinator, heartbeat_s=0.05, region="Tokyo", global_batch=24)
        )
        stage_server, url = await start(stage_app)
        servers.append(stage_server)
        parameters = sum(p.numel() for p in stage_app[RUNTIME].params)

        report = await until(lambda: next(iter(registry.reports.values()), None), 10, "the server's registration")
        assert (report.region, report.parameters, report.samples_per_step, report.activation_bytes_per_sample) == (
            "Tokyo",
            parameters,
            24,
            0.0,
        )

        # a training forward: fp32 activations of B x T x D_MODEL in and out
        msg = {
            "run_id": "test",
            "stage": 1,
            "microbatch_id": "mb-1",
            "seed": 1,
            "inputs": encode_tensor(torch.randn(B, T, D_MODEL), "fp32"),
        }
        async with http_session.post(url + "/forward", data=pack_message(msg), headers=MSGPACK) as resp:
            assert resp.status == 200
        per_sample = T * D_MODEL * 4
        assert stage_app[STAGE_METRICS].activation_bytes_per_sample == per_sample
        report = await until(
            lambda: next((r for r in registry.reports.values() if r.activation_bytes_per_sample), None),
            10,
            "a heartbeat with the activation size",
        )
        assert report.activation_bytes_per_sample == per_sample
        # an evaluation forward of another size is not training traffic: nothing changes
        msg.update(microbatch_id="mb-eval", eval=True, inputs=encode_tensor(torch.randn(B, 2 * T, D_MODEL), "fp32"))
        async with http_session.post(url + "/forward", data=pack_message(msg), headers=MSGPACK) as resp:
            assert resp.status == 200
        assert stage_app[STAGE_METRICS].activation_bytes_per_sample == per_sample
    finally:
        for s in reversed(servers):
            await s.close()


def test_a_joiner_times_replicas_of_every_stage_first():
    view = {
        "stages": [
            {"stage": s, "replicas": [{"url": f"http://s{s}r{r}"} for r in range(n)]}
            for s, n in enumerate([5, 1, 0, 2])
        ]
    }
    assert spread_over_stages(view, 5) == ["http://s0r0", "http://s1r0", "http://s3r0", "http://s0r1", "http://s3r1"]
    assert len(spread_over_stages(view, 100)) == 8


async def test_a_joiner_measures_rtts_to_the_swarm_before_asking_for_a_stage(http_session):
    servers = []
    try:
        coordinator_server, coordinator = await start(create_coordinator(coordinator_settings(num_stages=2)))
        servers.append(coordinator_server)
        urls = []
        for i, stage in enumerate([0, 1]):
            server, url = await start(create_app(stage_settings(stage, num_stages=2)))
            servers.append(server)
            urls.append(url)
            body = {
                "run_id": "test",
                "server_id": f"s{i}",
                "stage": stage,
                "url": url,
                "version": "t",
                "throughput": 1.0,
                "queue_length": 0,
            }
            async with http_session.post(coordinator + "/register", json=body) as resp:
                assert resp.status == 200
        # registered, but nobody listens: no time for them; with them every stage has two
        # servers, so the joiner's place is the planner's (shared.policy.resilience)
        for stage, port in ((0, 7), (1, 9)):
            dead = f"http://127.0.0.1:{port}"
            async with http_session.post(
                coordinator + "/register", json={**body, "stage": stage, "server_id": f"s-dead{stage}", "url": dead}
            ) as resp:
                assert resp.status == 200
        rtt = await probe_swarm(http_session, coordinator)
        assert set(rtt) == set(urls) and all(0 < ms < 2000 for ms in rtt.values())
        async with http_session.post(
            coordinator + "/assign", json={"run_id": "test", "rtt_ms": rtt, "region": "Ohio"}
        ) as resp:
            assert (await resp.json())["placement"] == "topology"
        assert await probe_swarm(http_session, "http://127.0.0.1:9") == {}  # no coordinator: nothing measured, no error
    finally:
        for s in reversed(servers):
            await s.close()
