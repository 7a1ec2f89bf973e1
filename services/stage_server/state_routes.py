"""State transfer endpoints of the stage server, and the client side of a join.

    GET  /state[?step=N] -> application/octet-stream: the stage's weights and optimizer state
                    (safetensors, see ``shared.checkpoint``), always at a step boundary;
                    with ``step``: once the stage has taken global step N (waiting at most
                    ``wait_s`` or SWARM_JOIN_TIMEOUT_S, then as it is), so that every stage
                    of a checkpoint is at the same step
    POST /state  <- the same bytes (Content-Type application/octet-stream, at most
                    SWARM_MAX_BODY_MB): load them -> {stage, weights_version, optimizer_steps}

Both run their tensor work on the compute worker, so a snapshot or a load never races a
backward or an optimizer step. A state of another stage or model is refused with 409, a
malformed one with 400, another content type with 415, an oversize body with 413; a
refused state leaves the weights as they were.
"""

from __future__ import annotations

import asyncio

import aiohttp
import torch
from aiohttp import web

from services.stage_server.averaging_routes import AVERAGER
from services.stage_server.routes import RUNTIME, SETTINGS, WORKER
from services.stage_server.state import load_stage_state, stage_state, state_from_bytes, state_to_bytes
from shared.errors import BadPayload, RemoteError
from shared.http import OCTET_STREAM, read_body, request_bytes


async def get_state(request: web.Request) -> web.Response:
    step, wait_s = request.query.get("step"), request.query.get("wait_s", "")
    if step is not None:
        if not step.isdigit() or len(step) > 15:
            raise BadPayload(f"'step' must be a global step (an int >= 0), got {step!r}")
        try:
            wait = (
                min(float(wait_s), request.app[SETTINGS].join_timeout_s)
                if wait_s
                else request.app[SETTINGS].join_timeout_s
            )
        except ValueError:
            raise BadPayload(f"'wait_s' must be a number of seconds, got {wait_s!r}") from None
        await request.app[AVERAGER].wait_step(int(step), max(0.0, wait))
    tensors, metadata = await request.app[WORKER].run(stage_state, request.app[RUNTIME])
    body = await asyncio.to_thread(state_to_bytes, tensors, metadata)  # the snapshot is a copy: no worker needed
    return web.Response(body=body, content_type=OCTET_STREAM)


async def post_state(request: web.Request) -> web.Response:
    settings, runtime = request.app[SETTINGS], request.app[RUNTIME]
    data = await read_body(request, OCTET_STREAM, int(settings.max_body_mb * 2**20))
    tensors, metadata = await asyncio.to_thread(state_from_bytes, data)
    await request.app[WORKER].run(load_stage_state, runtime, tensors, metadata)
    return web.json_response(
        {"stage": settings.stage, "weights_version": runtime.version, "optimizer_steps": runtime.stats.optimizer_steps}
    )


def add_state_routes(app: web.Application) -> None:
    app.router.add_get("/state", get_state)
    app.router.add_post("/state", post_state)


async def download_state(
    session: aiohttp.ClientSession, url: str, timeout_s: float
) -> tuple[dict[str, torch.Tensor], dict]:
    """GET ``url``/state of a peer replica; any failure raises :class:`RemoteError`."""
    target = url.rstrip("/") + "/state"
    payload = await request_bytes(session, "GET", target, expect=OCTET_STREAM, timeout_s=timeout_s)
    try:
        return await asyncio.to_thread(state_from_bytes, payload)
    except BadPayload as exc:
        raise RemoteError(target, 200, "bad_reply", exc.message) from None
