"""A Byzantine replica in averaging: 1 of 4 replicas of a stage sends its parameters
sign-flipped and scaled by 1000 into every round (``inject_byzantine``). With CenteredClip
the honest replicas end each round within their own spread and the loss keeps falling; with
the plain mean they are dragged far outside it and training breaks. Both are asserted.

Real stage servers on loopback (one stage holding the whole tiny model, so every replica
computes the loss), the real coordinator running each round on ``POST /average``, and the
trainer's pipeline client routing microbatches over the four replicas, the attacker
included. Training and averaging alternate, so the weights before a round are known
exactly.
"""

from __future__ import annotations

import math

import aiohttp
import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestServer

from shared.config import CoordinatorSettings
from services.coordinator.app import create_app as create_coordinator
from services.stage_server.app import create_app
from services.stage_server.averaging import flat_parameters
from services.stage_server.routes import RUNTIME, WORKER
from services.trainer.data import ByteBatcher, load_corpus
from services.trainer.pipeline import PipelineClient
from tests.conftest import balancer_for, stage_settings

ROUNDS = 4
MICROBATCHES_PER_ROUND = 12  # 8 samples each: 3 optimizer steps of 32 samples spread over 4 replicas


@pytest.fixture
async def serve():
    servers: list[TestServer] = []

    async def _serve(app: web.Application) -> str:
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        return str(server.make_url("")).rstrip("/")

    yield _serve
    for server in servers:
        await server.close()


async def params_of(app) -> torch.Tensor:
    return await app[WORKER].run(flat_parameters, app[RUNTIME].params)


async def run_swarm(serve, http_session, aggregator: str) -> dict:
    """Train, average, repeat; returns the honest replicas' distances from their mean after
    each round (relative to their spread before it) and the held-out losses."""
    apps, urls = [], []
    for i in range(4):
        settings = stage_settings(0, num_stages=1, samples_per_step=8, warmup_steps=0, lr=1e-3, inject_byzantine="sign_flip" if i == 3 else "")
        app = create_app(settings)
        apps.append(app)
        urls.append(await serve(app))
    coordinator = await serve(create_coordinator(CoordinatorSettings(
        run_id="test", num_stages=1, heartbeat_s=60.0, state_db=":memory:", mdns=False, coordinator="",
        average_every_s=0, averaging_timeout_s=10.0, rebalance_every_s=0, averaging_aggregator=aggregator,
    )))
    for i, url in enumerate(urls):
        body = {"run_id": "test", "server_id": f"r{i}", "stage": 0, "url": url, "version": "t", "throughput": 1.0, "queue_length": 0}
        async with http_session.post(coordinator + "/register", json=body) as resp:
            assert resp.status == 200

    batcher = ByteBatcher(load_corpus(None), 64, 8, seed=0)
    client = PipelineClient(http_session, balancer_for([urls]), run_id="test", codec="fp32")
    honest = apps[:3]
    evaluate = PipelineClient(http_session, balancer_for([urls[:1]]), run_id="test", codec="fp32")  # an honest replica's view

    async def held_out() -> float:
        losses = [await evaluate.evaluate(batcher.microbatch(i, split="eval"), seed=0) for i in range(4)]
        return sum(losses) / len(losses)

    losses, distances, index = [await held_out()], [], 0
    for _ in range(ROUNDS):
        for _ in range(MICROBATCHES_PER_ROUND):
            await client.train(batcher.microbatch(index), seed=index)
            index += 1
        before = torch.stack([await params_of(app) for app in honest])
        mean = before.mean(0)
        spread = float((before - mean).norm(dim=1).max())
        async with http_session.post(coordinator + "/average", json={}, timeout=aiohttp.ClientTimeout(total=60)) as resp:
            assert resp.status == 200
            (rnd,) = (await resp.json())["rounds"]
        assert rnd["accepted"] == 4 and rnd["ended"] == 4
        after = torch.stack([await params_of(app) for app in honest])
        distances.append(float((after - mean).norm(dim=1).max()) / spread)
        losses.append(await held_out())
    return {"distances": distances, "losses": losses}


async def test_centered_clip_contains_a_sign_flipping_replica_and_the_mean_does_not(serve, http_session):
    robust = await run_swarm(serve, http_session, "centered_clip")
    print(f"\ncentered_clip: distance/spread {[round(d, 3) for d in robust['distances']]}, held-out loss {[round(x, 3) for x in robust['losses']]}")
    assert max(robust["distances"]) <= 1.0, "CenteredClip left the honest replicas' spread"
    assert all(b < a for a, b in zip(robust["losses"], robust["losses"][1:])), "the loss stopped falling"
    assert robust["losses"][-1] < robust["losses"][0] - 0.5

    plain = await run_swarm(serve, http_session, "mean")
    print(f"mean: distance/spread {[round(d, 3) for d in plain['distances']]}, held-out loss {[round(x, 3) for x in plain['losses']]}")
    assert min(plain["distances"]) > 10, "the plain mean should be dragged far outside the honest spread"
    final = plain["losses"][-1]
    assert math.isnan(final) or final > robust["losses"][-1] + 1.0, "the plain mean should break training"
