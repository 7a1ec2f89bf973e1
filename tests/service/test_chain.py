"""Chain routing against in-process stage servers: the trainer's side (routes, alternates,
what it learns from an answer, re-runs) and the servers' refusals of bad chain messages."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch

from services.stage_server.routes import RUNTIME
from services.trainer.data import ByteBatcher, load_corpus
from services.trainer.pipeline import MicrobatchFailed, PipelineClient
from shared.codec import encode_tensor
from shared.config import FaultInjection
from shared.errors import RemoteError
from shared.http import post_message
from shared.processes import free_port
from shared.retry import RetryPolicy
from tests.conftest import balancer_for, stage_settings

NUM_STAGES = 4
BATCH = 2


@pytest.fixture
def batcher():
    return ByteBatcher(load_corpus(), seq_len=16, microbatch_size=BATCH, seed=3)


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


async def test_a_chain_goes_around_an_unreachable_replica_and_the_trainer_bans_it(start_stages, http_session, batcher):
    apps, urls = await start_stages([[stage_settings(s)] for s in range(NUM_STAGES)])
    dead = dead_url()
    urls[2] = [urls[2][0], dead]  # stage 2: a live replica and one that is gone
    balancer = balancer_for(urls)
    client = PipelineClient(
        http_session,
        balancer,
        run_id="test",
        codec="fp32",
        routing="chain",
        retry=RetryPolicy(max_retries=2, base_delay_s=0.01),
    )

    results = [await client.train(batcher.microbatch(i), seed=i) for i in range(4)]

    assert all(r.reruns == 0 for r in results)  # the stage-1 server rerouted: nothing ran again
    assert balancer.is_banned(2, dead)  # the answer named it, the trainer banned it
    for group in apps:  # every stage accumulated every microbatch exactly once
        assert group[0][RUNTIME].pending_samples == 4 * BATCH
        assert group[0][RUNTIME].stats.duplicate_backwards == 0
    for stage in range(NUM_STAGES):  # the wiring learnt every live replica's speed from the answers
        assert balancer.estimates(stage)[urls[stage][0]] is not None


async def test_a_chain_no_replica_can_complete_runs_again_and_is_reported_never_applied(
    start_stages, http_session, batcher
):
    apps, urls = await start_stages([[stage_settings(s)] for s in (0, 1, 3)])
    dead = dead_url()
    balancer = balancer_for([urls[0], urls[1], [dead], urls[2]])
    client = PipelineClient(
        http_session,
        balancer,
        run_id="test",
        codec="fp32",
        routing="chain",
        retry=RetryPolicy(max_retries=1, base_delay_s=0.01),
    )

    with pytest.raises(MicrobatchFailed, match="stale or broken"):
        await client.train(batcher.microbatch(0), seed=0)

    assert balancer.is_banned(2, dead)
    for group in apps:  # the backward never started: no stage accumulated anything
        assert group[0][RUNTIME].pending_samples == 0


async def test_chain_evaluation_equals_the_relay_one(start_stages, http_session, batcher):
    _, urls = await start_stages([[stage_settings(s)] for s in range(NUM_STAGES)])
    mb = batcher.microbatch(0, split="eval")
    relay = await PipelineClient(http_session, balancer_for(urls), run_id="test", codec="fp32").evaluate(mb, seed=0)
    chain = await PipelineClient(
        http_session, balancer_for(urls), run_id="test", codec="fp32", routing="chain"
    ).evaluate(mb, seed=0)
    assert chain == pytest.approx(relay, rel=1e-6)


@pytest.mark.parametrize(
    "change, code",
    [
        ({"route": "http://x"}, "bad_payload"),  # not a list per stage
        ({"route": [["http://127.0.0.1:1"]]}, "bad_payload"),  # too few later stages
        ({"route": [["ftp://x"]] * 3}, "bad_payload"),  # not http(s)
        ({"route": [[]] * 3}, "bad_payload"),  # a stage without replicas
        ({"budget_s": 0}, "bad_payload"),
        ({"budget_s": float("nan")}, "bad_payload"),
        ({"stage": 1}, "wrong_stage"),
    ],
)
async def test_bad_chain_messages_are_refused_before_any_work(change, code, start_stages, http_session, batcher):
    apps, urls = await start_stages([[stage_settings(0)]])
    mb = batcher.microbatch(0)
    msg = {
        "run_id": "test",
        "stage": 0,
        "microbatch_id": "m",
        "seed": 0,
        "codec": "fp32",
        "budget_s": 10.0,
        "route": [["http://127.0.0.1:1"]] * 3,
        "inputs": encode_tensor(mb.inputs, "raw"),
        "targets": encode_tensor(mb.targets, "raw"),
        **change,
    }
    with pytest.raises(RemoteError) as err:
        await post_message(http_session, urls[0][0] + "/chain", msg, timeout_s=10)
    assert err.value.code == code
    assert apps[0][0][RUNTIME].stats.forwards == 0


async def test_a_chain_past_the_held_memory_limit_is_refused_with_retry_after(start_stages, http_session, batcher):
    """One chain holds its input and output at each server until its backward; a second one
    that would pass SWARM_CHAIN_HELD_MB waits outside (503 overloaded, Retry-After)."""
    slow = stage_settings(
        1, inject=FaultInjection(delay_s=0.5), chain_held_mb=0.01
    )  # one chain of 2 x 16 x 128 floats already holds 32 KiB
    _, urls = await start_stages([[stage_settings(0)], [slow], [stage_settings(2)], [stage_settings(3)]])
    mb = batcher.microbatch(0)
    hidden = encode_tensor(torch.zeros(BATCH, 16, 128), "fp32")

    def msg(i):
        return {
            "run_id": "test",
            "stage": 1,
            "microbatch_id": f"m{i}",
            "seed": 0,
            "codec": "fp32",
            "budget_s": 10.0,
            "route": [[urls[2][0]], [urls[3][0]]],
            "inputs": hidden,
            "targets": encode_tensor(mb.targets, "raw"),
        }

    first = asyncio.create_task(post_message(http_session, urls[1][0] + "/chain", msg(0), timeout_s=10))
    for _ in range(1000):  # until the first chain is being computed there (at most ~10 s)
        if first.done() or (await (await http_session.get(urls[1][0] + "/health")).json())["queue_depth"] > 0:
            break
        await asyncio.sleep(0.01)
    assert not first.done()
    with pytest.raises(RemoteError) as err:
        await post_message(http_session, urls[1][0] + "/chain", msg(1), timeout_s=10)
    assert err.value.status == 503 and err.value.code == "overloaded" and err.value.retry_after_s is not None
    assert "SWARM_CHAIN_HELD_MB" in err.value.message
    assert "loss" in await first


SECRET = "a-test-secret-of-the-swarm-0123456789"
OTHER = "the-secret-of-another-swarm-98765"


async def test_chain_hops_are_signed_and_forwarded_work_from_outside_the_swarm_is_refused(start_stages, batcher):
    from shared.http import swarm_session

    apps, urls = await start_stages([[stage_settings(s, secret=SECRET)] for s in range(NUM_STAGES)])
    mb = batcher.microbatch(0)
    async with swarm_session(
        stage_settings(0, secret=SECRET)
    ) as member:  # a trainer of the swarm signs with its secret
        client = PipelineClient(member, balancer_for(urls), run_id="test", codec="fp32", routing="chain")
        await client.train(mb, seed=0)
    for group in apps:  # every server-to-server hop was signed and accepted
        assert group[0][RUNTIME].pending_samples == BATCH

    msg = {
        "run_id": "test",
        "stage": 0,
        "microbatch_id": "outside",
        "seed": 0,
        "codec": "fp32",
        "budget_s": 10.0,
        "route": [[u[0]] for u in urls[1:]],
        "inputs": encode_tensor(mb.inputs, "raw"),
        "targets": encode_tensor(mb.targets, "raw"),
    }
    async with aiohttp.ClientSession() as stranger:  # unsigned: refused at the door
        with pytest.raises(RemoteError) as err:
            await post_message(stranger, urls[0][0] + "/chain", msg, timeout_s=10)
    assert err.value.status == 401

    # a stage-0 server of another swarm (another secret) routes work to this swarm's stage 1: refused there
    before = [group[0][RUNTIME].stats.forwards + group[0][RUNTIME].stats.backwards_run for group in apps]
    _, outside = await start_stages([[stage_settings(0, secret=OTHER)]])
    async with swarm_session(stage_settings(0, secret=OTHER)) as theirs:
        with pytest.raises(RemoteError) as err:
            await post_message(theirs, outside[0][0] + "/chain", msg, timeout_s=10)
    assert err.value.status == 401 and err.value.code == "unauthorized", err.value
    # nothing of it was computed by this swarm's servers
    assert [group[0][RUNTIME].stats.forwards + group[0][RUNTIME].stats.backwards_run for group in apps] == before
