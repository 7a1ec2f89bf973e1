"""The compute worker's admission: new work is refused past the queue bound and while the
server drains; a step round's own jobs (``bounded=False``) never are."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services.stage_server.runtime import ComputeWorker
from shared.errors import Draining, Overloaded


@pytest.fixture
def worker():
    w = ComputeWorker(max_queue=1)
    yield w
    w.close()


async def test_a_full_queue_refuses_new_work_but_not_a_step_rounds_jobs(worker):
    release = threading.Event()
    busy = asyncio.ensure_future(worker.run(release.wait, 10.0))
    await asyncio.sleep(0)  # the blocking job is accepted: the queue is full
    assert worker.queue_depth == 1

    with pytest.raises(Overloaded):
        await worker.run(lambda: "new work")
    step_job = asyncio.ensure_future(worker.run(lambda: "bookkeeping", bounded=False))
    await asyncio.sleep(0)
    assert worker.queue_depth == 2  # counted like any job: the load signal sees it

    release.set()
    assert await busy is True and await step_job == "bookkeeping"
    assert worker.queue_depth == 0


async def test_a_drain_refuses_new_work_but_not_a_step_rounds_jobs_and_waits_for_them(worker):
    worker.draining = True
    with pytest.raises(Draining):
        await worker.run(lambda: "new work")
    assert await worker.run(lambda: "bookkeeping", bounded=False) == "bookkeeping"
    assert await worker.drain(1.0)
