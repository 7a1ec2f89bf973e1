"""Topology placement through the coordinator's real app: servers report regions, model
size and measured RTTs in their heartbeats; ``/assign`` places a joiner by the network;
the rebalancing loop replans and orders ``POST /move`` to the servers that should move
(fake stage servers here, which record the orders).

Two clusters of servers, {a, b} and {c, d}, 1 ms apart inside and 150 ms between; each
stage's averaging rounds move a 0.19 GB stage: a stage inside one cluster averages fast.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from structlog.testing import capture_logs

from services.coordinator import routes
from services.coordinator.app import create_app
from shared.config import CoordinatorSettings, PlacementSettings
from shared.http import msgpack_response, read_message
from tests.conftest import coordinator_settings

RUN_ID = "placement-run"
CLUSTER = {"a": 0, "b": 0, "c": 1, "d": 1}
WORKLOAD = {"parameters": 50_000_000, "samples_per_step": 32, "activation_bytes_per_sample": 0.0}


def settings(**overrides) -> CoordinatorSettings:
    """Averaging every 0.5 s (it weighs in the cost; the fake servers refuse the rounds at once, harmlessly)."""
    placement = PlacementSettings(mode="auto", min_gain=0.1, max_moves=0.5, budget_s=2.0, bandwidth_gbps=10.0)
    fields = dict(run_id=RUN_ID, num_stages=2, heartbeat_s=30.0, average_every_s=0.5, placement=placement)
    return coordinator_settings(**{**fields, **overrides})


def rtts(me: str, urls: dict[str, str]) -> dict[str, float]:
    return {url: 1.0 if CLUSTER[me] == CLUSTER[other] else 150.0 for other, url in urls.items() if other != me}


class FakeServer:
    """Answers ``POST /move`` like a stage server and records the order."""

    def __init__(self, name: str, stage: int):
        self.name, self.stage, self.moved_to = name, stage, asyncio.get_running_loop().create_future()
        self.app = web.Application()
        self.app.router.add_post("/move", self.move)

    async def move(self, request: web.Request) -> web.Response:
        msg = await read_message(request, 64 * 1024)
        assert msg["run_id"] == RUN_ID and msg["stage"] == self.stage, msg
        if not self.moved_to.done():
            self.moved_to.set_result(msg["to_stage"])
        return msgpack_response({"moving_to": msg["to_stage"]})


async def register_all(client, stages: dict[str, int], urls: dict[str, str], throughput: float = 50.0) -> None:
    for name, stage in stages.items():
        body = {
            "run_id": RUN_ID,
            "server_id": name,
            "stage": stage,
            "url": urls[name],
            "version": "t",
            "throughput": throughput,
            "queue_length": 0,
            "workload": WORKLOAD,
        }
        assert (await client.post("/register", json=body)).status == 200
    for name in stages:  # heartbeats carry what each measured to the others
        beat = {
            "server_id": name,
            "throughput": throughput,
            "queue_length": 0,
            "workload": WORKLOAD,
            "rtt_ms": rtts(name, urls),
        }
        assert (await client.post("/heartbeat", json=beat)).status == 200


async def test_assign_places_a_joiner_by_its_measured_rtts(aiohttp_client):
    client = await aiohttp_client(create_app(settings()))
    urls = {name: f"http://127.0.0.{i + 10}:8100" for i, name in enumerate(CLUSTER)}
    await register_all(client, CLUSTER, urls)
    for near, expected in (("a", 0), ("c", 1)):
        joiner = {url: 1.0 if CLUSTER[name] == CLUSTER[near] else 150.0 for name, url in urls.items()}
        resp = await client.post("/assign", json={"run_id": RUN_ID, "rtt_ms": joiner})
        assert resp.status == 200
        assert await resp.json() == {"stage": expected, "placement": "topology"}
    # throughput placement when asked for, whatever is reported
    client2 = await aiohttp_client(create_app(settings(placement=PlacementSettings(mode="throughput"))))
    await register_all(client2, {"a": 0, "b": 0, "c": 0, "d": 1}, urls)
    resp = await client2.post("/assign", json={"run_id": RUN_ID, "rtt_ms": {urls["a"]: 1.0}})
    assert await resp.json() == {"stage": 1, "placement": "throughput"}


async def test_rebalancing_moves_servers_into_their_clusters(aiohttp_server, aiohttp_client):
    crossed = {"a": 0, "c": 0, "b": 1, "d": 1}  # every stage spans both clusters
    fakes = {name: FakeServer(name, stage) for name, stage in crossed.items()}
    urls = {name: str((await aiohttp_server(fake.app)).make_url("")).rstrip("/") for name, fake in fakes.items()}
    client = await aiohttp_client(create_app(settings(rebalance_every_s=0.05)))
    await register_all(client, crossed, urls)
    # two consecutive checks confirm the replan, then two servers are told to move (a swap)
    done, pending = await asyncio.wait(
        [f.moved_to for f in fakes.values()], timeout=20, return_when=asyncio.FIRST_COMPLETED
    )
    assert done, "no server was told to move within 60 s"
    if len(done) < 2:  # the other half of the swap is ordered with it
        await asyncio.wait(pending, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    moved = {name: f.moved_to.result() for name, f in fakes.items() if f.moved_to.done()}
    assert len(moved) == 2, moved
    after = {**crossed, **moved}
    assert after["a"] == after["b"] != after["c"] == after["d"], after


async def join(client, name: str, urls: dict[str, str], rtt_ms: dict[str, float]) -> int:
    """A server started with ``--stage auto``: it times the registered servers, asks ``/assign``
    and registers at the stage it got; returns that stage."""
    resp = await client.post("/assign", json={"run_id": RUN_ID, **({"rtt_ms": rtt_ms} if rtt_ms else {})})
    assert resp.status == 200, await resp.text()
    stage = (await resp.json())["stage"]
    body = {
        "run_id": RUN_ID,
        "server_id": name,
        "stage": stage,
        "url": urls[name],
        "version": "t",
        "throughput": 0.0,
        "queue_length": 0,
        "workload": WORKLOAD,
    }
    assert (await client.post("/register", json=body)).status == 200
    return stage


async def test_stage_auto_servers_form_a_swarm_one_by_one_and_all_at_once(aiohttp_client):
    """Issue 28: with 4 stages, the joiners after the first measured their RTTs to the servers
    before them, which made ``/assign`` ask the network planner, and it cannot place 3 peers on 4
    stages: ``500 ValueError('3 peers cannot fill 4 stages')``. Every joiner gets a stage; the
    first four fill the four stages and the next four give each stage a second replica, whether
    each registers before the next asks (one by one) or all ask before any registers."""
    urls = {f"s{i}": f"http://127.0.0.{i + 10}:8100" for i in range(8)}
    for together in (False, True):
        client = await aiohttp_client(create_app(settings(num_stages=4)))
        stages: list[int] = []
        if together:  # all ask first (none measured anyone), then all register
            for _ in urls:
                resp = await client.post("/assign", json={"run_id": RUN_ID})
                assert resp.status == 200, await resp.text()
                stages.append((await resp.json())["stage"])
        else:
            for name in urls:
                timed = {urls[other]: 1.0 for other in list(urls)[: len(stages)]}
                stages.append(await join(client, name, urls, timed))
        assert sorted(stages[:4]) == [0, 1, 2, 3] and sorted(stages[4:]) == [0, 1, 2, 3], (together, stages)


async def test_a_plan_the_network_planner_cannot_make_falls_back_to_the_policys_stage(aiohttp_client, monkeypatch):
    """Every stage has two replicas, so the planner is asked; when it fails, the joiner gets
    the policy's stage and the coordinator says why (never a 500)."""
    client = await aiohttp_client(create_app(settings()))
    urls = {name: f"http://127.0.0.{i + 10}:8100" for i, name in enumerate(CLUSTER)}
    await register_all(client, CLUSTER, urls)

    def planner_fails(*args, **kwargs):
        raise ValueError("the planner cannot place this")

    monkeypatch.setattr(routes, "stage_for_joiner", planner_fails)
    with capture_logs() as logs:
        resp = await client.post("/assign", json={"run_id": RUN_ID, "rtt_ms": rtts("a", urls)})
    assert resp.status == 200 and await resp.json() == {"stage": 0, "placement": "throughput"}
    (fallback,) = [e for e in logs if e["event"] == "placement.joiner.fallback"]
    assert "cannot place this" in fallback["error"]
    (placed,) = [e for e in logs if e["event"] == "placement.joiner"]
    assert placed["stage"] == 0 and "after losing its strongest replica" in placed["reason"]


async def test_rebalancing_gives_a_lone_replica_a_partner_once_and_says_why(aiohttp_server, aiohttp_client):
    """Four servers on two stages, three on stage 0: stage 1's only replica is fast, so no
    throughput move would help it, but losing it would stop the swarm. The coordinator moves
    one replica of stage 0 there, logs why, and counts the moving server as stage 1's until
    it registers there (no second move meanwhile)."""
    placed = {"a": 0, "b": 0, "c": 0, "d": 1}
    fakes = {name: FakeServer(name, stage) for name, stage in placed.items()}
    urls = {name: str((await aiohttp_server(fake.app)).make_url("")).rstrip("/") for name, fake in fakes.items()}
    app = create_app(settings(rebalance_every_s=0.05, placement=PlacementSettings(mode="throughput")))
    with capture_logs() as logs:
        client = await aiohttp_client(app)
        await register_all(client, {"a": 0, "b": 0, "c": 0}, urls, throughput=50.0)
        await register_all(client, {"d": 1}, urls, throughput=500.0)
        done, _ = await asyncio.wait(
            [f.moved_to for f in fakes.values()], timeout=20, return_when=asyncio.FIRST_COMPLETED
        )
        assert done, "no server was told to move within 20 s"
        await asyncio.sleep(0.5)  # ten more checks
    moved = {name: f.moved_to.result() for name, f in fakes.items() if f.moved_to.done()}
    assert moved == {"a": 1}, moved
    (move,) = [e for e in logs if e["event"] == "rebalance.move"]
    assert move["reason"] == "stage 1 has one replica: losing it would stop the swarm, while stage 0 has 3 replicas"
    assert move["placement"] == "throughput"
    board = await (await client.get("/dashboard.json")).json()  # the dashboard shows the reasons
    (shown,) = [e for e in board["events"] if e["event"] == "rebalance.move"]
    assert shown["reason"] == move["reason"] and shown["to_stage"] == 1


async def placement_settled(client, servers: int) -> int:
    """Until ``GET /health`` says a rebalancing check saw ``servers`` and nothing to do (the
    caller bounds it); polls every 50 ms, the checks' period here."""
    while (settled := (await (await client.get("/health")).json())["placement_settled"]) < servers:
        await asyncio.sleep(0.05)
    return settled


# The heterogeneous arena formed with its 10 Mbit/s 2-unit peer first of its kind (it filled the
# empty stage 3): name -> (stage, declared GFLOP/s, declared link Mbit/s)
SLOW_FIRST = {
    "s5": (0, 41.2, 20.0),
    "s1": (0, 10.1, 20.0),
    "s6": (1, 40.8, 50.0),
    "s0": (1, 10.3, 100.0),
    "s7": (2, 40.7, 100.0),
    "s4": (2, 19.6, 100.0),
    "s2": (3, 18.8, 10.0),
    "s3": (3, 19.3, 50.0),
}


async def test_a_slow_link_leaves_the_weakest_stage_once_its_fast_partner_serves_there(aiohttp_server, aiohttp_client):
    """The coordinator exchanges the weakest stage's 10 Mbit/s replica with a 2-unit one on
    100 Mbit/s beside a 4-unit peer, in turn: the fast one moves first, the slow one is told
    to move only once the fast one serves at its new stage (the weakest stage never runs a
    replica short), and both moves are logged with the reason."""
    events: list[str] = []

    class Recording(FakeServer):
        async def move(self, request: web.Request) -> web.Response:
            events.append(f"{self.name} ordered")
            return await super().move(request)

    fakes = {name: Recording(name, stage) for name, (stage, _, _) in SLOW_FIRST.items()}
    urls = {name: str((await aiohttp_server(fake.app)).make_url("")).rstrip("/") for name, fake in fakes.items()}
    app = create_app(settings(num_stages=4, rebalance_every_s=0.05, placement=PlacementSettings(mode="throughput")))

    def registration(server_id: str, name: str, stage: int) -> dict:
        _, gflops, link = SLOW_FIRST[name]
        return {
            "run_id": RUN_ID,
            "server_id": server_id,
            "stage": stage,
            "url": urls[name],
            "version": "t",
            "throughput": 0.0,
            "queue_length": 0,
            "speed_flops": gflops * 1e9,
            "link_mbit": link,
        }

    with capture_logs() as logs:
        client = await aiohttp_client(app)
        for name, (stage, _, _) in SLOW_FIRST.items():
            assert (await client.post("/register", json=registration(name, name, stage))).status == 200
        assert await asyncio.wait_for(fakes["s4"].moved_to, timeout=20) == 3
        # s4 leaves stage 2 and registers at stage 3 under a new id, at the same address
        assert (await client.post("/deregister", json={"server_id": "s4"})).status == 200
        events.append("s4 serves at stage 3")
        assert (await client.post("/register", json=registration("s4-moved", "s4", 3))).status == 200
        assert await asyncio.wait_for(fakes["s2"].moved_to, timeout=20) == 2
        assert (await (await client.get("/health")).json())["placement_settled"] == 0  # s2's move is under way
        assert (await client.post("/deregister", json={"server_id": "s2"})).status == 200
        assert (await client.post("/register", json=registration("s2-moved", "s2", 2))).status == 200
        settled = await asyncio.wait_for(placement_settled(client, 8), timeout=20)  # a check after it: nothing to do
    assert settled == 8
    assert events == ["s4 ordered", "s4 serves at stage 3", "s2 ordered"], events
    assert not any(f.moved_to.done() for name, f in fakes.items() if name not in ("s2", "s4"))
    moves = [e for e in logs if e["event"] == "rebalance.move"]
    assert [(m["server_id"], m["to_stage"]) for m in moves] == [("s4", 3), ("s2", 2)], moves
    assert "takes the slow link out of the weakest stage" in moves[0]["reason"] == moves[1]["reason"]
