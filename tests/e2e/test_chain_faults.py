"""Chain routing under faults, with real processes killed by SIGKILL mid-chain.

Six stage servers (4 stages; stages 1 and 2 with replicas A and B, all with the same
weights, no coordinator and a global batch too large to step) and a test that sends
``POST /chain`` with an explicit route, as a trainer does:

- a downstream killed mid-forward: stage 2's preferred replica dies while it computes the
  forward; stage 1 still holds its output and sends it to the alternate; the microbatch
  completes with the loss of the whole model in one process, every stage accumulated it
  once, and the answer names the dead replica;
- an upstream killed mid-backward: stage 1's preferred replica dies while the last stage
  computes; stage 0 reroutes to stage 1's alternate, whose chain reaches the same stage-2
  and stage-3 replicas again: they recognise the microbatch and do not accumulate it twice.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.trainer.data import ByteBatcher, load_corpus
from shared.codec import encode_tensor
from shared.http import post_message
from shared.model import PRESETS, build_gpt
from shared.processes import wait_healthy
from tests.e2e.conftest import get_json, wait_until

pytestmark = pytest.mark.e2e

START_S = 120  # six children import torch at once on 2 cores
COMMON = {
    "SWARM_MODEL": "tiny",
    "SWARM_NUM_STAGES": "4",
    "SWARM_WIRE_CODEC": "fp32",
    "SWARM_GLOBAL_BATCH": str(10**6),
    "SWARM_SEED": "0",
}
SLOW_S = 1.0  # injected delay per forward pass of work on the replicas killed mid-work, and on the last stage


def reference_loss(mb) -> float:
    with torch.no_grad():
        return float(build_gpt(PRESETS["tiny"], seed=0)(mb.inputs, mb.targets))


def stats(url: str) -> dict:
    return get_json(url + "/health")["stats"]


async def send_chain(run_id: str, stage0: str, route: list[list[str]], mb) -> dict:
    import aiohttp

    msg = {
        "run_id": run_id,
        "stage": 0,
        "microbatch_id": f"{run_id}:test:{mb.index}",
        "seed": 0,
        "codec": "fp32",
        "budget_s": 120.0,
        "route": route,
        "inputs": encode_tensor(mb.inputs, "raw"),
        "targets": encode_tensor(mb.targets, "raw"),
    }
    async with aiohttp.ClientSession() as session:
        return await post_message(session, stage0 + "/chain", msg, timeout_s=120)


async def test_a_chain_reroutes_around_a_downstream_killed_mid_forward_and_an_upstream_killed_mid_backward(processes):
    def server(stage: int, slow: bool = False):
        return processes.server(stage, extra={**COMMON, **({"SWARM_INJECT_DELAY_S": str(SLOW_S)} if slow else {})})

    s0, s1a, s1b, s2a, s2b, s3 = server(0), server(1), server(1), server(2, slow=True), server(2), server(3, slow=True)
    for proc, url in (s0, s1a, s1b, s2a, s2b, s3):
        wait_healthy(url, proc, START_S)
    batcher = ByteBatcher(load_corpus(), seq_len=64, microbatch_size=4, seed=1)
    batch = 4

    # 1. stage 2's choice dies while it computes the forward: stage 1 sends its output to the alternate
    first = batcher.microbatch(0)
    chain = asyncio.create_task(send_chain(processes.run_id, s0[1], [[s1a[1]], [s2a[1], s2b[1]], [s3[1]]], first))
    await asyncio.to_thread(
        wait_until,
        lambda: get_json(s2a[1] + "/health")["queue_depth"] >= 1,
        60,
        "stage 2's choice to start the forward",
        0.02,
    )
    s2a[0].kill()
    s2a[0].wait(10)
    reply = await chain
    assert reply["loss"] == pytest.approx(reference_loss(first), rel=1e-6)
    assert [(f["stage"], f["replica"]) for f in reply["rerouted"]] == [(2, s2a[1])]
    assert [(h["stage"], h["replica"]) for h in reply["hops"]] == [(1, s1a[1]), (2, s2b[1]), (3, s3[1])]
    for url in (s0[1], s1a[1], s2b[1], s3[1]):
        assert stats(url)["samples"] == batch and stats(url)["duplicate_backwards"] == 0, url

    # 2. stage 1's choice dies while the last stage computes: stage 0 reroutes to stage 1's
    #    alternate, whose chain reaches the same stage-2 and stage-3 replicas again
    second = batcher.microbatch(1)
    chain = asyncio.create_task(send_chain(processes.run_id, s0[1], [[s1a[1], s1b[1]], [s2b[1]], [s3[1]]], second))
    await asyncio.to_thread(
        wait_until, lambda: get_json(s3[1] + "/health")["queue_depth"] >= 1, 60, "the last stage to start", 0.02
    )
    s1a[0].kill()
    s1a[0].wait(10)
    reply = await chain
    assert reply["loss"] == pytest.approx(reference_loss(second), rel=1e-6)
    assert [(f["stage"], f["replica"]) for f in reply["rerouted"]] == [(1, s1a[1])]
    assert [(h["stage"], h["replica"]) for h in reply["hops"]] == [(1, s1b[1]), (2, s2b[1]), (3, s3[1])]
    # every live stage holds both microbatches once; stages 2 and 3 ran the second one's backward twice
    for url in (s0[1], s2b[1], s3[1]):
        assert stats(url)["samples"] == 2 * batch, url
    assert stats(s1b[1])["samples"] == batch
    assert stats(s2b[1])["duplicate_backwards"] == 1 and stats(s3[1])["duplicate_backwards"] == 1
    assert stats(s0[1])["duplicate_backwards"] == 0 and stats(s1b[1])["duplicate_backwards"] == 0
