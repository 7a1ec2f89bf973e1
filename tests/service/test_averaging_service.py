"""Averaging rounds among replicas of one stage, through real stage servers on loopback.

Replicas differ in their weights (``seed=``) and in the samples they processed since the
last round, which the tests set directly (``app[RUNTIME].stats.samples``) rather than by
training: the round's weight is that counter, and a backward would also move the weights
the test wants to average. The round is started by the coordinator's ``start_round``;
completion is polled on ``GET /average/status`` under a bounded deadline.

Faults: a member that dies right after accepting the round (before sending anything), a
member whose ``/average/result`` fails (a real server behind a fault-injecting middleware),
a real server closed right after the start, and a member of another stage that refuses.

Step rounds: a member whose part came back from a backup short of the round does not step.
The coordinator's digest check repairs drifted replicas by copying a whole state.
"""

from __future__ import annotations

import asyncio
import math
import socket
from dataclasses import dataclass

import aiohttp
import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestServer

from services.coordinator.steps import start_round
from services.stage_server.allreduce import AVERAGER, DEADLINES, split_bounds
from services.stage_server.app import create_app
from services.stage_server.routes import RUNTIME, WORKER
from services.stage_server.runtime import Accumulated, flat_parameters
from shared.codec import decode_tensor, encode_tensor, pack_message, unpack_message
from tests.conftest import coordinator_settings, stage_settings

STAGE = 1
MSGPACK = "application/msgpack"


@pytest.fixture
async def serve():
    """``await serve(app)`` -> (TestServer, URL); every server is closed at the end."""
    servers: list[TestServer] = []

    async def _serve(app: web.Application):
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        return server, str(server.make_url("")).rstrip("/")

    yield _serve
    for server in servers:
        await server.close()


async def replicas(serve, seeds, samples, **overrides):
    """Stage servers of STAGE with these seeds and sample counts -> (apps, servers, urls)."""
    apps, servers, urls = [], [], []
    for seed, n in zip(seeds, samples):
        app = create_app(stage_settings(STAGE, seed=seed, **overrides))
        app[RUNTIME].stats.samples = n
        server, url = await serve(app)
        apps.append(app), servers.append(server), urls.append(url)
    return apps, servers, urls


async def params_of(app) -> torch.Tensor:
    return await app[WORKER].run(flat_parameters, app[RUNTIME].params)


async def _count(total: list[int], chunk: bytes) -> None:
    total.append(len(chunk))


def weighted_mean(vectors, weights) -> torch.Tensor:
    acc = sum(v.double() * w for v, w in zip(vectors, weights))
    return (acc / sum(weights)).float()


async def status_of(session, url) -> dict:
    async with session.get(url + "/average/status") as resp:
        assert resp.status == 200
        return await resp.json()


async def wait_for_round(session, urls, round_id, within_s) -> list[dict]:
    """Poll each member's status until its last round is ``round_id``; fail past ``within_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        statuses = [await status_of(session, url) for url in urls]
        if all((s["last_round"] or {}).get("round_id") == round_id for s in statuses):
            return [s["last_round"] for s in statuses]
        assert loop.time() < deadline, f"round {round_id} not done within {within_s} s: {statuses}"
        await asyncio.sleep(0.02)


async def post_raw(session, url, msg=None, *, body=None, content_type=MSGPACK):
    async with session.post(
        url, data=pack_message(msg) if body is None else body, headers={"Content-Type": content_type}
    ) as resp:
        return resp.status, resp.content_type, await resp.read()


# --------------------------------------------------------------------------- healthy rounds
async def test_fp32_round_gives_every_member_the_sample_weighted_mean(serve, http_session):
    samples = [10, 30, 60]
    apps, _, urls = await replicas(serve, [1, 2, 3], samples)
    before = [await params_of(app) for app in apps]
    assert not torch.equal(before[0], before[1])
    expected = weighted_mean(before, samples)

    # the coordinator's side of the round, measured: every byte it sends and receives
    coordinator_bytes = []
    trace = aiohttp.TraceConfig()
    trace.on_request_chunk_sent.append(lambda _s, _c, params: _count(coordinator_bytes, params.chunk))
    trace.on_response_chunk_received.append(lambda _s, _c, params: _count(coordinator_bytes, params.chunk))
    async with aiohttp.ClientSession(trace_configs=[trace]) as coordinator_session:
        round_id = await start_round(coordinator_session, STAGE, urls, codec="fp32", timeout_s=10.0)
    summaries = await wait_for_round(http_session, urls, round_id, within_s=10.0)

    P, k = before[0].numel(), len(urls)
    assert 0 < sum(coordinator_bytes) < 4096, "the coordinator sends control messages only, never tensors"
    bound = 1.1 * 2 * P * (k - 1) / k * 4
    for app, summary in zip(apps, summaries):
        assert (await params_of(app) - expected).abs().max().item() <= 1e-6
        assert app[RUNTIME].version == 1 and not app[RUNTIME]._cache
        assert summary["ok"] and summary["contributors"] == [0, 1, 2] and summary["parts_failed"] == []
        assert summary["members"] == urls and summary["seconds"] < 10.0
        assert summary["bytes_sent"] <= bound, (summary["bytes_sent"], bound)
    print(
        f"\nfp32 round, P={P}, k={k}: bytes_sent per member {[s['bytes_sent'] for s in summaries]}, bound {bound:.0f}"
    )
    assert all(s["rounds_completed"] == 1 for s in [await status_of(http_session, u) for u in urls])

    # The next round with no new samples: equal (epsilon) weights of equal vectors changes nothing.
    round_id = await start_round(http_session, STAGE, urls, codec="fp32", timeout_s=10.0)
    await wait_for_round(http_session, urls, round_id, within_s=10.0)
    for app in apps:
        assert (await params_of(app) - expected).abs().max().item() <= 1e-6


async def test_int8_round_leaves_members_identical_and_close_to_the_mean(serve, http_session):
    samples = [5, 20, 15]
    apps, _, urls = await replicas(serve, [4, 5, 6], samples, wire_codec="int8")  # int8: bitsandbytes loads at start
    before = [await params_of(app) for app in apps]
    expected = weighted_mean(before, samples)

    round_id = await start_round(http_session, STAGE, urls, codec="int8", timeout_s=10.0)
    summaries = await wait_for_round(http_session, urls, round_id, within_s=10.0)

    after = [await params_of(app) for app in apps]
    assert torch.equal(after[0], after[1]) and torch.equal(after[0], after[2])
    rel_error = ((after[0] - expected).norm() / expected.norm()).item()
    assert rel_error < 0.02, rel_error
    P = before[0].numel()
    assert all(s["ok"] and s["bytes_sent"] <= 1.1 * 2 * P * 2 / 3 * 1.01 for s in summaries)  # ~1 byte a value
    print(
        f"\nint8 round, P={P}: relative error {rel_error:.4f}, bytes_sent per member "
        f"{[s['bytes_sent'] for s in summaries]}"
    )


async def test_a_round_split_by_shares_gives_the_same_mean(serve, http_session):
    """Parts in proportion to ``shares`` (the coordinator sends them where a member holds no
    sample of the step, see ``averaging.round_shares``): the first member reduces a fifth of
    the vector, and every member still loads the same sample-weighted mean."""
    samples = [8, 24]
    apps, _, urls = await replicas(serve, [7, 8], samples)
    before = [await params_of(app) for app in apps]
    expected = weighted_mean(before, samples)
    round_id = await start_round(http_session, STAGE, urls, codec="fp32", timeout_s=10.0, shares=[0.2, 0.8])
    summaries = await wait_for_round(http_session, urls, round_id, within_s=10.0)
    after = [await params_of(app) for app in apps]
    assert torch.equal(after[0], after[1]) and (after[0] - expected).abs().max().item() <= 1e-6
    P = before[0].numel()
    assert all(s["ok"] and s["parts_failed"] == [] for s in summaries)
    fifth = round(P / 5)
    assert [app[AVERAGER].last_round.bounds for app in apps] == [
        [(0, fifth), (fifth, P)]
    ] * 2  # the first reduced a fifth
    # in a round of two a member's link carries as much either way: four fifths of its vector and its fifth back
    assert all(abs(s["bytes_sent"] - 4 * P) / (4 * P) < 0.05 for s in summaries), summaries
    status, _, body = await post_raw(
        http_session,
        urls[0] + "/average/start",
        {
            "round_id": "bad",
            "stage": STAGE,
            "members": urls,
            "index": 0,
            "codec": "fp32",
            "timeout_s": 5,
            "shares": [1],
        },
    )
    assert status == 400 and b"shares" in body


# --------------------------------------------------------------------------- failures
def fake_member() -> web.Application:
    """A member that accepts the round and then sends nothing itself."""

    async def accept(request: web.Request) -> web.Response:
        return web.Response(body=pack_message({"accepted": True}), content_type=MSGPACK)

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_post("/average/start", accept)
    return app


@web.middleware
async def failing_results(request: web.Request, handler):
    """Fault injection: a reducer that takes parts but never serves its reduction."""
    if request.path == "/average/result":
        return web.json_response({"error": {"code": "internal", "message": "injected fault"}}, status=500)
    return await handler(request)


async def test_member_dead_before_sending_is_left_out(serve, http_session):
    samples = [10, 0, 40]
    apps, _, urls = await replicas(serve, [1, 3], [samples[0], samples[2]])
    dead_server, dead_url = await serve(fake_member())
    members = [urls[0], dead_url, urls[1]]  # the dead member reduces part 1; its backup is member 2
    before = [await params_of(app) for app in apps]
    expected = weighted_mean(before, [samples[0], samples[2]])
    timeout_s = 3.0

    started = asyncio.get_running_loop().time()
    round_id = await start_round(http_session, STAGE, members, codec="fp32", timeout_s=timeout_s)
    await dead_server.close()
    summaries = await wait_for_round(http_session, urls, round_id, within_s=timeout_s)

    assert asyncio.get_running_loop().time() - started < timeout_s
    for app, summary in zip(apps, summaries):
        assert (await params_of(app) - expected).abs().max().item() <= 1e-6
        assert summary["ok"] and summary["contributors"] == [0, 2], summary


def member_that_leaves_once_it_accepted(its: dict) -> web.Application:
    """A member that accepts the round and stops listening before it answers (``its["server"]``:
    its TestServer): every connection to it after that is refused, as to a process that exited."""

    async def accept(request: web.Request) -> web.Response:
        for site in list(its["server"].runner.sites):
            await site.stop()
        return web.Response(body=pack_message({"accepted": True}), content_type=MSGPACK)

    app = web.Application()
    app.router.add_post("/average/start", accept)
    return app


def member_killed_once_it_accepted(its: dict) -> web.Application:
    """A member that accepts the round and, at the first part it is sent, dies as a killed
    process does: the connection it had open breaks (not refused) and nothing listens after."""

    async def accept(request: web.Request) -> web.Response:
        return web.Response(body=pack_message({"accepted": True}), content_type=MSGPACK)

    async def part(request: web.Request) -> web.Response:
        for site in list(its["server"].runner.sites):
            await site.stop()
        request.transport.abort()
        raise asyncio.CancelledError  # the handler dies with its connection

    app = web.Application()
    app.router.add_post("/average/start", accept)
    app.router.add_post("/average/part", part)
    return app


@pytest.mark.parametrize(
    "gone_member",
    [member_that_leaves_once_it_accepted, member_killed_once_it_accepted],
    ids=["refuses connections", "killed mid-round"],
)
async def test_a_member_whose_process_is_gone_is_not_waited_for(serve, http_session, gone_member):
    """A refused connection says the member's process is gone. A connection it broke (killed
    mid-round) is no refusal, but a new connection to it is: the joins bench found a step round
    waiting 8 s for a replica killed as it started. No reducer waits for it until the reduce time."""
    samples = [10, 0, 40]
    apps, _, urls = await replicas(serve, [1, 3], [samples[0], samples[2]])
    gone: dict = {}
    gone["server"], gone_url = await serve(gone_member(gone))
    members = [urls[0], gone_url, urls[1]]  # it reduces part 1; its backup is member 2
    expected = weighted_mean([await params_of(app) for app in apps], [samples[0], samples[2]])
    timeout_s = 30.0  # its parts' reduce time: DEADLINES.reduce_at x 30 = 12 s after the start

    round_id = await start_round(http_session, STAGE, members, codec="fp32", timeout_s=timeout_s)
    summaries = await wait_for_round(http_session, urls, round_id, within_s=DEADLINES.reduce_at * timeout_s)

    for app, summary in zip(apps, summaries):
        assert (await params_of(app) - expected).abs().max().item() <= 1e-6
        assert summary["ok"] and summary["contributors"] == [0, 2], summary
        assert summary["seconds"] < DEADLINES.reduce_at * timeout_s / 4, summary


async def test_dead_reducer_is_replaced_by_a_backup(serve, http_session):
    samples = [10, 20, 30]
    apps, _, urls = await replicas(serve, [1, 2], samples[:2])
    faulty = create_app(stage_settings(STAGE, seed=3))
    faulty[RUNTIME].stats.samples = samples[2]
    faulty.middlewares.append(failing_results)
    _, faulty_url = await serve(faulty)
    members = [*urls, faulty_url]
    before = [await params_of(app) for app in [*apps, faulty]]
    all_three, survivors = weighted_mean(before, samples), weighted_mean(before[:2], samples[:2])
    timeout_s = 3.0

    started = asyncio.get_running_loop().time()
    round_id = await start_round(http_session, STAGE, members, codec="fp32", timeout_s=timeout_s)
    summaries = await wait_for_round(http_session, urls, round_id, within_s=timeout_s)

    assert asyncio.get_running_loop().time() - started < timeout_s
    bounds = split_bounds(before[0].numel(), 3)
    expected = torch.cat([all_three[slice(*bounds[0])], all_three[slice(*bounds[1])], survivors[slice(*bounds[2])]])
    for app, summary in zip(apps, summaries):
        assert (await params_of(app) - expected).abs().max().item() <= 1e-6
        assert summary["ok"] and summary["part_contributors"] == [[0, 1, 2], [0, 1, 2], [0, 1]], summary


async def test_server_closed_right_after_the_start(serve, http_session):
    samples = [10, 20, 30]
    apps, servers, urls = await replicas(serve, [1, 2, 3], samples)
    before = [await params_of(app) for app in apps]
    all_three, survivors = weighted_mean(before, samples), weighted_mean(before[:2], samples[:2])
    timeout_s = 3.0

    started = asyncio.get_running_loop().time()
    round_id = await start_round(http_session, STAGE, urls, codec="fp32", timeout_s=timeout_s)
    await servers[2].close()
    summaries = await wait_for_round(http_session, urls[:2], round_id, within_s=timeout_s)

    assert asyncio.get_running_loop().time() - started < timeout_s
    # Member 2 may or may not have sent some parts before it died: each part of a survivor is
    # the mean of all three or of the two survivors, whichever reducer's view it got.
    for app, summary in zip(apps[:2], summaries):
        after = await params_of(app)
        for start, stop in split_bounds(after.numel(), 3):
            part = after[start:stop]
            assert min((part - m[start:stop]).abs().max().item() for m in (all_three, survivors)) <= 1e-6
        assert summary["ok"], summary


async def test_member_of_another_stage_refuses_and_is_left_out(serve, http_session):
    samples = [7, 21]
    apps, _, urls = await replicas(serve, [1, 2], samples)
    _, other_url = await serve(create_app(stage_settings(STAGE + 1, seed=9)))
    expected = weighted_mean([await params_of(app) for app in apps], samples)

    round_id = await start_round(http_session, STAGE, [*urls, other_url], codec="fp32", timeout_s=3.0)
    summaries = await wait_for_round(http_session, urls, round_id, within_s=3.0)
    for app, summary in zip(apps, summaries):
        assert (await params_of(app) - expected).abs().max().item() <= 1e-6
        assert summary["contributors"] == [0, 1]
    assert (await status_of(http_session, other_url))["last_round"] is None


# --------------------------------------------------------------------------- step rounds and repairs
def hold_gradient(app, samples: int, seed: int, step: int = 0) -> torch.Tensor:
    """Put a gradient of ``samples`` samples into the replica's bucket of ``step``; returns it."""
    runtime = app[RUNTIME]
    gradient = torch.randn(sum(p.numel() for p in runtime.params), generator=torch.Generator().manual_seed(seed))
    runtime.give_back(Accumulated(gradient, samples, frozenset({f"mb-{seed}"})), step)
    return gradient


async def digest_of(session, url) -> dict:
    async with session.get(url + "/digest") as resp:
        assert resp.status == 200
        return await resp.json()


async def test_a_member_with_no_sample_sends_no_values_and_steps_with_the_others(serve, http_session):
    """A step round's member that served no sample of the step (weight 0: a weak replica the
    wiring gave no microbatch) sends its weight without values: under the mean they change
    nothing. Both members apply the other's gradient, as one replica alone would."""
    apps, urls = [], []
    for samples in (4, 0):
        app = create_app(stage_settings(STAGE, seed=1))
        if samples:
            gradient = hold_gradient(app, samples=samples, seed=10)
        _, url = await serve(app)
        apps.append(app), urls.append(url)
    alone = create_app(stage_settings(STAGE, seed=1))[RUNTIME]  # the same step on one replica, no round
    alone.apply_step(Accumulated(gradient, 4, frozenset({"mb-10"})))

    round_id = await start_round(http_session, STAGE, urls, codec="fp32", timeout_s=10.0, kind="step", step=0)
    summaries = await wait_for_round(http_session, urls, round_id, within_s=10.0)
    assert [s["verdict"] for s in summaries] == ["apply", "apply"]
    assert [app[RUNTIME].step for app in apps] == [1, 1]
    assert all(app[RUNTIME].digest() == alone.digest() for app in apps)
    P = sum(p.numel() for p in alone.params)
    # the sampleless member sent only its reduced half (fp32) and a few bytes; the other its half and its reduced half
    sent = [s["bytes_sent"] for s in summaries]
    assert sent[1] < 0.55 * 4 * P < 0.95 * 4 * P < sent[0], (sent, P)


async def test_a_member_whose_part_came_from_a_backup_short_of_the_round_does_not_step(serve, http_session):
    """Hole 3: member 0's fetch of part 1 from member 1 fails after member 1 took member 0's
    parts. Member 1 steps with the true mean; member 0's backup of part 1 (itself) holds its own
    gradient only: stepping on it would leave the pair apart for good. It gives its gradient back."""
    apps, _, urls = [], [], []
    for i, faulty in enumerate((False, True)):
        app = create_app(stage_settings(STAGE, seed=1))
        hold_gradient(app, samples=4 + 2 * i, seed=10 + i)
        if faulty:
            app.middlewares.append(failing_results)
        _, url = await serve(app)
        apps.append(app), urls.append(url)

    round_id = await start_round(http_session, STAGE, urls, codec="fp32", timeout_s=3.0, kind="step", step=0)
    summaries = await wait_for_round(http_session, urls, round_id, within_s=3.0)

    reached, short = apps[1][RUNTIME], apps[0][RUNTIME]
    assert reached.step == 1 and reached.stats.last_effective_batch == 10 and summaries[1]["ok"], summaries[1]
    assert summaries[0]["part_contributors"] == [[0, 1], [0]], summaries[0]
    assert short.step == 0 and short.pending(0) == 4 and short.stats.samples_dropped == 0
    assert summaries[0]["verdict"] == "short_backup" and not summaries[0]["ok"]


@dataclass(frozen=True)
class Replica:
    stage: int
    url: str


async def test_the_digest_check_repairs_drift_by_copying_a_whole_state(serve, http_session):
    """Hole 3: two replicas at one step whose weights AND AdamW states differ. Averaging the
    weights would leave the optimizer states apart, drifted at every check forever; the repair
    copies the source's whole state, and the next check finds them identical. The target keeps
    the gradient it accumulated for its next step."""
    from services.coordinator.averaging import AveragingScheduler
    from shared.log import get_logger

    apps, _, urls = await replicas(serve, [1, 1], [0, 0])
    for i, app in enumerate(apps):
        app[RUNTIME].apply_step(Accumulated(hold_gradient(app, 4, seed=20 + i), 4, frozenset()))
        app[RUNTIME].reset_accumulation()
    source, target = sorted(urls)
    by_url = dict(zip(urls, apps))
    hold_gradient(by_url[target], 3, seed=30, step=1)  # the target's backward of the step to come
    before = {url: await digest_of(http_session, url) for url in urls}
    assert before[urls[0]]["step"] == before[urls[1]]["step"] == 1
    assert before[urls[0]]["digest"] != before[urls[1]]["digest"]

    scheduler = AveragingScheduler(
        lambda: [Replica(STAGE, u) for u in urls], every_s=0, codec="fp32", timeout_s=10.0, log=get_logger()
    )
    scheduler.session = http_session
    (repair,) = await scheduler.average_once()

    assert scheduler.checks[0]["verdict"] == "drifted"
    after = {url: await digest_of(http_session, url) for url in urls}
    assert after[target] == after[source] == before[source]
    assert torch.equal(await params_of(by_url[target]), await params_of(by_url[source]))
    assert by_url[target][RUNTIME].pending(1) == 3 and by_url[target][RUNTIME].step == 1
    assert repair.as_json() == {
        "stage": STAGE,
        "step": 1,
        "source": source,
        "targets": [target],
        "repaired": [target],
        "ended": 1,
    }
    assert await scheduler.average_once() == [] and scheduler.checks[0]["verdict"] == "identical"


# --------------------------------------------------------------------------- bad input
SILENT_ROUND_S = 10.0  # the timeout of a round with a silent member: it ends after ~4 s


def start_msg(url, **overrides):
    return {
        "round_id": "r1",
        "stage": STAGE,
        "members": [url, "http://127.0.0.1:9"],
        "index": 0,
        "codec": "fp32",
        "timeout_s": 2.0,
        **overrides,
    }


def part_msg(values, **overrides):
    return {"round_id": "r1", "from": 1, "part": 0, "weight": 3.0, "data": encode_tensor(values, "fp32"), **overrides}


async def expect_error(session, url, msg, status, *, body=None, content_type=MSGPACK):
    got, ctype, payload = await post_raw(session, url, msg, body=body, content_type=content_type)
    assert got == status, (msg if body is None else body[:50], got, payload[:300])
    assert ctype == "application/json" and b'"error"' in payload


async def test_bad_requests_are_refused_and_leave_the_weights_alone(serve, http_session):
    (app,), _, (url,) = await replicas(serve, [1], [12])
    before = await params_of(app)
    P = before.numel()
    start, part, result = url + "/average/start", url + "/average/part", url + "/average/result"

    for bad in [
        {"round_id": "r1"},
        start_msg(url, round_id="has/slash"),
        start_msg(url, index=2),
        start_msg(url, members=[]),
        start_msg(url, members=[url, url]),
        start_msg(url, members=[url, "ftp://x"]),
        start_msg(url, codec="zip"),
        start_msg(url, timeout_s=0),
        start_msg(url, timeout_s=math.inf),
        start_msg(url, stage="1"),
    ]:
        await expect_error(http_session, start, bad, 400)
    await expect_error(http_session, start, start_msg(url, stage=STAGE + 1), 409)
    await expect_error(http_session, start, None, 400, body=b"\x93not a map")
    await expect_error(http_session, start, None, 415, body=b"{}", content_type="application/json")

    half = torch.zeros(P // 2)
    for bad in [
        part_msg(half, weight=-1.0),
        part_msg(half, weight=math.nan),
        part_msg(half, weight="3"),
        part_msg(half, **{"from": -1}),
        part_msg(half, part=None),
        part_msg(half, data={"codec": "fp32", "dtype": "float32", "shape": [3], "data": b"\x00"}),
        part_msg(half, data=encode_tensor(torch.zeros(2, 2), "fp32")),
        part_msg(half, data=encode_tensor(torch.zeros(P + 1), "fp32")),
        part_msg(half, data=encode_tensor(torch.tensor([1.0, math.inf]), "fp32")),
    ]:
        await expect_error(http_session, part, bad, 400)
    await expect_error(
        http_session, part, part_msg(half, round_id="r0/retry-1", part=1), 409
    )  # retry of an unknown round
    await expect_error(http_session, result, {"round_id": "r0"}, 400)
    await expect_error(http_session, result, {"round_id": "r0", "part": 0}, 409)
    assert app[RUNTIME].version == 0 and torch.equal(await params_of(app), before)

    # A round with a member that never answers (it listens, so its connections are not refused,
    # and never reads a request): the round runs for ~0.4 * timeout_s, and the bad parts below
    # must all arrive before that (with 2 s, a fresh clone's CI on busy cores answered one
    # refusal in 0.98 s, and the round had reduced part 0 alone before the last of them).
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        status, _, _ = await post_raw(
            http_session,
            start,
            start_msg(url, members=[url, f"http://127.0.0.1:{silent.getsockname()[1]}"], timeout_s=SILENT_ROUND_S),
        )
        assert status == 200
        await expect_error(http_session, start, start_msg(url, round_id="r2"), 409)  # one round at a time
        size0 = split_bounds(P, 2)[0][1]
        await expect_error(http_session, part, part_msg(torch.zeros(size0 - 1)), 400)  # wrong size
        await expect_error(http_session, part, part_msg(torch.zeros(size0), **{"from": 0}), 400)  # from itself
        await expect_error(http_session, part, part_msg(torch.zeros(size0), **{"from": 5}), 400)  # not a member
        await expect_error(http_session, part, part_msg(torch.zeros(P - size0), part=1), 409)  # not its part
        await expect_error(http_session, part, part_msg(torch.zeros(size0), round_id="r2"), 409)  # busy with r1
        await expect_error(http_session, result, {"round_id": "r1", "part": 1}, 409)  # not its part
        (summary,) = await wait_for_round(http_session, [url], "r1", within_s=SILENT_ROUND_S)

    # Nothing bad reached the average: the lone member's weights are its own.
    assert summary["contributors"] == [0] and summary["ok"]
    assert torch.equal(await params_of(app), before)


async def test_bad_copy_orders_are_refused_and_leave_the_state_alone(serve, http_session):
    (app,), _, (url,) = await replicas(serve, [1], [12])
    digest = (await digest_of(http_session, url))["digest"]
    copy = url + "/average/copy"
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        nowhere = f"http://127.0.0.1:{closed.getsockname()[1]}"
    order = {"stage": STAGE, "source": nowhere, "step": 0, "timeout_s": 2.0}

    for bad in [
        {},
        {**order, "source": "ftp://x"},
        {**order, "source": 7},
        {**order, "step": -1},
        {**order, "step": "0"},
        {**order, "timeout_s": 0},
        {**order, "timeout_s": math.nan},
        {**order, "stage": "1"},
    ]:
        await expect_error(http_session, copy, bad, 400)
    await expect_error(http_session, copy, None, 415, body=b"{}", content_type="application/json")
    await expect_error(http_session, copy, {**order, "stage": STAGE + 1}, 409)  # another stage's repair
    await expect_error(http_session, copy, {**order, "step": 1}, 409)  # this replica is at step 0
    await expect_error(http_session, copy, order, 502)  # the source gives no state
    _, _, (other,) = await replicas(serve, [2], [0], num_stages=2)  # stage 1 of a 2-stage cut: other layers
    await expect_error(http_session, copy, {**order, "source": other}, 409)
    assert (await digest_of(http_session, url))["digest"] == digest and app[RUNTIME].version == 0


async def test_part_and_fetch_that_come_before_the_start_are_kept(serve, http_session):
    """A member may hear from a peer before its own /average/start: the part waits for the
    round, and so does the peer's fetch of the reduction. The test plays member 1."""
    (app,), _, (url,) = await replicas(serve, [1], [30])
    _, gone_url = await serve(fake_member())  # member 1's URL: the test speaks for it
    before = await params_of(app)
    P = before.numel()
    (start0, stop0), _ = split_bounds(P, 2)
    ours = torch.linspace(-1, 1, stop0 - start0)
    status, _, _ = await post_raw(http_session, url + "/average/part", part_msg(ours, weight=10.0))
    assert status == 200
    fetch = asyncio.ensure_future(post_raw(http_session, url + "/average/result", {"round_id": "r1", "part": 0}))
    status, _, _ = await post_raw(http_session, url + "/average/start", start_msg(url, members=[url, gone_url]))
    assert status == 200

    status, _, body = await fetch
    assert status == 200
    reply = unpack_message(body)
    expected0 = weighted_mean([before[start0:stop0], ours], [30, 10])
    assert reply["contributors"] == [0, 1] and reply["weight"] == 40.0
    assert (decode_tensor(reply["data"]) - expected0).abs().max().item() <= 1e-6
    (summary,) = await wait_for_round(http_session, [url], "r1", within_s=2.0)
    after = await params_of(app)
    assert (after[start0:stop0] - expected0).abs().max().item() <= 1e-6 and torch.equal(after[stop0:], before[stop0:])
    assert summary["part_contributors"] == [[0, 1], [0]]  # member 1 never sent its part 1 to its backup (us)


async def register(session, coordinator: str, replicas: list[tuple[str, int]]) -> None:
    for i, (url, stage) in enumerate(replicas):
        body = {
            "run_id": "test",
            "server_id": f"r{i}",
            "stage": stage,
            "url": url,
            "version": "t",
            "throughput": 1.0,
            "queue_length": 0,
        }
        async with session.post(coordinator + "/register", json=body) as resp:
            assert resp.status == 200


async def test_the_coordinator_repairs_drift_by_itself_and_its_metrics_show_it_moves_no_tensor(serve, http_session):
    """The coordinator's own check loop finds registered replicas that differ and repairs them:
    its /health traffic shows control messages only, far less than the one state a repair moves
    between replicas."""
    from services.coordinator.app import create_app as create_coordinator

    _, _, urls = await replicas(serve, [1, 2, 3], [10, 20, 30])
    _, coordinator = await serve(
        create_coordinator(coordinator_settings(average_every_s=0.2, averaging_timeout_s=10.0))
    )
    await register(http_session, coordinator, [(url, STAGE) for url in urls])

    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20.0
    while len({(await digest_of(http_session, u))["digest"] for u in urls}) > 1:
        assert loop.time() < deadline, "the replicas were not repaired within 20 s"
        await asyncio.sleep(0.05)
    async with http_session.get(coordinator + "/health") as resp:
        traffic = (await resp.json())["traffic"]["averaging"]
    async with http_session.get(min(urls) + "/state") as resp:
        state_bytes = len(await resp.read())
    assert 0 < traffic["sent"] + traffic["received"] < state_bytes / 10, (traffic, state_bytes)


async def test_post_average_runs_a_pass_now_and_answers_when_it_ended(serve, http_session):
    """``POST /average`` (what a trainer asks before its final evaluation): with periodic
    checks off, the coordinator checks each stage with 2+ replicas now and answers once the
    drifted ones were repaired: they then hold the source's whole state."""
    from services.coordinator.app import create_app as create_coordinator

    apps, _, urls = await replicas(serve, [7, 8], [10, 30])
    _, _, (lone,) = await replicas(serve, [9], [5])  # a second stage would be skipped: one replica
    source, target = sorted(urls)
    by_url = dict(zip(urls, apps))
    expected = await params_of(by_url[source])
    _, coordinator = await serve(create_coordinator(coordinator_settings(average_every_s=0, averaging_timeout_s=10.0)))
    await register(http_session, coordinator, [(urls[0], STAGE), (urls[1], STAGE), (lone, STAGE + 1)])
    assert by_url[target][RUNTIME].version == 0, "average_every_s=0 runs no check by itself"

    async with http_session.post(coordinator + "/average", json={}, timeout=aiohttp.ClientTimeout(total=30)) as resp:
        assert resp.status == 200
        answer = await resp.json()
    (check,) = answer["checks"]
    (repair,) = answer["rounds"]
    assert check["stage"] == STAGE and check["verdict"] == "drifted"
    assert repair == {
        "stage": STAGE,
        "step": 0,
        "source": source,
        "targets": [target],
        "repaired": [target],
        "ended": 1,
    }
    for app in apps:  # answered after the repair ended: no polling needed here
        assert torch.equal(await params_of(app), expected)
    assert len({(await digest_of(http_session, u))["digest"] for u in urls}) == 1
