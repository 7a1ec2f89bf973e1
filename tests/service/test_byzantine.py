"""A Byzantine replica in the all-reduce of a stage's gradients: 1 of 4 replicas sends its
accumulated gradient sign-flipped and scaled by 1000 into every step round
(``inject.byzantine``). With CenteredClip the honest replicas' loss keeps falling; with the
plain mean the attacker steers every step and training breaks. Both are asserted, and the
honest replicas stay bit-identical after every step either way (they all apply what the
round reduced).

Real stage servers on loopback (one stage holding the whole tiny model, so every replica
computes the loss), registered with the real coordinator, which counts the samples and
starts each step round; the trainer's pipeline client routes microbatches over the four
replicas, the attacker included.
"""

from __future__ import annotations

import asyncio
import math

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from services.coordinator.app import create_app as create_coordinator
from services.stage_server.app import MEMBERSHIP, create_app
from services.stage_server.routes import RUNTIME
from services.trainer.data import ByteBatcher, load_corpus
from services.trainer.pipeline import PipelineClient
from shared.config import FaultInjection
from shared.processes import free_port
from tests.conftest import balancer_for, coordinator_settings, stage_settings

ROUNDS = 4
MICROBATCHES_PER_ROUND = 8  # 8 samples each: 2 global steps of 32 samples, 8 on each replica


@pytest.fixture
async def serve():
    servers: list[TestServer] = []

    async def _serve(app: web.Application, port: int | None = None) -> str:
        server = TestServer(app, host="127.0.0.1", port=port)
        await server.start_server()
        servers.append(server)
        return str(server.make_url("")).rstrip("/")

    yield _serve
    for server in servers:
        await server.close()


async def run_swarm(serve, http_session, aggregator: str) -> dict:
    """Train; returns the held-out losses after every ROUNDS-th part of the run."""
    coordinator = await serve(
        create_coordinator(coordinator_settings(num_stages=1, step_timeout_s=10.0, averaging_aggregator=aggregator))
    )
    apps, urls = [], []
    for i in range(4):
        port = free_port()  # the URL it registers is the one it listens at
        settings = stage_settings(
            0,
            num_stages=1,
            global_batch=32,
            warmup_steps=0,
            lr=1e-3,
            coordinator=coordinator,
            heartbeat_s=60.0,
            port=port,
            inject=FaultInjection(byzantine="sign_flip" if i == 3 else ""),
        )
        app = create_app(settings)
        apps.append(app)
        urls.append(await serve(app, port))
    for app in apps:
        await asyncio.wait_for(app[MEMBERSHIP].registered.wait(), 10)
    digests: dict[int, list[str]] = {}
    for app in apps[:3]:
        record_digests(app[RUNTIME], digests)

    batcher = ByteBatcher(load_corpus(None), 64, 8, seed=0)
    clients = [
        PipelineClient(http_session, balancer_for([[url]]), run_id="test", codec="fp32") for url in urls
    ]  # each step: a microbatch on every replica
    evaluate = PipelineClient(
        http_session, balancer_for([urls[:1]]), run_id="test", codec="fp32"
    )  # an honest replica's view

    async def held_out() -> float:
        losses = [await evaluate.evaluate(batcher.microbatch(i, split="eval"), seed=0) for i in range(4)]
        return sum(losses) / len(losses)

    losses, index = [await held_out()], 0
    for _ in range(ROUNDS):
        for _ in range(MICROBATCHES_PER_ROUND):
            await clients[index % len(clients)].train(batcher.microbatch(index), seed=index)
            index += 1
        losses.append(await held_out())
    steps = [app[RUNTIME].step for app in apps]
    assert steps == [ROUNDS * MICROBATCHES_PER_ROUND * 8 // 32] * 4, steps
    assert sorted(digests) == list(range(1, steps[0] + 1)) and all(
        len(set(d)) == 1 and len(d) == 3 for d in digests.values()
    ), "honest replicas differ after a step"
    return {"losses": losses}


def record_digests(runtime, digests: dict[int, list[str]]) -> None:
    """After each step the runtime applies, its digest goes to ``digests[step]`` (on the compute worker)."""
    apply_step = runtime.apply_step

    def recording(gradient):
        apply_step(gradient)
        digests.setdefault(runtime.step, []).append(runtime.digest())

    runtime.apply_step = recording


async def test_centered_clip_contains_a_sign_flipping_replica_and_the_mean_does_not(serve, http_session):
    robust = await run_swarm(serve, http_session, "centered_clip")
    print(f"\ncentered_clip: held-out loss {[round(x, 3) for x in robust['losses']]}")
    assert all(b < a for a, b in zip(robust["losses"], robust["losses"][1:])), "the loss stopped falling"
    assert robust["losses"][-1] < robust["losses"][0] - 0.5

    plain = await run_swarm(serve, http_session, "mean")
    print(f"mean: held-out loss {[round(x, 3) for x in plain['losses']]}")
    final = plain["losses"][-1]
    assert math.isnan(final) or final > robust["losses"][-1] + 1.0, "the plain mean should break training"
