"""A replica that answers garbage (``inject.garbage``), in process and in milliseconds: its
reply is a failed hop (``bad_reply``), retried on another replica, and the replica is banned.
The same fault on real processes is in test_faults.py."""

from __future__ import annotations

import pytest

from services.stage_server.routes import RUNTIME
from services.trainer.data import ByteBatcher, load_corpus
from services.trainer.pipeline import HopTimeouts, PipelineClient
from shared.codec import encode_tensor
from shared.config import FaultInjection
from shared.errors import RemoteError
from shared.http import post_message
from shared.retry import RetryPolicy
from tests.conftest import balancer_for, stage_settings


async def test_a_garbage_reply_is_a_failed_hop(start_stages, http_session):
    _, urls = await start_stages([[stage_settings(0, num_stages=1, inject=FaultInjection(garbage=1.0))]])
    batcher = ByteBatcher(load_corpus(), seq_len=16, microbatch_size=2)
    mb = batcher.microbatch(0)
    msg = {
        "run_id": "test",
        "stage": 0,
        "microbatch_id": "mb",
        "seed": 0,
        "inputs": encode_tensor(mb.inputs, "raw"),
        "targets": encode_tensor(mb.targets, "raw"),
    }
    for path in ("/forward", "/backward"):
        with pytest.raises(RemoteError) as err:
            await post_message(http_session, urls[0][0] + path, msg, timeout_s=10)
        assert (err.value.status, err.value.code, err.value.retryable) == (200, "bad_reply", True)


async def test_a_garbage_replica_is_routed_around_and_banned(start_stages, http_session):
    apps, urls = await start_stages(
        [
            [stage_settings(0, num_stages=2)],
            [stage_settings(1, num_stages=2, inject=FaultInjection(garbage=1.0)), stage_settings(1, num_stages=2)],
        ]
    )
    balancer = balancer_for(urls)
    client = PipelineClient(
        http_session,
        balancer,
        run_id="test",
        codec="fp32",
        timeouts=HopTimeouts(10, 10),
        retry=RetryPolicy(max_retries=3, base_delay_s=0.01),
    )
    batcher = ByteBatcher(load_corpus(), seq_len=16, microbatch_size=2)
    losses = [(await client.train(batcher.microbatch(i), seed=i)).loss for i in range(8)]
    assert len(losses) == 8
    garbage, good = (apps[1][i][RUNTIME].stats.backwards for i in (0, 1))
    assert good == 8 and garbage >= 1  # every microbatch's last hop ended on the good replica
    assert balancer.is_banned(1, urls[1][0]) and balancer.usable(1) == [urls[1][1]]
