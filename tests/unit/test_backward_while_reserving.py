"""A backward computes its gradient while the coordinator answers its reservation
(``routes.run_backward``): the coordinator's round trip is off each stage's backward path.

The coordinator here is a transport the test holds (the real ``StepClient`` posts to it), so
the order of the two is set by construction: an answer held until the compute ran, or a
compute held until the answer came. Each test fails on a server that reserves first and
computes after (it would wait on itself) or that loses the gradient in between.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from services.stage_server.routes import RUNTIME, SETTINGS, STEPPER, WORKER, StageRequest, run_backward
from services.stage_server.runtime import ComputeWorker, OptimizerConfig, StageRuntime
from services.stage_server.stepping import StepClient
from shared.errors import Overloaded, RemoteError
from shared.log import get_logger
from shared.model import PRESETS
from tests.conftest import stage_settings

CFG = PRESETS["tiny"]
WAIT_S = 10.0  # bound on every wait: a server that serialises the two fails here, it does not hang


class WatchedRuntime(StageRuntime):
    """A stage runtime that says (to the event loop) when a backward's gradient is computed,
    and can hold the compute until the test lets it go."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        super().__init__(CFG, 1, 3, optim=OptimizerConfig(global_batch=8), solo=False)
        self.loop, self.computed, self.release = loop, asyncio.Event(), threading.Event()
        self.release.set()

    def compute_backward(self, *args, **kwargs):
        assert self.release.wait(WAIT_S), "the compute was never let go"
        out = super().compute_backward(*args, **kwargs)
        self.loop.call_soon_threadsafe(self.computed.set)
        return out


class Coordinator:
    """The coordinator's side of ``/step/reserve`` and ``/step/done`` as the test scripts it."""

    def __init__(self, runtime: WatchedRuntime, *, hold_answer: bool, bucket: int = 0, refuse: bool = False):
        self.runtime, self.hold_answer, self.bucket, self.refuse = runtime, hold_answer, bucket, refuse
        self.reserve_saw_gradient: bool | None = None
        self.done: list[dict] = []

    async def post(self, path: str, body: dict) -> dict:
        if path == "/step/done":
            self.done.append(body)
            return {"round": None, "step": 0}
        assert path == "/step/reserve"
        if self.hold_answer:  # answer only once the gradient is computed
            await asyncio.wait_for(self.runtime.computed.wait(), WAIT_S)
        self.reserve_saw_gradient = self.runtime.computed.is_set()
        if self.refuse:
            raise RemoteError("/step/reserve", 503, "overloaded", "the stage is a whole step ahead")
        self.runtime.release.set()  # the compute may finish only now (hold_answer=False)
        return {"verdict": "reserved", "bucket": self.bucket, "step": 0, "replicas": 1}


async def nothing(*args) -> None:
    return None


WORKERS: list[ComputeWorker] = []


@pytest.fixture(autouse=True)
def _close_workers():
    yield
    while WORKERS:
        WORKERS.pop().close()


def server(coordinator_of) -> tuple[dict, WatchedRuntime, Coordinator]:
    runtime = WatchedRuntime(asyncio.get_running_loop())
    coordinator = coordinator_of(runtime)
    stepper = StepClient(
        runtime,
        post=coordinator.post,
        resync=nothing,
        wait_round=nothing,
        round_wait_s=1.0,
        log=get_logger(service="test"),
        identity={"run_id": "test", "stage": 1, "url": "http://a", "global_batch": 8},
    )
    app = {
        RUNTIME: runtime,
        WORKER: ComputeWorker(8),  # closed by _close_workers
        STEPPER: stepper,
        SETTINGS: stage_settings(1, 3, global_batch=8),
    }
    WORKERS.append(app[WORKER])
    return app, runtime, coordinator


def request(runtime: StageRuntime, *, forward_ran: bool = True, admitted_step: int | None = 0) -> StageRequest:
    """A backward of a microbatch of stage 1 of 3, whose forward ran on ``runtime`` (else: runs with it)."""
    torch.manual_seed(0)
    inputs = torch.randn(2, 8, CFG.d_model)
    if forward_ran:
        runtime.forward("mb0", 1, inputs, None)
    return StageRequest(
        "mb0",
        1,
        "fp32",
        False,
        inputs,
        None,
        torch.randn(2, 8, CFG.d_model),
        forward_step=0 if forward_ran else None,
        admitted_step=admitted_step,
    )


async def test_the_gradient_is_computed_while_the_coordinator_holds_the_reservation():
    app, runtime, coordinator = server(lambda rt: Coordinator(rt, hold_answer=True))
    reply = await asyncio.wait_for(run_backward(app, request(runtime)), WAIT_S)
    assert coordinator.reserve_saw_gradient is True
    assert reply["accumulated"] and reply["bucket"] == 0
    assert runtime.pending(0) == 2 and runtime.stats.backwards == 1
    assert [d["samples"] for d in coordinator.done] == [2]  # the done report says what went in


async def test_an_answer_that_comes_before_the_gradient_is_accumulated_by_the_same_job():
    def held(rt):
        rt.release.clear()  # the compute waits for the coordinator's answer
        return Coordinator(rt, hold_answer=False)

    app, runtime, coordinator = server(held)
    reply = await asyncio.wait_for(run_backward(app, request(runtime)), WAIT_S)
    assert coordinator.reserve_saw_gradient is False
    assert reply["accumulated"] and runtime.pending(0) == 2
    assert [d["samples"] for d in coordinator.done] == [2]


async def test_a_gradient_its_reserved_step_refuses_gives_the_reservation_back():
    """Reserved two steps past the weights it ran on (SWARM_MAX_STALENESS=1): refused as
    stale after its compute, and the reservation goes back with 0 samples."""
    app, runtime, coordinator = server(lambda rt: Coordinator(rt, hold_answer=True, bucket=2))
    with pytest.raises(Exception, match="run the microbatch again"):
        await asyncio.wait_for(run_backward(app, request(runtime)), WAIT_S)
    assert runtime.pending(2) == 0 and runtime.stats.backwards == 0
    assert [d["samples"] for d in coordinator.done] == [0]


async def test_a_refused_reservation_fails_the_backward_and_nothing_is_accumulated():
    app, runtime, coordinator = server(lambda rt: Coordinator(rt, hold_answer=True, refuse=True))
    with pytest.raises(Overloaded):
        await asyncio.wait_for(run_backward(app, request(runtime)), WAIT_S)
    assert runtime.pending(0) == 0 and runtime.stats.backwards == 0 and coordinator.done == []


async def test_a_forward_that_runs_with_its_backward_reserves_first_unless_its_step_is_open_here():
    """The last stage's single call (no forward_step) runs on the weights of now: without an
    admitted step that is open here, the reservation comes first (its answer may wait for
    the stage to step, and the gradient must be of the newer weights)."""
    app, runtime, coordinator = server(lambda rt: Coordinator(rt, hold_answer=False))
    req = request(runtime, forward_ran=False, admitted_step=None)
    reply = await asyncio.wait_for(run_backward(app, req), WAIT_S)
    assert coordinator.reserve_saw_gradient is False and reply["accumulated"]
