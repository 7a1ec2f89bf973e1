"""A stage server's move to another stage (``POST /move``, ``services/stage_server/move.py``).

The order is checked and recorded by the handler (bad orders refused with 400/409, a
repeated one answered with the first's stage); the server's main loop (``__main__.serve``)
then drains, deregisters and serves the new stage at the same address, in this process,
with the state it downloaded from a live replica of that stage, registered again.

In-process coordinator and stage servers of the ``tiny`` model cut into 3 stages, on
loopback; the mover runs the real ``serve`` loop on its own port.
"""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestServer

from services.coordinator.app import create_app as create_coordinator
from services.stage_server.__main__ import serve
from services.stage_server.app import create_app
from services.stage_server.routes import MOVE
from services.stage_server.runtime import StageRuntime
from shared.codec import decode_tensor, encode_tensor, pack_message, unpack_message
from shared.model import PRESETS
from shared.processes import free_port
from tests.conftest import coordinator_settings, stage_settings

MSGPACK = {"Content-Type": "application/msgpack"}
NUM_STAGES, D_MODEL = 3, PRESETS["tiny"].d_model
TIMEOUT_S = 30


async def post(session, url: str, msg: dict) -> tuple[int, dict]:
    async with session.post(url, data=pack_message(msg), headers=MSGPACK) as resp:
        body = await resp.read()
        return resp.status, unpack_message(body) if resp.content_type == MSGPACK["Content-Type"] else await resp.json()


async def get_json(session, url: str) -> dict:
    async with session.get(url) as resp:
        return await resp.json()


async def probe(session, url: str, stage: int) -> tuple[int, torch.Tensor | None]:
    """An evaluation forward of a fixed hidden state at ``stage``: (status, outputs)."""
    x = torch.randn(2, 8, D_MODEL, generator=torch.Generator().manual_seed(7))
    msg = {"run_id": "test", "stage": stage, "microbatch_id": "probe", "seed": 0, "eval": True}
    status, reply = await post(session, url + "/forward", {**msg, "inputs": encode_tensor(x, "fp32")})
    return status, decode_tensor(reply["outputs"]) if status == 200 else None


def runtimes_of(stage: int) -> list[StageRuntime]:
    return [o for o in gc.get_objects() if type(o) is StageRuntime and o.spec.index == stage]


@pytest.mark.parametrize(
    ("order", "status", "code"),
    [
        ({"run_id": "test", "stage": 2, "to_stage": 0}, 409, "wrong_stage"),  # not this server's stage
        ({"run_id": "other", "stage": 1, "to_stage": 0}, 409, "wrong_stage"),  # not this server's run
        ({"run_id": "test", "stage": 1, "to_stage": 1}, 400, "bad_payload"),  # the stage it holds
        ({"run_id": "test", "stage": 1, "to_stage": NUM_STAGES}, 400, "bad_payload"),  # no such stage
        ({"run_id": "test", "stage": 1, "to_stage": "0"}, 400, "bad_payload"),
        ({"run_id": "test", "stage": 1}, 400, "bad_payload"),
    ],
)
async def test_a_bad_move_order_is_refused_and_changes_nothing(aiohttp_client, order, status, code):
    client = await aiohttp_client(create_app(stage_settings(1, num_stages=NUM_STAGES)))
    resp = await client.post("/move", data=pack_message(order), headers=MSGPACK)
    assert resp.status == status
    assert (await resp.json())["error"]["code"] == code
    assert client.app[MOVE].to_stage is None
    assert (await client.get("/health")).status == 200


async def test_a_move_order_is_recorded_once_and_answered_at_once(aiohttp_client):
    client = await aiohttp_client(create_app(stage_settings(1, num_stages=NUM_STAGES)))
    for to_stage in (2, 0):  # the second order (a retry, or a conflicting one) changes nothing
        resp = await client.post(
            "/move", data=pack_message({"run_id": "test", "stage": 1, "to_stage": to_stage}), headers=MSGPACK
        )
        assert resp.status == 200
        assert unpack_message(await resp.read())["to_stage"] == 2
    assert client.app[MOVE].to_stage == 2


async def test_a_moved_server_serves_the_new_stage_with_a_replicas_state_and_registers_again(http_session):
    servers: list[TestServer] = []
    stop, mover = asyncio.Event(), None
    try:
        coordinator_server = TestServer(
            create_coordinator(coordinator_settings(num_stages=NUM_STAGES, heartbeat_s=0.05, lease_heartbeats=100)),
            host="127.0.0.1",
        )
        await coordinator_server.start_server()
        servers.append(coordinator_server)
        coordinator = str(coordinator_server.make_url("")).rstrip("/")
        joined = dict(num_stages=NUM_STAGES, coordinator=coordinator, heartbeat_s=0.05)
        replica_port = free_port()  # stage 1's replica, registered at the address it listens on
        replica = TestServer(
            create_app(stage_settings(1, seed=1, host="127.0.0.1", port=replica_port, **joined)),
            host="127.0.0.1",
            port=replica_port,
        )
        await replica.start_server()
        servers.append(replica)
        replica_url = f"http://127.0.0.1:{replica_port}"

        port = free_port()
        url = f"http://127.0.0.1:{port}"
        settings = stage_settings(2, seed=2, host="127.0.0.1", port=port, drain_timeout_s=5.0, **joined)
        stage_2_runtimes = set(map(id, runtimes_of(2)))  # other tests' apps may linger
        mover = asyncio.create_task(serve(settings, stop))

        def replicas(view: dict, stage: int) -> list[dict]:
            return view["stages"][stage]["replicas"]

        async def registered_on(stage: int) -> dict | None:
            view = await get_json(http_session, coordinator + "/swarm")
            return next((r for r in replicas(view, stage) if r["url"] == url), None)

        before = await until_async(lambda: registered_on(2), "the mover's registration on stage 2")
        (old_runtime,) = [weakref.ref(r) for r in runtimes_of(2) if id(r) not in stage_2_runtimes]
        status, reply = await post(http_session, url + "/move", {"run_id": "test", "stage": 2, "to_stage": 1})
        assert (status, reply["stage"], reply["to_stage"]) == (200, 2, 1)

        after = await until_async(lambda: registered_on(1), "the mover's registration on stage 1")
        view = await get_json(http_session, coordinator + "/swarm")
        assert replicas(view, 2) == [], "the mover left stage 2's registry"
        assert after["server_id"] != before["server_id"]
        health = await get_json(http_session, url + "/health")
        assert (health["status"], health["stage"]) == ("ok", 1)
        # It serves stage 1 with the replica's weights (its own seed would give other ones), not stage 2.
        assert (await probe(http_session, url, 2))[0] == 409
        (status, moved), (_, original) = await probe(http_session, url, 1), await probe(http_session, replica_url, 1)
        assert status == 200 and torch.equal(moved, original)
        fresh = TestServer(create_app(stage_settings(1, seed=2, num_stages=NUM_STAGES)), host="127.0.0.1")
        await fresh.start_server()
        servers.append(fresh)
        assert not torch.equal(moved, (await probe(http_session, str(fresh.make_url("")).rstrip("/"), 1))[1])
        assert not mover.done()
        gc.collect()
        assert old_runtime() is None, "the old stage's runtime (its weights) outlived the move"
    finally:
        stop.set()
        if mover is not None:
            await asyncio.wait_for(mover, TIMEOUT_S)
        for server in reversed(servers):
            await server.close()


async def test_a_stop_while_joining_a_stage_ends_the_server_at_once():
    """A server waiting for its stage's state (here: for a coordinator that never answers)
    stops at SIGTERM or Ctrl-C without waiting out ``join_timeout_s``."""
    asked, never = asyncio.Event(), asyncio.Event()

    async def swarm_view(request: web.Request) -> web.Response:
        asked.set()
        await never.wait()  # cancelled when the server closes
        return web.json_response({})

    silent = web.Application()
    silent.router.add_get("/swarm", swarm_view)
    coordinator = TestServer(silent, host="127.0.0.1")
    await coordinator.start_server()
    stop = asyncio.Event()
    settings = stage_settings(
        1,
        num_stages=NUM_STAGES,
        coordinator=str(coordinator.make_url("")).rstrip("/"),
        host="127.0.0.1",
        port=free_port(),
        join_timeout_s=600.0,
    )
    mover = asyncio.create_task(serve(settings, stop))
    try:
        await asyncio.wait_for(asked.wait(), TIMEOUT_S)
        stop.set()
        await asyncio.wait_for(mover, 10)
    finally:
        mover.cancel()
        await asyncio.gather(mover, return_exceptions=True)
        await coordinator.close()


async def until_async(condition, what: str, timeout_s: float = TIMEOUT_S):
    """Await ``condition()`` until it returns something truthy (returned); fail after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        if value := await condition():
            return value
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
