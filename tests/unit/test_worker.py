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


class SteppedClock:
    """``perf_counter`` that moves only when a job says so (thread-safe enough: one job runs at a time)."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


async def test_a_job_s_wait_behind_another_is_counted_apart_from_its_own_time(monkeypatch):
    """``QUEUED_S``: what the calling task's jobs waited in the queue (a chain hop reports
    its time less this to the trainer's wiring, which counts the queue itself). Job A takes
    5 s of the clock; B, queued behind it, waited those 5 s and took 2 of its own."""
    import services.stage_server.runtime as runtime_module
    from services.stage_server.runtime import QUEUED_S

    clock = SteppedClock()
    monkeypatch.setattr(runtime_module, "time", clock)
    w = ComputeWorker(max_queue=4)
    release = threading.Event()

    def job(seconds: float):
        release.wait(10.0)
        clock.now += seconds

    async def timed(seconds: float) -> tuple[float, float]:
        before = clock.now
        await w.run(job, seconds)
        return QUEUED_S.get(), clock.now - before

    try:
        first = asyncio.ensure_future(timed(5.0))
        await asyncio.sleep(0)
        second = asyncio.ensure_future(timed(2.0))
        await asyncio.sleep(0)
        assert w.queue_depth == 2
        release.set()
        (queued_a, _), (queued_b, elapsed_b) = await first, await second
    finally:
        w.close()
    assert queued_a == 0.0
    assert (queued_b, elapsed_b) == (5.0, 7.0)  # its own time: 7 - 5 = 2
    assert QUEUED_S.get() == 0.0  # each task counts its own
