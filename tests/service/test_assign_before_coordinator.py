"""A ``--stage auto`` server that asks for its stage before the coordinator listens keeps
asking (issue 28: servers form a swarm whatever order they start in). In the arena, two
servers started beside a coordinator that was slow to listen got ``connection refused``
from ``/assign`` and exited, and the swarm never formed."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from services.coordinator.app import create_app
from services.stage_server.membership import assign_stage
from shared.errors import RemoteError
from shared.processes import free_port
from tests.conftest import coordinator_settings

RUN_ID = "late-coordinator"


class Recorder:
    """A structlog-like logger that counts the retries and lets a test wait for one."""

    def __init__(self) -> None:
        self.retries: list[dict] = []
        self.retried = asyncio.Event()

    def warning(self, event: str, **fields) -> None:
        assert event == "assign.retry", event
        self.retries.append(fields)
        self.retried.set()


async def test_a_server_asking_before_the_coordinator_listens_gets_its_stage_once_it_does():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Recorder()
    async with aiohttp.ClientSession() as session:
        ask = asyncio.create_task(assign_stage(session, url, RUN_ID, timeout_s=30.0, log=log))
        await asyncio.wait_for(log.retried.wait(), 10.0)  # refused at least once: nothing listens yet
        assert not ask.done() and log.retries[0]["failures"] == 1
        runner = web.AppRunner(create_app(coordinator_settings(run_id=RUN_ID, num_stages=3)))
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", port).start()
            assert await asyncio.wait_for(ask, 10.0) == 0  # the empty swarm's first stage
        finally:
            await runner.cleanup()


async def test_a_wrong_run_is_final_and_an_absent_coordinator_gives_up_at_the_deadline():
    runner = web.AppRunner(create_app(coordinator_settings(run_id=RUN_ID, num_stages=3)))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    log = Recorder()
    try:
        async with aiohttp.ClientSession() as session:
            with pytest.raises(RemoteError) as err:
                await assign_stage(session, f"http://127.0.0.1:{port}", "another-run", timeout_s=30.0, log=log)
            assert err.value.status == 409 and not log.retries  # retrying cannot change it
    finally:
        await runner.cleanup()
    async with aiohttp.ClientSession() as session:
        with pytest.raises(RemoteError) as err:
            await assign_stage(session, f"http://127.0.0.1:{free_port()}", RUN_ID, timeout_s=1.0, log=log)
        assert err.value.status is None and 1 <= len(log.retries) <= 10
