"""State transfer between replicas of a stage over HTTP: GET /state on one, POST /state on
another. A joiner that loaded a replica's state computes what that replica computes, and
keeps doing so through the next optimizer step (the AdamW state came along); a bad state
is refused with a JSON error and changes nothing.

In-process stage servers of the ``tiny`` model's stage 1 (of 4) on loopback, built with
different seeds so that their weights differ until a transfer.
"""

from __future__ import annotations

import asyncio
import threading

import aiohttp
import pytest
import torch

from services.coordinator.checkpointer import Checkpointer
from services.coordinator.registry import Registry
from services.stage_server.routes import RUNTIME, WORKER
from services.stage_server.state import stage_state
from services.stage_server.state_routes import OCTET_STREAM, download_state
from shared.codec import decode_tensor, encode_tensor
from shared.errors import RemoteError
from shared.http import post_message
from shared.model import PRESETS
from tests.conftest import stage_settings

STAGE, D_MODEL = 1, PRESETS["tiny"].d_model
TIMEOUT_S = 30
CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=TIMEOUT_S)


def hidden(seed: int, batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randn(batch, seq, D_MODEL, generator=torch.Generator().manual_seed(seed))


def request(mb: str, seed: int, **tensors: torch.Tensor) -> dict:
    return {
        "run_id": "test",
        "stage": STAGE,
        "microbatch_id": mb,
        "seed": seed,
        "codec": "fp32",
        **{k: encode_tensor(v, "fp32") for k, v in tensors.items()},
    }


async def train(session, url: str, seeds) -> None:
    for s in seeds:
        await post_message(
            session,
            url + "/backward",
            request(f"mb-{s}", s, inputs=hidden(s), grad_outputs=hidden(s + 1000)),
            timeout_s=TIMEOUT_S,
        )


async def forward(session, url: str, x: torch.Tensor) -> torch.Tensor:
    reply = await post_message(
        session, url + "/forward", {**request("probe", 0, inputs=x), "eval": True}, timeout_s=TIMEOUT_S
    )
    return decode_tensor(reply["outputs"])


async def get_state(session, url: str) -> bytes:
    async with session.get(url + "/state", timeout=CLIENT_TIMEOUT) as resp:
        assert resp.status == 200 and resp.content_type == OCTET_STREAM
        return await resp.read()


async def post_state(session, url: str, body: bytes, content_type: str = OCTET_STREAM):
    async with session.post(
        url + "/state", data=body, headers={"Content-Type": content_type}, timeout=CLIENT_TIMEOUT
    ) as resp:
        return resp.status, await resp.json()


def weights(app) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in app[RUNTIME].model.named_parameters()}


@pytest.fixture
async def replicas(start_stages):
    """Two replicas of stage 1 with different weights (A, B) and a server of stage 2."""
    apps, urls = await start_stages(
        [
            [stage_settings(STAGE, seed=1, global_batch=4), stage_settings(STAGE, seed=2, global_batch=4)],
            [stage_settings(2)],
        ]
    )
    return apps, urls


async def test_a_joiner_computes_what_the_replica_it_loaded_from_computes(replicas, http_session):
    (app_a, app_b), (url_a, url_b) = replicas[0][0], replicas[1][0]
    await train(http_session, url_a, [1, 2])  # 4 samples: one optimizer step on A
    assert app_a[RUNTIME].stats.optimizer_steps == 1
    probe = hidden(99)
    assert not torch.equal(await forward(http_session, url_a, probe), await forward(http_session, url_b, probe))

    status, reply = await post_state(http_session, url_b, await get_state(http_session, url_a))

    assert status == 200 and reply["stage"] == STAGE and reply["optimizer_steps"] == 1
    assert reply["weights_version"] == app_b[RUNTIME].version == 1
    assert torch.equal(await forward(http_session, url_a, probe), await forward(http_session, url_b, probe))
    for url in (url_a, url_b):  # the next optimizer step, from the same AdamW state, on both
        await train(http_session, url, [3, 4])
    assert app_b[RUNTIME].stats.optimizer_steps == 2
    assert torch.equal(await forward(http_session, url_a, probe), await forward(http_session, url_b, probe))


async def test_download_state_returns_the_replicas_state(replicas, http_session):
    (app_a, _), (url_a, _) = replicas[0][0], replicas[1][0]
    await train(http_session, url_a, [1, 2])

    tensors, meta = await download_state(http_session, url_a, timeout_s=TIMEOUT_S)

    expected, expected_meta = stage_state(app_a[RUNTIME])
    assert meta == expected_meta and tensors.keys() == expected.keys()
    assert all(torch.equal(tensors[name], expected[name]) for name in expected)
    with pytest.raises(RemoteError) as info:
        await download_state(http_session, url_a + "/no-such-path", timeout_s=TIMEOUT_S)
    assert info.value.status == 404 and info.value.code == "not_found"


@pytest.mark.parametrize(
    "case, status, code",
    [
        ("garbage", 400, "bad_payload"),
        ("truncated", 400, "bad_payload"),
        ("other_stage", 409, "wrong_stage"),
        ("msgpack", 415, "unsupported_media_type"),
    ],
)
async def test_a_bad_state_is_refused_and_changes_nothing(replicas, http_session, case, status, code):
    (_, app_b), (url_a, url_b) = replicas[0][0], replicas[1][0]
    await train(http_session, url_a, [1, 2])
    good = await get_state(http_session, url_a)
    body, content_type = {
        "garbage": (b"\x00not a safetensors file" * 10, OCTET_STREAM),
        "truncated": (good[: len(good) // 2], OCTET_STREAM),
        "other_stage": (await get_state(http_session, replicas[1][1][0]), OCTET_STREAM),
        "msgpack": (good, "application/msgpack"),
    }[case]
    before, version, probe = weights(app_b), app_b[RUNTIME].version, hidden(99)
    out_before = await forward(http_session, url_b, probe)

    got, reply = await post_state(http_session, url_b, body, content_type)

    assert (got, reply["error"]["code"]) == (status, code) and reply["error"]["message"]
    after = weights(app_b)
    assert app_b[RUNTIME].version == version and all(torch.equal(before[n], after[n]) for n in before)
    assert torch.equal(await forward(http_session, url_b, probe), out_before)  # still serving, same weights


async def test_a_state_past_max_body_mb_is_refused_with_413(start_stages, http_session):
    apps, urls = await start_stages([[stage_settings(STAGE, seed=1), stage_settings(STAGE, seed=2, max_body_mb=0.25)]])
    (_, small), (url_a, url_small) = apps[0], urls[0]
    before = weights(small)

    status, reply = await post_state(
        http_session, url_small, await get_state(http_session, url_a)
    )  # ~0.8 MB of weights

    assert status == 413 and reply["error"]["code"] == "payload_too_large"
    assert all(torch.equal(before[n], t) for n, t in weights(small).items())


class Recorder:
    """A logger that keeps its warnings."""

    def __init__(self):
        self.warnings: list[tuple[str, dict]] = []

    def warning(self, event: str, **fields) -> None:
        self.warnings.append((event, fields))


async def test_a_busy_replica_gives_its_state_once_its_queue_has_room(start_stages, http_session, tmp_path):
    """The checkpointer asks a replica whose compute queue is full: 503 overloaded with
    Retry-After. It asks again after that delay instead of skipping the checkpoint (a
    busy swarm's only replica of a stage is busy most of the time)."""
    apps, urls = await start_stages([[stage_settings(STAGE, seed=1, max_queue=1)]])
    app, url = apps[0][0], urls[0][0]
    gate = threading.Event()
    blocker = asyncio.create_task(app[WORKER].run(gate.wait, 30.0))  # the one queue slot, taken until the gate opens
    for _ in range(1000):
        if app[WORKER].queue_depth == 1:
            break
        await asyncio.sleep(0)  # let the task take its slot (no timing involved)
    assert app[WORKER].queue_depth == 1
    try:
        await _download_while_busy(app, url, blocker, gate, http_session, tmp_path)
    finally:
        gate.set()  # never leave the compute thread blocked


def checkpointer_for(http_session, tmp_path, log) -> Checkpointer:
    """A checkpointer of a 4-stage run into ``tmp_path`` (20 s a download), logging to ``log``."""
    return Checkpointer(
        Registry(":memory:", num_stages=4, heartbeat_s=60.0),
        root=str(tmp_path),
        run_id="test",
        keep=1,
        timeout_s=20.0,
        log=log,
        session=http_session,
    )


async def _download_while_busy(app, url, blocker, gate, http_session, tmp_path) -> None:
    log = Recorder()
    checkpointer = checkpointer_for(http_session, tmp_path, log)
    download = asyncio.create_task(checkpointer._download(STAGE, [url], 0))  # step 0: where the replica is
    for _ in range(2000):  # bounded: until the first refusal is logged
        if log.warnings or download.done():
            break
        await asyncio.sleep(0.005)
    assert [(e, f["replica"]) for e, f in log.warnings] == [("checkpoint.download_failed", url)]
    assert "503 overloaded" in log.warnings[0][1]["error"] and not download.done()
    gate.set()
    assert await blocker
    data = await asyncio.wait_for(download, 20.0)
    assert data == await get_state(http_session, url) and len(log.warnings) == 1


async def test_the_checkpointer_asks_the_replica_that_gave_its_state_fastest_first(replicas, http_session, tmp_path):
    """A replica that failed (here: nothing listens at its URL; in the arena: a peer behind a
    10 Mbit/s link that spends the whole timeout) is asked after the one that answered last
    time, so one slow replica does not cost every checkpoint its stage."""
    log = Recorder()
    checkpointer = checkpointer_for(http_session, tmp_path, log)
    dead, url = "http://127.0.0.1:9", replicas[1][0][0]  # the discard port: connection refused
    first = await checkpointer._download(STAGE, [dead, url], 0)
    assert [f["replica"] for _, f in log.warnings] == [dead]  # never asked before: in the order given
    assert checkpointer.rates[dead] == 0 and checkpointer.rates[url] > 0
    again = await checkpointer._download(STAGE, [dead, url], 0)
    assert again == first and len(log.warnings) == 1  # the one that answered first; the dead one not asked
