"""HTTP edge of averaging (the round itself is ``averaging.py``): decode, call the
:class:`Averager`, encode. Bodies are msgpack maps, like ``/forward``::

    POST /average/start  {round_id, stage, members, index, codec, timeout_s, aggregator?, kind?, step?,
                         error_feedback?} -> {round_id, accepted}; answered at once, the round runs
                         in the background. kind 'step' (a global step: gradients all-reduced, then
                         the same optimizer step) is refused (409) by a replica not at 'step';
                         error_feedback (default false): its members add what the codec lost last
                         step (``error_feedback.py``).
    POST /average/part   {round_id, from, part, weight, data} -> {round_id, part}
    POST /average/result {round_id, part} -> {round_id, part, data, contributors, weight}
                         waits (at most until the round's deadline) for the reduction
    GET  /average/status[?wait=ROUND_ID&wait_s=S] -> JSON {step, rounds_completed, running,
                         last_round: {round_id, members, contributors, bytes_sent, seconds, ok, ...}};
                         with ``wait``: answered once that round ended here (at most S seconds)
    GET  /digest         -> JSON {step, digest}: SHA-256 of the weights and optimizer state
    POST /average/copy   {stage, source, step, timeout_s} -> {step, digest}: a drift repair (the
                         coordinator's digest check): this replica, at 'step', takes the
                         whole state of the replica at 'source'; answered once it is loaded.
                         409 round_conflict if it is not at 'step' (the next check repairs
                         it), 502 source_unavailable if the source gave no state

Errors are JSON: 400 bad_payload (malformed), 409 wrong_stage (another stage's round) or
round_conflict (busy, unknown or finished round, not this member's part, duplicate part).
No request here touches the weights but a round's own last step and a repair's load.
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.parse

import aiohttp
import torch
from aiohttp import web

from services.stage_server.averager import Averager
from services.stage_server.averaging import (
    OFF_LOOP_VALUES,
    CopyOrder,
    PartMessage,
    RoundConflict,
    RoundSpec,
    decode_values,
    parse_part_request,
)
from services.stage_server.routes import RUNTIME, SETTINGS, WORKER
from services.stage_server.state import state_from_bytes
from shared.errors import BadPayload, RemoteError, WrongStage
from shared.http import (
    MSGPACK,
    OCTET_STREAM,
    msgpack_response,
    post_message,
    read_message,
    request_bytes,
    swarm_session,
)
from shared.log import get_logger

AVERAGER = web.AppKey("averager", Averager)

CONTROL_BYTES = 1 << 20  # /average/start and /average/result carry no tensors
REFUSAL_PROBE_S = 1.0  # the longest a member waits to learn that a failed peer refuses connections


class HttpTransport:
    """The :class:`~services.stage_server.averaging.Transport` of a running server."""

    def __init__(self, session: aiohttp.ClientSession):
        self.session = session

    async def post(self, url: str, body: bytes, *, timeout_s: float) -> dict:
        return await post_message(self.session, url, {}, timeout_s=timeout_s, body=body)

    async def refuses(self, url: str) -> bool:
        parts = urllib.parse.urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:  # a plain TCP connection, not the session's: its idle ones to a killed peer break the same way
            _, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, port), REFUSAL_PROBE_S)
        except ConnectionRefusedError:
            return True
        except (OSError, asyncio.TimeoutError):
            return False
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return False

    async def get_state(self, url: str, *, timeout_s: float) -> tuple[dict[str, torch.Tensor], dict]:
        target = url.rstrip("/") + "/state"
        payload = await request_bytes(self.session, "GET", target, expect=OCTET_STREAM, timeout_s=timeout_s)
        try:
            return await asyncio.to_thread(state_from_bytes, payload)
        except BadPayload as exc:
            raise RemoteError(target, 200, "bad_reply", exc.message) from None


async def start(request: web.Request) -> web.Response:
    msg, averager = await read_message(request, CONTROL_BYTES), request.app[AVERAGER]
    try:
        spec = RoundSpec.from_message(msg, stage=request.app[SETTINGS].stage)
    except WrongStage:
        averager.refuse(msg["round_id"])  # so that peers find out at once that we are not in it
        raise
    try:
        averager.start(spec)
    except RoundConflict:
        if not averager.running:  # e.g. a step round for another step: peers find out at once
            averager.refuse(spec.round_id)
        raise
    return msgpack_response({"round_id": spec.round_id, "accepted": True})


async def part(request: web.Request) -> web.Response:
    averager, settings = request.app[AVERAGER], request.app[SETTINGS]
    msg = await read_message(request, int(settings.max_body_mb * 2**20))
    header = PartMessage.from_message(msg)
    nbytes = request.content_length or 0
    if nbytes >= 4 * OFF_LOOP_VALUES:
        values = await asyncio.to_thread(decode_values, msg.get("data"), averager.num_params)
    else:
        values = decode_values(msg.get("data"), averager.num_params)
    averager.accept_part(header, values)
    return msgpack_response({"round_id": header.round_id, "part": header.part})


async def result(request: web.Request) -> web.Response:
    round_id, part_index = parse_part_request(await read_message(request, CONTROL_BYTES))
    reduced = await request.app[AVERAGER].result(round_id, part_index)
    return web.Response(body=reduced.body, content_type=MSGPACK)


async def copy(request: web.Request) -> web.Response:
    order = CopyOrder.from_message(await read_message(request, CONTROL_BYTES), stage=request.app[SETTINGS].stage)
    averager = request.app[AVERAGER]
    step, value = await averager.copy_state(order, averager.log.bind(source=order.source))
    return msgpack_response({"step": step, "digest": value})


async def status(request: web.Request) -> web.Response:
    """``?wait=ROUND_ID``: answered once that round ended here (at most ``wait_s``, default 10 s)."""
    averager, wait = request.app[AVERAGER], request.query.get("wait")
    if wait:
        try:
            wait_s = min(max(float(request.query.get("wait_s", "10")), 0.0), 60.0)
        except ValueError:
            raise BadPayload("'wait_s' must be a number of seconds") from None
        await averager.wait_round(wait, wait_s)
    return web.json_response(averager.status())


async def digest(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    step, value = await request.app[WORKER].run(lambda: (runtime.step, runtime.digest()))
    reply = {"step": step, "digest": value}
    if runtime.outer is not None:  # local mode: replicas in the middle of an outer step are between steps too
        reply["outer_steps"] = runtime.outer.steps
    return web.json_response(reply)


def add_averaging_routes(app: web.Application) -> None:
    """Routes and lifecycle of averaging; call after ``RUNTIME``, ``WORKER`` and ``SETTINGS`` are set."""
    settings = app[SETTINGS]
    log = get_logger(service="stage_server", run=settings.run_id, stage=settings.stage)
    byzantine = (settings.inject.byzantine, settings.inject.byzantine_factor) if settings.inject.byzantine else None
    averager = Averager(app[RUNTIME], app[WORKER].run, int8_block=settings.int8_block, log=log, byzantine=byzantine)
    app[AVERAGER] = averager
    app.router.add_post("/average/start", start)
    app.router.add_post("/average/part", part)
    app.router.add_post("/average/result", result)
    app.router.add_post("/average/copy", copy)
    app.router.add_get("/average/status", status)
    app.router.add_get("/digest", digest)

    async def client_session(app: web.Application):
        async with swarm_session(settings) as session:
            averager.transport = HttpTransport(session)
            yield
            await averager.close()

    app.cleanup_ctx.append(client_session)


async def finish_rounds(app: web.Application) -> None:
    """Before this server leaves: a step round under way here ends first (its peers wait for
    this member's parts and fetch its reduction from it, so it must still listen: ``app.leave``),
    at most until the round's deadline; then the averager takes no round more, and its peers
    leave this member out of any other."""
    averager = app[AVERAGER]
    if averager.running and averager.round.spec.kind == "step":
        rnd = averager.round
        await averager.wait_round(rnd.spec.round_id, max(0.0, rnd.deadline - asyncio.get_running_loop().time()))
    await averager.close()
