"""A trainer keeps the admissions of its microbatches in flight alive (``POST /step/renew``), through the coordinator's
real app and the trainer's real :class:`AdmissionClient`; the admissions' lease runs on a
fake clock, so nothing waits for it.

Before renewals, an admission lived ``SWARM_STEP_TIMEOUT_S`` unless its microbatch was run
again: a microbatch slower than that (weak peers behind slow links: the arena's churn
scenario) lost its place, a replacement filled its step at every stage, and its own
gradient went a step late (accepted, within the staleness bound) or two (refused: 22% of
the microbatches re-run in that run)."""

from __future__ import annotations

import pytest
from aiohttp import web

from services.coordinator.app import create_app
from services.coordinator.registry import Registry
from services.coordinator.routes import ADMISSION
from services.trainer.admission import AdmissionClient
from tests.conftest import VirtualClock, coordinator_settings

RUN_ID = "renewals"
LEASE_S = 0.3  # SWARM_STEP_TIMEOUT_S: the lease, in the fake clock's seconds (and the hold of a full window's ask)


@pytest.fixture
async def coordinator(aiohttp_client):
    """A sync-schedule coordinator whose one registered server steps every 8 samples; its
    admissions on a fake clock."""
    settings = coordinator_settings(run_id=RUN_ID, num_stages=1, schedule="sync", step_timeout_s=LEASE_S)
    registry = Registry(":memory:", num_stages=1, heartbeat_s=settings.heartbeat_s)
    client = await aiohttp_client(create_app(settings, registry))
    server = {"server_id": "s0", "stage": 0, "url": "http://127.0.0.1:1", "version": "test", "throughput": 1.0}
    workload = {"parameters": 1000, "samples_per_step": 8, "activation_bytes_per_sample": 64}
    reply = await client.post("/register", json={**server, "queue_length": 0, "workload": workload, "run_id": RUN_ID})
    assert reply.status == 200, await reply.text()
    clock = VirtualClock()
    client.app[ADMISSION].clock = clock
    yield client, clock
    registry.close()


def trainer_client(client) -> AdmissionClient:
    return AdmissionClient(client.session, str(client.make_url("")), run_id=RUN_ID, until_step=100, wait_s=0.0)


async def ask(client, microbatch_id: str) -> tuple[int, dict]:
    reply = await client.post("/step/admit", json={"run_id": RUN_ID, "microbatch_id": microbatch_id, "samples": 4})
    return reply.status, await reply.json()


async def test_microbatches_in_flight_keep_their_places_past_the_lease_and_finished_ones_do_not(coordinator):
    client, clock = coordinator
    t0, t1 = trainer_client(client), trainer_client(client)
    a = await t0.admit(f"{RUN_ID}:t0:0", 4)
    b = await t0.admit(f"{RUN_ID}:t0:1", 4)
    assert (a.step, b.step) == (0, 0) and t0.lease_s == LEASE_S  # the lease came with the answer
    assert t0.in_flight == {f"{RUN_ID}:t0:0", f"{RUN_ID}:t0:1"}
    clock.now = 0.2
    assert await t0.renew() == 2 and t0.renewals == 1
    clock.now = 0.4  # past the lease from the admissions, within it from the renewal
    status, answer = await ask(client, f"{RUN_ID}:t1:0")
    assert status == 503 and answer["error"]["code"] == "overloaded"  # step 0 is full; sync: step 1 waits for it
    assert client.app[ADMISSION].expired == 0
    t0.finished(f"{RUN_ID}:t0:0")  # completed: if a stage lost its samples, another must be able to take its place
    assert await t0.renew() == 1
    clock.now = 0.6  # the finished one was last renewed at 0.2: its lease ran out; the other's at 0.4, renewed again
    assert await t0.renew() == 1
    second = await t1.admit(f"{RUN_ID}:t1:0", 4)
    assert second.step == 0 and client.app[ADMISSION].expired == 1  # the finished one's place
    assert client.app[ADMISSION].batch(0) == [f"{RUN_ID}:t0:1", f"{RUN_ID}:t1:0"]
    assert await t1.renew() == 1 and t1.in_flight == {f"{RUN_ID}:t1:0"}
    await t1.release(f"{RUN_ID}:t1:0")
    assert not t1.in_flight and await t1.renew() is None  # nothing in flight: nothing sent


async def test_a_renewal_names_its_microbatches_or_is_refused(coordinator):
    client, _ = coordinator
    for body in (
        {"run_id": RUN_ID},
        {"run_id": RUN_ID, "microbatch_ids": "a"},
        {"run_id": RUN_ID, "microbatch_ids": [""]},
        {"run_id": RUN_ID, "microbatch_ids": [7]},
        {"run_id": RUN_ID, "microbatch_ids": ["x"] * 4097},
    ):
        reply = await client.post("/step/renew", json=body)
        assert reply.status == 400 and (await reply.json())["error"]["code"] == "bad_payload", body
    reply = await client.post("/step/renew", json={"run_id": "another run", "microbatch_ids": []})
    assert reply.status == 409
    reply = await client.post("/step/renew", json={"run_id": RUN_ID, "microbatch_ids": [f"{RUN_ID}:nobody:0"]})
    assert reply.status == 200 and await reply.json() == {"renewed": 0, "lease_s": LEASE_S}


async def test_an_older_coordinator_without_renewals_keeps_admission_on(aiohttp_client):
    """404 on /step/renew: the trainer stops renewing, and goes on asking for admissions."""

    async def not_found(request):
        raise web.HTTPNotFound()

    app = web.Application()
    app.router.add_post("/step/renew", not_found)
    client = await aiohttp_client(app)
    t0 = trainer_client(client)
    t0.in_flight.add(f"{RUN_ID}:t0:0")
    assert await t0.renew() is None
    assert not t0.renewing and t0.supported
    await t0.keep_alive()  # returns at once: nothing to renew with
