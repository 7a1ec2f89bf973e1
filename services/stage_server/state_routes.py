"""State transfer endpoints of the stage server, and the client side of a join.

    GET  /state[?step=N] -> application/octet-stream: the stage's weights and optimizer state
                    (safetensors, see ``shared.checkpoint``), always at a step boundary;
                    with ``step``: once the stage has taken global step N (waiting at most
                    ``wait_s`` or SWARM_JOIN_TIMEOUT_S, then as it is), so that every stage
                    of a checkpoint is at the same step
    POST /state  <- the same bytes (Content-Type application/octet-stream, at most
                    SWARM_MAX_BODY_MB): load them -> {stage, weights_version, optimizer_steps}
    GET  /digest -> JSON {step, digest}: SHA-256 of the weights and optimizer state (the
                    coordinator's check that the replicas of a stage are one model)
    POST /average/copy {stage, source, step, timeout_s} -> {step, digest}: a drift repair (the
                    coordinator's digest check): this replica, at 'step', takes the whole
                    state of the replica at 'source'; answered once it is loaded. 409
                    round_conflict if it is not at 'step' (the next check repairs it), 502
                    source_unavailable if the source gave no state

Both run their tensor work on the compute worker, so a snapshot or a load never races a
backward or an optimizer step. A state of another stage or model is refused with 409, a
malformed one with 400, another content type with 415, an oversize body with 413; a
refused state leaves the weights as they were.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp
import torch
from aiohttp import web

from services.stage_server.allreduce import AVERAGER, RoundConflict
from services.stage_server.routes import RUNTIME, SETTINGS, WORKER
from services.stage_server.state import load_stage_state, stage_state, state_from_bytes, state_to_bytes
from shared.config import StageServerSettings
from shared.errors import BadPayload, RemoteError, SwarmError, WrongStage
from shared.http import (
    OCTET_STREAM,
    from_any_replica,
    get_json,
    msgpack_response,
    read_body,
    read_message,
    request_bytes,
    swarm_session,
)

_SESSION = web.AppKey("state_session", aiohttp.ClientSession)  # a repair's download of its source's state
_CONTROL_BYTES = 1 << 16
_MAX_TIMEOUT_S = 3600.0


class SourceUnavailable(SwarmError):
    """A repair could not take its source replica's state (unreachable, refused, malformed)."""

    status = 502
    code = "source_unavailable"


@dataclass(frozen=True)
class CopyOrder:
    """``/average/copy``: replace this replica's whole state with that of ``source`` (a live
    replica of its stage), the two being at global step ``step`` (a drift repair)."""

    stage: int
    source: str
    step: int
    timeout_s: float

    @classmethod
    def from_message(cls, msg: dict, stage: int) -> CopyOrder:
        source, step, timeout_s = msg.get("source"), msg.get("step"), msg.get("timeout_s")
        if type(msg.get("stage")) is not int:
            raise BadPayload("'stage' must be an int")
        if not (isinstance(source, str) and source.startswith(("http://", "https://")) and len(source) <= 2048):
            raise BadPayload("'source' must be an http(s) URL")
        if not (type(step) is int and 0 <= step < 2**53):
            raise BadPayload("'step' must be an int >= 0")
        if not (type(timeout_s) in (int, float) and 0 < timeout_s <= _MAX_TIMEOUT_S):  # NaN fails the range too
            raise BadPayload(f"'timeout_s' must be a number in (0, {_MAX_TIMEOUT_S}]")
        if msg["stage"] != stage:
            raise WrongStage(f"this server holds stage {stage}, not {msg['stage']}")
        return cls(stage, source.rstrip("/"), step, float(timeout_s))


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


async def digest(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    step, value = await request.app[WORKER].run(lambda: (runtime.step, runtime.digest()))
    reply = {"step": step, "digest": value}
    if runtime.outer is not None:  # local mode: replicas in the middle of an outer step are between steps too
        reply["outer_steps"] = runtime.outer.steps
    return web.json_response(reply)


async def copy(request: web.Request) -> web.Response:
    """A drift repair: replace this replica's whole state (weights and optimizer) with that of
    ``order.source``, both at step ``order.step``; answers (step, digest) after. The gradients
    accumulated here stay (see :func:`load_copied_state`). :class:`RoundConflict` if this
    replica is not at that step (it moved on: the next check repairs it) or a params round
    runs here; :class:`SourceUnavailable` if the source's state could not be had."""
    settings, runtime, averager = request.app[SETTINGS], request.app[RUNTIME], request.app[AVERAGER]
    order = CopyOrder.from_message(await read_message(request, _CONTROL_BYTES), stage=settings.stage)
    if averager.closing or _SESSION not in request.app:
        raise RoundConflict("this server is not taking repairs (starting up or shutting down)")
    if averager.running and averager.round.spec.kind != "step":
        raise RoundConflict(f"params round {averager.round.spec.round_id!r} is running here")
    if runtime.step != order.step:
        raise RoundConflict(f"the repair is of step {order.step}, this replica is at step {runtime.step}")
    try:
        tensors, metadata = await download_state(request.app[_SESSION], order.source, order.timeout_s)
    except RemoteError as exc:
        raise SourceUnavailable(f"no state from {order.source}: {exc}") from None
    step, value = await request.app[WORKER].run(load_copied_state, runtime, tensors, metadata)
    averager.log.warning("averaging.repair.loaded", source=order.source, step=step)
    return msgpack_response({"step": step, "digest": value})


def load_copied_state(runtime, tensors: dict[str, torch.Tensor], metadata: dict) -> tuple[int, str]:
    """On the compute worker: load a peer's whole state (``load_stage_state``) at this
    replica's step, keeping the gradients accumulated here for this step and the next
    (the backwards that made them were reserved and counted; the state replaces what was
    learned, not what is being learned). Returns (step, digest) after.
    :class:`RoundConflict` if the state is of another step (nothing changed then)."""
    theirs = metadata.get("optimizer_steps")
    if theirs != runtime.step:
        raise RoundConflict(f"the source's state is of step {theirs}, this replica is at step {runtime.step}")
    held = [(k, runtime.take_gradients(k)) for k in (runtime.step, runtime.step + 1) if runtime.pending(k)]
    try:
        load_stage_state(runtime, tensors, metadata)
    finally:  # loaded or refused, what was taken goes back
        for k, taken in held:
            runtime.give_back(taken, k)
    return runtime.step, runtime.digest()


def add_state_routes(app: web.Application) -> None:
    app.router.add_get("/state", get_state)
    app.router.add_post("/state", post_state)
    app.router.add_get("/digest", digest)
    app.router.add_post("/average/copy", copy)
    settings = app[SETTINGS]

    async def session(app: web.Application):
        async with swarm_session(settings) as held:
            app[_SESSION] = held
            yield

    app.cleanup_ctx.append(session)


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


async def state_from_peers(settings: StageServerSettings, log, *, exclude: str = "", furthest_first: bool = False):
    """The state of the first live replica of this stage (but ``exclude``) that gives it, or
    None: those on the fastest declared link first (a stage's state is tens of MB: over the
    arena's 10 Mbit/s peer, 16 s); ``furthest_first``: the replicas at the furthest global
    step are asked first (then by link)."""
    async with swarm_session(settings) as session:
        # An unreachable coordinator (restarting) is waited for up to join_timeout_s: a
        # server that gave up at once would serve fresh weights into a trained stage.
        loop = asyncio.get_running_loop()
        deadline, attempt = loop.time() + settings.join_timeout_s, 0
        while True:
            try:
                view = await get_json(session, settings.coordinator + "/swarm", timeout_s=10)
                replicas = [r for r in view["stages"][settings.stage]["replicas"] if r["url"] != exclude]
                replicas.sort(key=lambda r: -float(r.get("link_mbit") or 0.0))  # stable: otherwise the view's order
                peers = [r["url"] for r in replicas]
                break
            except RemoteError as exc:
                attempt += 1
                if exc.status is not None or loop.time() >= deadline:
                    log.warning("stage.join.no_view", error=repr(exc))
                    return None
                log.info("stage.join.waiting_for_coordinator", error=exc.code, attempt=attempt)
                await asyncio.sleep(min(2.0, 0.2 * attempt))
            except (KeyError, IndexError, TypeError) as exc:
                log.warning("stage.join.no_view", error=repr(exc))
                return None
        if furthest_first:
            peers = await _furthest_first(session, peers)
        return await from_any_replica(
            peers,
            lambda url: download_state(session, url, settings.join_timeout_s),
            deadline_s=max(0.0, deadline - loop.time()),
            on_error=lambda url, exc: log.warning("stage.join.download_failed", replica=url, error=str(exc)),
        )


async def _furthest_first(session, peers: list[str]) -> list[str]:
    """``peers`` ordered by their global step (``GET /health``), furthest first; unreachable ones last."""

    async def step_of(url: str) -> int:
        try:
            return int((await get_json(session, url + "/health", timeout_s=5))["step"])
        except (RemoteError, KeyError, TypeError, ValueError):
            return -1

    steps = await asyncio.gather(*(step_of(u) for u in peers))
    return [u for _, u in sorted(zip(steps, peers), key=lambda pair: -pair[0])]
