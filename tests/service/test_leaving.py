"""A stage server stopped (SIGTERM, Ctrl-C, a move) while it is in a step round leaves while it
still listens: it answers 503 to new work, lets the round end with its peers, then stops
listening. Before, it stopped listening first: its peers could no longer fetch its
reduction, every member waited for the round's deadline (a swarm stopped at once took 8 s
to exit) and the peers stepped on a backup's reduction, or not at all.

The stopped member runs the server's real main loop (``__main__.serve``); its peer is an app
on a test server; no coordinator (the round is started by hand, as the coordinator does)."""

from __future__ import annotations

import asyncio

import aiohttp
import torch
from aiohttp.test_utils import TestServer

from services.stage_server.__main__ import serve
from services.stage_server.app import create_app
from services.stage_server.routes import RUNTIME
from services.stage_server.runtime import Accumulated
from shared.codec import pack_message, unpack_message
from shared.processes import free_port
from tests.conftest import stage_settings

STAGE, NUM_STAGES = 1, 2
ROUND_TIMEOUT_S = 60.0  # the deadline the old shutdown waited out; nothing here comes near it
TIMEOUT_S = 30.0
MSGPACK = {"Content-Type": "application/msgpack"}


async def start_round(session, url: str, members: list[str], index: int) -> dict:
    msg = {
        "round_id": "step-0",
        "stage": STAGE,
        "members": members,
        "index": index,
        "codec": "fp32",
        "timeout_s": ROUND_TIMEOUT_S,
        "kind": "step",
        "step": 0,
    }
    async with session.post(url + "/average/start", data=pack_message(msg), headers=MSGPACK) as resp:
        assert resp.status == 200, await resp.text()
        return unpack_message(await resp.read())


async def until(condition, what: str) -> None:
    """Poll ``await condition()`` (bounded in time) until it is true."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + TIMEOUT_S
    while not await condition():
        assert loop.time() < deadline, f"{what} not within {TIMEOUT_S} s"
        await asyncio.sleep(0.02)


async def test_a_server_stopped_in_a_step_round_ends_it_with_its_peer_before_it_stops_listening():
    port = free_port()
    leaver_url = f"http://127.0.0.1:{port}"
    settings = stage_settings(STAGE, num_stages=NUM_STAGES, seed=1, host="127.0.0.1", port=port, drain_timeout_s=5.0)
    peer_app = create_app(stage_settings(STAGE, num_stages=NUM_STAGES, seed=1))
    runtime = peer_app[RUNTIME]
    gradient = torch.randn(sum(p.numel() for p in runtime.params), generator=torch.Generator().manual_seed(3))
    runtime.give_back(Accumulated(gradient, 8, frozenset({"mb-0"})), 0)  # the peer served 8 samples of step 0
    peer = TestServer(peer_app, host="127.0.0.1")
    await peer.start_server()
    peer_url = str(peer.make_url("")).rstrip("/")
    members = [leaver_url, peer_url]
    stop = asyncio.Event()
    leaver = asyncio.create_task(serve(settings, stop))
    try:
        async with aiohttp.ClientSession() as session:

            async def health() -> int | None:
                try:
                    async with session.get(leaver_url + "/health") as resp:
                        return resp.status
                except aiohttp.ClientConnectionError:
                    return None

            await until(lambda: _is(health(), 200), "the leaver serving")
            await start_round(session, leaver_url, members, 0)  # the leaver's part goes out; it waits for the peer's
            stop.set()
            # Leaving, it answers 503 (draining) to new work, and it still listens while its round runs.
            await until(lambda: _is(health(), 503), "the leaver draining and still listening")
            assert not leaver.done()
            await start_round(session, peer_url, members, 1)
            await asyncio.wait_for(leaver, TIMEOUT_S)

            async with session.get(peer_url + f"/average/status?wait=step-0&wait_s={TIMEOUT_S}") as resp:
                last = (await resp.json())["last_round"]
            assert await health() is None, "the leaver still listens after it stopped"
        # The peer took the leaver's own reduction of part 0 (no backup), and both parts hold both members.
        assert last["round_id"] == "step-0" and last["ok"], last
        assert last["part_contributors"] == [[0, 1], [0, 1]] and last["parts_failed"] == [], last
        assert runtime.step == 1 and runtime.stats.last_effective_batch == 8
    finally:
        stop.set()
        if not leaver.done():
            leaver.cancel()
        await asyncio.gather(leaver, return_exceptions=True)
        await peer.close()


async def _is(status, expected: int) -> bool:
    return await status == expected
