"""The global steps' protocol through the coordinator's real app (``aiohttp_client``): one
microbatch reserved at a stage by two replicas is refused the second time (``verdict:
duplicate``, counted in ``GET /swarm``), also by a restarted coordinator on the same state
file, which also goes on counting the open steps where its predecessor stopped; malformed
reservations are refused with 400."""

from __future__ import annotations

from services.coordinator.app import create_app
from shared.config import CoordinatorSettings
from tests.conftest import coordinator_settings

RUN_ID = "test-run"
A, B = "http://a:1", "http://b:1"


def settings(state_db: str) -> CoordinatorSettings:
    return coordinator_settings(run_id=RUN_ID, num_stages=2, heartbeat_s=2.0, max_servers=64, state_db=state_db)


def reservation(url: str, microbatch_id: str, **overrides) -> dict:
    body = {"run_id": RUN_ID, "stage": 1, "url": url, "step": 0, "samples": 4, "global_batch": 8}
    return {**body, "microbatch_id": microbatch_id, **overrides}


async def test_a_microbatch_counts_once_per_stage_across_replicas_and_restarts(aiohttp_client, tmp_path):
    state_db = str(tmp_path / "coordinator.sqlite")
    client = await aiohttp_client(create_app(settings(state_db)))
    first = await client.post("/step/reserve", json=reservation(A, "run:c:1"))
    assert first.status == 200
    assert await first.json() == {"verdict": "reserved", "bucket": 0, "step": 0, "replicas": 0}
    again = await (await client.post("/step/reserve", json=reservation(B, "run:c:1"))).json()
    assert again["verdict"] == "duplicate" and again["bucket"] is None
    other_stage = await (await client.post("/step/reserve", json=reservation(B, "run:c:1", stage=0))).json()
    assert other_stage["verdict"] == "reserved"  # a stage counts its own microbatches
    done = {**reservation(A, "run:c:1"), "bucket": 0, "reserved": 4, "samples": 4}
    assert (await client.post("/step/done", json=done)).status == 200
    swarm = await (await client.get("/swarm")).json()
    assert [s["step"]["duplicates_refused"] for s in swarm["stages"]] == [0, 1]
    assert swarm["stages"][1]["step"]["accumulated"] == 4
    await client.close()

    restarted = await aiohttp_client(create_app(settings(state_db)))
    swarm = await (await restarted.get("/swarm")).json()
    # the open steps' counts come back with the window: stage 1 holds 4 of its 8 samples,
    # stage 0 a reservation of 4 that its replica has not reported yet
    assert [(s["step"]["reserved"], s["step"]["accumulated"]) for s in swarm["stages"]] == [(4, 0), (4, 4)]
    again = await (await restarted.post("/step/reserve", json=reservation(B, "run:c:1"))).json()
    assert again["verdict"] == "duplicate"
    fresh = await (await restarted.post("/step/reserve", json=reservation(B, "run:c:2"))).json()
    assert fresh == {"verdict": "closes", "bucket": 0, "step": 0, "replicas": 0}  # 4 + 4: step 0 is full
    beyond = await (await restarted.post("/step/reserve", json=reservation(B, "run:c:3"))).json()
    assert beyond["verdict"] == "reserved" and beyond["bucket"] == 1
    late = {**reservation(B, "run:c:1", stage=0), "bucket": 0, "reserved": 4, "samples": 4}
    assert (await restarted.post("/step/done", json=late)).status == 200  # the predecessor's reservation
    swarm = await (await restarted.get("/swarm")).json()
    assert (swarm["stages"][0]["step"]["reserved"], swarm["stages"][0]["step"]["accumulated"]) == (4, 4)
    metrics = await (await restarted.get("/metrics")).text()
    for line in (
        'swarm_coordinator_global_step{stage="1"} 0.0',
        'swarm_coordinator_duplicates_refused_total{stage="1"} 1.0',  # this coordinator's own count
        'swarm_coordinator_steps_lost_total{stage="0"} 0.0',
        'swarm_coordinator_samples_dropped_total{stage="0"} 0.0',
    ):
        assert line in metrics, line


async def test_malformed_step_messages_are_refused(aiohttp_client):
    client = await aiohttp_client(create_app(settings(":memory:")))
    no_id = reservation(A, "x")
    del no_id["microbatch_id"]
    for body in (no_id, reservation(A, ""), reservation(A, "x", samples=-1)):
        response = await client.post("/step/reserve", json=body)
        assert response.status == 400 and (await response.json())["error"]["code"] == "bad_payload"
    too_many = {**reservation(A, "x"), "bucket": 0, "reserved": 4, "samples": 5}
    response = await client.post("/step/done", json=too_many)
    assert response.status == 400
