"""A stage whose only replica is down (killed, restarting at the same address, or replaced by a
new one the registry lists) is waited for (``HopTimeouts.stage_wait_s``) instead of failing
the microbatches that need it; without the wait, or past it, they fail and are reported."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestServer

from services.stage_server.app import create_app
from services.stage_server.routes import RUNTIME
from services.trainer.data import ByteBatcher, load_corpus
from services.trainer.pipeline import HopTimeouts, MicrobatchFailed, PipelineClient
from shared.processes import fixed_port, free_port
from shared.retry import RetryPolicy
from tests.conftest import balancer_for, stage_settings

NUM_STAGES = 3
DOWN = 1  # the stage whose replica is down at first
BATCH = 2


@pytest.fixture
def microbatch():
    return ByteBatcher(load_corpus(), seq_len=16, microbatch_size=BATCH, seed=4).microbatch(0)


class EventLog:
    """A logger that keeps the names of the events logged."""

    def __init__(self):
        self.events: list[str] = []

    def _log(self, event: str, **fields) -> None:
        self.events.append(event)

    debug = info = warning = _log


class Comeback:
    """The registry view's callback for a stage with no usable replica: the first call brings
    the stage's replica up at the dead address (a restart), as a preempted server's does."""

    def __init__(self, port: int):
        self.port, self.calls, self.server = port, 0, None

    async def __call__(self, stage: int) -> None:
        assert stage == DOWN
        self.calls += 1
        if self.server is None:
            self.server = TestServer(create_app(stage_settings(DOWN, NUM_STAGES)), host="127.0.0.1", port=self.port)
            await self.server.start_server()


@pytest.mark.parametrize("routing", ["relay", "chain"])
async def test_a_microbatch_waits_for_a_stage_whose_replica_comes_back(routing, start_stages, http_session, microbatch):
    apps, urls = await start_stages([[stage_settings(s, NUM_STAGES)] for s in range(NUM_STAGES) if s != DOWN])
    port = fixed_port()  # free until the replica comes back: no bind to port 0 may take it meanwhile
    comeback = Comeback(port)
    balancer = balancer_for([urls[0], [f"http://127.0.0.1:{port}"], urls[1]])
    client = PipelineClient(
        http_session,
        balancer,
        run_id="test",
        codec="fp32",
        routing=routing,
        timeouts=HopTimeouts(10, 10, stage_wait_s=30),
        retry=RetryPolicy(max_retries=1, base_delay_s=0.01),
        on_stage_empty=comeback,
    )
    try:
        result = await client.train(microbatch, seed=0)
        assert comeback.calls >= 1 and comeback.server is not None  # it waited, the stage came back
        for app in [apps[0][0], comeback.server.app, apps[1][0]]:  # every stage took the microbatch exactly once
            assert app[RUNTIME].pending_samples == BATCH and app[RUNTIME].stats.duplicate_backwards == 0
        assert result.reruns == (1 if routing == "chain" else 0)  # a chain broke once at the dead stage, then ran again
    finally:
        if comeback.server is not None:
            await comeback.server.close()


@pytest.mark.parametrize("routing", ["relay", "chain"])
@pytest.mark.parametrize("wait_s", [0.0, 1.5])
async def test_without_the_wait_or_past_it_the_microbatch_fails_and_nothing_is_applied(
    routing, wait_s, start_stages, http_session, microbatch
):
    apps, urls = await start_stages([[stage_settings(s, NUM_STAGES)] for s in range(NUM_STAGES) if s != DOWN])

    async def nobody_comes(stage: int) -> None:
        pass

    log = EventLog()
    balancer = balancer_for([urls[0], [f"http://127.0.0.1:{free_port()}"], urls[1]])
    client = PipelineClient(
        http_session,
        balancer,
        run_id="test",
        codec="fp32",
        routing=routing,
        timeouts=HopTimeouts(10, 10, stage_wait_s=wait_s),
        retry=RetryPolicy(max_retries=1, base_delay_s=0.01),
        on_stage_empty=nobody_comes,
        log=log,
    )
    with pytest.raises(MicrobatchFailed):
        await client.train(microbatch, seed=0)
    assert ("stage.outage" in log.events) == (wait_s > 0)  # waited only with a wait to spend
    for group in apps:
        assert group[0][RUNTIME].pending_samples == 0  # no stage accumulated anything
