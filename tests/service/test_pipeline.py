"""The trainer against in-process stage servers: pipelining, retries, failures reported."""

from __future__ import annotations

import pytest

from services.stage_server.routes import RUNTIME
from services.trainer.data import ByteBatcher, load_corpus
from services.trainer.pipeline import HopTimeouts, MicrobatchFailed, PipelineClient
from services.trainer.trainer import Trainer
from shared.config import FaultInjection
from shared.retry import RetryPolicy
from tests.conftest import balancer_for, stage_settings

NUM_STAGES = 4


def server(stage: int, **overrides):
    """A stage server that steps after each microbatch (global batch 1, as the trainers here
    take it) and accepts any staleness: these tests are about the pipeline, not the optimizer."""
    return stage_settings(stage, **{"wire_codec": "int8", "global_batch": 1, "max_staleness": 1000, **overrides})


def make_trainer(
    session,
    urls,
    *,
    steps,
    in_flight,
    microbatch_size=1,
    seq_len=16,
    global_batch=1,
    retry=RetryPolicy(max_retries=3, base_delay_s=0.01),
    start_step=0,
):
    client = PipelineClient(
        session, balancer_for(urls), run_id="test", codec="int8", timeouts=HopTimeouts(10, 10), retry=retry
    )
    batcher = ByteBatcher(load_corpus(), seq_len, microbatch_size)
    return Trainer(
        client,
        batcher,
        steps=steps,
        global_batch=global_batch,
        in_flight=in_flight,
        eval_microbatches=1,
        start_step=start_step,
    )


async def test_microbatches_in_flight_keep_every_stage_busy(start_stages, http_session):
    """With an injected delay of 60 ms per forward of work (backward 120 ms, the last stage's
    forward+backward 180 ms: every stage is 180 ms per microbatch), K=4 in flight gives
    >= 0.75*4 the throughput of 1 in flight: the stages work on different microbatches at
    once. Throughput is measured in steady state: the middle half of the run, after the
    pipeline has filled and before it drains (one microbatch per step here). The delays are
    what the stages wait, so the real compute and the event loop beside another test's
    processes must stay small against them: at 30 ms a fresh-clone CI run measured 2.89x."""
    _, urls = await start_stages([[server(s, inject=FaultInjection(delay_s=0.06))] for s in range(NUM_STAGES)])
    one = await make_trainer(http_session, urls, steps=6, in_flight=1).run()
    four = await make_trainer(
        http_session, urls, steps=6 + 40, in_flight=4, start_step=6
    ).run()  # the same swarm goes on from step 6
    assert one.microbatches_completed == 6 and four.microbatches_completed == 40
    rate_one = steady_rate(one.step_elapsed_s, 1, 5)
    rate_four = steady_rate(four.step_elapsed_s, 10, 30)
    print(f"pipelining: K=4 gives {rate_four / rate_one:.2f}x the throughput of K=1")
    assert rate_four >= 0.75 * 4 * rate_one, f"K=4 gives only {rate_four / rate_one:.2f}x the throughput of K=1"


def steady_rate(step_elapsed_s: list[float], first: int, last: int) -> float:
    """Steps per second between the completion of step ``first`` and step ``last``."""
    return (last - first) / (step_elapsed_s[last] - step_elapsed_s[first])


async def test_failed_hop_is_retried_on_another_replica(start_stages, http_session):
    """A dead replica of stage 1 (nothing listens at its address): every microbatch still completes."""
    apps, urls = await start_stages([[server(s)] for s in range(NUM_STAGES)])
    dead = "http://127.0.0.1:9"  # discard port: connection refused on loopback
    urls[1] = [dead, *urls[1]]
    summary = await make_trainer(http_session, urls, steps=8, in_flight=4).run()
    assert summary.microbatches_completed == 8 and summary.microbatches_failed == 0
    assert apps[1][0][RUNTIME].stats.backwards == 8


async def test_microbatch_that_exhausts_retries_is_reported_not_dropped(start_stages, http_session):
    _, urls = await start_stages([[server(s)] for s in range(NUM_STAGES)])
    urls[2] = ["http://127.0.0.1:9"]  # the only replica of stage 2 is gone
    trainer = make_trainer(
        http_session, urls, steps=3, in_flight=2, retry=RetryPolicy(max_retries=2, base_delay_s=0.01)
    )
    mb = trainer.batcher.microbatch(0)
    with pytest.raises(MicrobatchFailed) as failed:
        await trainer.client.train(mb, seed=0)
    assert failed.value.stage == 2 and len(failed.value.errors) == 3  # first try + 2 retries
    assert all(err.code == "unreachable" for err in failed.value.errors)


async def test_trainer_accounts_for_every_scheduled_microbatch(start_stages, http_session):
    """Half the replicas of stage 3 reject everything as malformed (400, not retryable):
    the trainer counts each microbatch exactly once, completed or failed, with the reason."""
    apps, urls = await start_stages([[server(s)] for s in range(NUM_STAGES)] + [[server(3, run_id="other")]])
    urls = urls[:3] + [urls[3] + urls[4]]  # stage 3: one good replica, one from another run (409, retried)
    summary = await make_trainer(http_session, urls, steps=12, in_flight=3).run()
    assert summary.microbatches_completed + summary.microbatches_failed == summary.microbatches_scheduled == 12
    assert summary.microbatches_failed == 0  # a 409 is retried on the other replica
    assert len(summary.step_losses) == 12


async def test_overloaded_answers_are_waited_out_per_retry_after_without_using_up_retries(http_session):
    """A replica that answers 503 overloaded (Retry-After) more often than max_retries: the
    hop waits as told and the microbatch still completes; any other failure would have
    failed it after max_retries."""
    import time

    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from services.stage_server.app import create_app

    busy = {"left": 6}

    @web.middleware
    async def overloaded_at_first(request, handler):
        if request.path == "/backward" and busy["left"]:
            busy["left"] -= 1
            return web.json_response(
                {"error": {"code": "overloaded", "message": "queue full"}}, status=503, headers={"Retry-After": "0.25"}
            )
        return await handler(request)

    app = create_app(stage_settings(0, num_stages=1))
    app.middlewares.insert(0, overloaded_at_first)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        url = str(server.make_url("")).rstrip("/")
        client = PipelineClient(
            http_session,
            balancer_for([[url]]),
            run_id="test",
            codec="fp32",
            retry=RetryPolicy(max_retries=3, base_delay_s=0.01),
        )
        mb = ByteBatcher(load_corpus(None), 16, 2, seed=0).microbatch(0)
        started = time.monotonic()
        loss = (await client.train(mb, seed=0)).loss
        assert loss > 0 and busy["left"] == 0
        assert time.monotonic() - started >= 6 * 0.25, "Retry-After was not honoured"
    finally:
        await server.close()
