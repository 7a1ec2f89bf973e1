"""The coordinator's admission endpoints (the logic is :mod:`services.coordinator.admission`).

    POST /step/admit {run_id, microbatch_id, samples, until_step?}
        -> {verdict: admitted, step} | {verdict: complete}; 503 + Retry-After while the
        window stays full for the step timeout (the trainer asks again)
    POST /step/release {run_id, microbatch_id} -> {released: bool}
    POST /step/renew {run_id, microbatch_ids: [...]} -> {renewed, lease_s}: these microbatches
        are in flight: their admissions are renewed. A trainer sends it every quarter of
        ``lease_s`` (which ``/step/admit`` answers with too)

A held ask is answered as soon as the swarm steps (every stage's step is watched through
the step scheduler), or with 503 at the step timeout.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from services.coordinator.admission import Admit
from services.coordinator.routes import ADMISSION, _check_run, read_json
from shared.errors import BadPayload, Draining, Overloaded

MAX_ID_LENGTH = 256
MAX_RENEWED = 4096  # microbatch ids in one renewal


def _microbatch_id(msg: dict) -> str:
    mb = msg.get("microbatch_id")
    if not isinstance(mb, str) or not 0 < len(mb) <= MAX_ID_LENGTH:
        raise BadPayload(f"'microbatch_id' must be a non-empty string of at most {MAX_ID_LENGTH} characters")
    return mb


def _positive_int(msg: dict, name: str, *, required: bool) -> int | None:
    value = msg.get(name)
    if value is None and not required:
        return None
    if type(value) is not int or not 1 <= value < 2**53:
        raise BadPayload(f"'{name}' must be an int >= 1")
    return value


def add_admission_routes(
    app: web.Application, *, swarm_step, global_batch, wait_changed, closing, timeout_s: float
) -> None:
    """``swarm_step()`` is the lowest step of the stages; ``global_batch()`` the run's, as the servers said it (0:
    unknown); ``wait_changed(timeout_s)`` returns when a stage may have stepped;
    ``closing()``: the coordinator is stopping."""

    async def admit(request: web.Request) -> web.Response:
        msg = await read_json(request)
        _check_run(request, msg)
        mb, samples = _microbatch_id(msg), _positive_int(msg, "samples", required=True)
        until_step = _positive_int(msg, "until_step", required=False)
        admission, loop = request.app[ADMISSION], asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            admission.global_batch = global_batch()
            admission.stepped(swarm_step())
            verdict, step = admission.admit(mb, samples, until_step)
            if verdict is not Admit.WAIT:
                return web.json_response({"verdict": verdict.value, "step": step, "lease_s": admission.lease_s})
            if closing():
                raise Draining("the coordinator is stopping: ask again once it is back")
            if loop.time() >= deadline:
                raise Overloaded(
                    f"steps up to {admission.swarm_step + admission.lookahead} have their global batches in flight "
                    f"(the swarm is at step {admission.swarm_step})",
                    retry_after_s=0.5,
                )
            await wait_changed(deadline - loop.time())

    async def release(request: web.Request) -> web.Response:
        msg = await read_json(request)
        _check_run(request, msg)
        return web.json_response({"released": request.app[ADMISSION].release(_microbatch_id(msg))})

    async def renew(request: web.Request) -> web.Response:
        msg = await read_json(request)
        _check_run(request, msg)
        ids = msg.get("microbatch_ids")
        if not isinstance(ids, list) or len(ids) > MAX_RENEWED:
            raise BadPayload(f"'microbatch_ids' must be a list of at most {MAX_RENEWED} microbatch ids")
        admission = request.app[ADMISSION]
        renewed = admission.renew([_microbatch_id({"microbatch_id": mb}) for mb in ids])
        return web.json_response({"renewed": renewed, "lease_s": admission.lease_s})

    app.router.add_post("/step/admit", admit)
    app.router.add_post("/step/release", release)
    app.router.add_post("/step/renew", renew)
