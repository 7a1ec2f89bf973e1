"""Chain routing, stage-server side: ``POST /chain`` carries a microbatch from server to server.

The trainer picks a replica for every stage with its wiring, as in relay routing, but sends
the route with the token ids to the stage-0 replica instead of carrying the tensors itself.
Each server runs its forward, sends its output straight to the route's replica of the next
stage, waits for that server's answer (the gradient of its output), runs its backward with
the input it still holds (usually from its cached graph: the same server ran the forward),
and answers its caller with the gradient of its input. The last stage computes the loss and
turns the chain around. So a microbatch's activation crosses each link between two stages
once forward and its gradient once backward; the trainer's link carries token ids, the
targets and a small answer.

Request (msgpack)::

    {v, run_id, stage, microbatch_id, seed, codec, eval?, until_step?, budget_s, route,
     inputs, targets}

``route``: one list of replica URLs per later stage (``stage + 1`` .. last), the preferred
replica first and alternates after it. ``budget_s``: the seconds the caller waits for the
answer; a server gives the next hop less (see :func:`next_budget`). ``targets`` travel
along untouched until the last stage.

Answer::

    {stage, microbatch_id, step, stage_step, bucket, accumulated, step_wait_s, complete?,
     grad_inputs? (not from stage 0), loss, loss_step, forward_s, backward_s, hops, rerouted}

``step``/``stage_step``/``bucket``/``accumulated``/``complete`` are this server's, as
``/backward`` answers them; ``loss`` and ``loss_step`` (the global step whose batch the
microbatch went into, as the last stage counted it) come from the last stage; ``forward_s``
and ``backward_s`` are this server's own time on the microbatch (its compute, codecs and
handling; its jobs' wait in the compute queue behind other requests and the backward's wait
for the global step left out: the wiring models the queue itself); ``hops`` lists the same for every later
stage with the replica that served it, so the trainer's wiring keeps learning replica
speeds; ``rerouted`` names the replicas that failed on the way and what they answered. An
evaluation (``eval: true``) answers ``{stage, microbatch_id, step, loss, hops, rerouted}``.

Faults. A next hop that fails (unreachable, timed out, 5xx, moved to another stage, or
overloaded past a few waits) gets the same output again on the next alternate: the server
still holds it. When no alternate takes it, the server answers 502 ``chain_broken`` with the
failed replicas (``failed`` in the error); a 409 ``stale_forward`` from further down passes
up unchanged. Either way the trainer runs the microbatch again from stage 0, keeping the
replicas that did not fail, so a stage that already accumulated the microbatch's gradient
recognises the id and does not accumulate it twice. A server whose caller vanished finishes
its work; the caller's caller reroutes or the trainer re-runs, as above.

Memory: a server holds each chain's input (and output) until its backward is done. What its
chains in progress hold is bounded by ``SWARM_CHAIN_HELD_MB``: past it, a new chain gets 503
``overloaded`` with Retry-After before anything is decoded. Requests to the next hop go
through the server's own swarm session (signed with the swarm secret, TLS as configured),
so a server accepts forwarded work only from members of the swarm.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time

from aiohttp import web

from services.stage_server.metrics import STAGE_METRICS
from services.stage_server.routes import (
    RUNTIME,
    SETTINGS,
    StageRequest,
    _respond,
    parse_message,
    run_backward,
    run_forward,
)
from services.stage_server.runtime import QUEUED_S
from shared.codec import decode_tensor
from shared.config import StageServerSettings
from shared.errors import BadPayload, Overloaded, RemoteError, SwarmError, WrongStage
from shared.http import MICROBATCH_HEADER, post_message, read_message, swarm_session

MAX_ALTERNATES = 8  # replicas per stage in a route, the preferred one included
MAX_URL_LEN = 512
MAX_OVERLOAD_WAITS = 3  # "overloaded" answers of one next hop waited out before trying an alternate
MAX_OVERLOAD_WAIT_S = 2.0
MIN_BUDGET_S = 0.5  # a next hop is not tried with less time than this
PASSED_ON = (
    "run_id",
    "microbatch_id",
    "seed",
    "codec",
    "eval",
    "until_step",
    "admitted_step",
    "targets",
)  # what the next hop gets as it came


class ChainError(SwarmError):
    """The chain could not complete past this server: 502 ``chain_broken`` naming the replicas
    that failed (``failed``), or an error from further down passed up with its own status."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 502,
        code: str = "chain_broken",
        failed: list[dict] | None = None,
        retry_after_s: float | None = None,
    ):
        super().__init__(message, retry_after_s=retry_after_s)
        self.status, self.code, self.failed = status, code, failed or []

    def to_json(self) -> dict:
        return {"error": {"code": self.code, "message": self.message, "failed": self.failed}}


class HeldBudget:
    """Bytes that chains in progress hold on this server, against ``limit_bytes``."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes, self.held = limit_bytes, 0

    @contextlib.contextmanager
    def hold(self, nbytes: int):
        """Hold ``nbytes`` for the ``with`` block; :class:`Overloaded` if that would pass the
        limit (one chain alone is always admitted, whatever its size)."""
        if self.held and self.held + nbytes > self.limit_bytes:
            raise Overloaded(
                (
                    f"chains in progress hold {self.held} bytes, the limit is {self.limit_bytes} (setting "
                    "SWARM_CHAIN_HELD_MB)"
                ),
                retry_after_s=1.0,
            )
        self.held += nbytes
        try:
            yield
        finally:
            self.held -= nbytes


@dataclasses.dataclass
class ChainHops:
    """What a server needs for its chains: the session its next hops go through, the held budget."""

    session: object
    budget: HeldBudget


CHAIN = web.AppKey("chain", ChainHops)


def next_budget(remaining_s: float) -> float:
    """The seconds a next hop gets of the ``remaining_s`` this server has left: a tenth less,
    and half a second, so that this server can still answer (or reroute) in time."""
    return remaining_s * 0.9 - 0.5


def parse_route(msg: dict, stage: int, num_stages: int) -> list[list[str]]:
    route = msg.get("route")
    later = num_stages - 1 - stage
    if not isinstance(route, list) or len(route) != later:
        raise BadPayload(f"'route' must list the replicas of each of the {later} later stages")
    for replicas in route:
        if not isinstance(replicas, list) or not 1 <= len(replicas) <= MAX_ALTERNATES:
            raise BadPayload(f"each stage of 'route' must be a list of 1..{MAX_ALTERNATES} replica URLs")
        for url in replicas:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")) or len(url) > MAX_URL_LEN:
                raise BadPayload(
                    f"route entries must be http(s) URLs of at most {MAX_URL_LEN} characters, got {str(url)[:80]!r}"
                )
    return route


def parse_budget(msg: dict) -> float:
    budget = msg.get("budget_s")
    if (
        not isinstance(budget, (int, float))
        or isinstance(budget, bool)
        or not math.isfinite(budget)
        or not 0 < budget <= 86_400
    ):
        raise BadPayload("'budget_s' must be a number of seconds in (0, 86400]")
    return float(budget)


def held_bytes(msg: dict) -> int:
    """What a chain holds here, from its message before decoding: the input as float32 (what
    the model computes on) and an output of the same size."""
    inputs = msg.get("inputs")
    shape = inputs.get("shape") if isinstance(inputs, dict) else None
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        return 0  # the decoder refuses it with its own message
    return 2 * 4 * math.prod(shape)


async def chain(request: web.Request) -> web.Response:
    app = request.app
    settings, runtime = app[SETTINGS], app[RUNTIME]
    received = time.monotonic()
    msg = await read_message(request, int(settings.max_body_mb * 2**20))
    if (
        msg.get("stage") != settings.stage
    ):  # before the route, whose length depends on the stage: a moved server says 409
        raise WrongStage(f"this server holds stage {settings.stage}, not {msg.get('stage')!r}")
    budget_s = parse_budget(msg)
    route = parse_route(msg, settings.stage, settings.num_stages)
    deadline = received + budget_s
    with app[CHAIN].budget.hold(held_bytes(msg)):
        req = await parse_message(request, msg, names=["inputs", "targets"] if runtime.spec.is_last else ["inputs"])
        reply = (
            await _last_stage(app, req) if runtime.spec.is_last else await _middle_stage(app, req, msg, route, deadline)
        )
    app[STAGE_METRICS].count_tensors("out", reply)
    return _respond(settings, reply)


async def _last_stage(app: web.Application, req: StageRequest) -> dict:
    """The end of the chain: the loss, and (training) the backward that turns the chain around."""
    started, queued = time.monotonic(), QUEUED_S.get()
    if req.eval:
        reply = await run_forward(app, req)
        forward_s = max(_served_s(started, queued) - reply["step_wait_s"], 0.0)
        return {**reply, "forward_s": round(forward_s, 6), "hops": [], "rerouted": []}
    reply = await run_backward(app, req)
    seconds = _served_s(started, queued) - reply["step_wait_s"]
    return {
        **reply,
        "loss_step": reply["bucket"],
        "forward_s": 0.0,
        "backward_s": round(max(seconds, 0.0), 6),
        "hops": [],
        "rerouted": [],
    }


async def _middle_stage(
    app: web.Application, req: StageRequest, msg: dict, route: list[list[str]], deadline: float
) -> dict:
    """Forward, the rest of the chain, backward."""
    settings = app[SETTINGS]
    started, queued = time.monotonic(), QUEUED_S.get()
    forward = await run_forward(app, req)
    forward_s = max(_served_s(started, queued) - forward["step_wait_s"], 0.0)
    onward = {k: msg[k] for k in PASSED_ON if k in msg} | {
        "stage": settings.stage + 1,
        "inputs": forward["outputs"],
        "route": route[1:],
    }
    down, url, rerouted = await send_on(app, route[0], onward, deadline, settings.stage + 1)
    app[STAGE_METRICS].count_tensors("out", {"inputs": forward["outputs"]})  # the activation this server sent on
    app[STAGE_METRICS].count_tensors("in", {"grad_inputs": down.get("grad_inputs")} if "grad_inputs" in down else {})
    hops = [_hop(settings.stage + 1, url, down)] + list(down.get("hops", []))
    rerouted = rerouted + list(down.get("rerouted", []))
    loss = down.get("loss")
    if req.eval:
        return {
            "stage": settings.stage,
            "microbatch_id": req.microbatch_id,
            "step": forward["step"],
            "loss": loss,
            "forward_s": round(forward_s, 6),
            "hops": hops,
            "rerouted": rerouted,
        }
    try:
        grad_outputs = decode_tensor(down.get("grad_inputs"), name="grad_inputs", device=app[RUNTIME].device)
    except SwarmError as exc:
        raise ChainError(
            f"stage {settings.stage + 1} at {url} answered a bad gradient: {exc.message}",
            failed=[{"stage": settings.stage + 1, "replica": url, "code": "bad_reply"}],
        ) from None
    started, queued = time.monotonic(), QUEUED_S.get()
    try:
        reply = await run_backward(
            app, dataclasses.replace(req, grad_outputs=grad_outputs, forward_step=forward["step"])
        )
    except (
        SwarmError
    ) as exc:  # refused here (a stale forward): the caller still learns which replicas failed on the way
        raise ChainError(
            exc.message, status=exc.status, code=exc.code, failed=rerouted, retry_after_s=exc.retry_after_s
        ) from None
    backward_s = _served_s(started, queued) - reply["step_wait_s"]
    return {
        **reply,
        "loss": loss,
        "loss_step": down.get("loss_step"),
        "forward_s": round(forward_s, 6),
        "backward_s": round(max(backward_s, 0.0), 6),
        "hops": hops,
        "rerouted": rerouted,
    }


def _served_s(started: float, queued: float) -> float:
    """Seconds since ``started`` less what this request's compute jobs waited in the worker's
    queue since (``QUEUED_S`` was ``queued``): the server's service time on it. The wiring
    adds its own queue (each replica's virtual time): a measure with the queue in it made a
    replica that had been given more look slower, and the next burst went the other way."""
    return time.monotonic() - started - (QUEUED_S.get() - queued)


def _hop(stage: int, url: str, reply: dict) -> dict:
    """What the trainer learns of the replica that served ``stage``."""
    return {
        "stage": stage,
        "replica": url,
        "forward_s": reply.get("forward_s"),
        "backward_s": reply.get("backward_s"),
        "step": reply.get("step"),
        "accumulated": reply.get("accumulated"),
    }


async def send_on(
    app: web.Application, replicas: list[str], msg: dict, deadline: float, stage: int
) -> tuple[dict, str, list[dict]]:
    """POST ``msg`` to the first of ``replicas`` (the route's choice for ``stage``, then its
    alternates) that completes the rest of the chain; returns (answer, replica, failures on
    the way). Raises :class:`ChainError` when none does or the chain must start over."""
    rerouted: list[dict] = []
    loop = asyncio.get_running_loop()
    for url in replicas:
        waits = 0
        while (remaining := next_budget(deadline - loop.time())) >= MIN_BUDGET_S:
            try:
                reply = await post_message(
                    app[CHAIN].session,
                    url + "/chain",
                    {**msg, "budget_s": round(remaining, 3)},
                    timeout_s=remaining,
                    headers={MICROBATCH_HEADER: msg["microbatch_id"]},
                )
                return reply, url, rerouted
            except RemoteError as err:
                if err.code == "stale_forward":  # a stage further down refused: the microbatch runs again from stage 0
                    raise ChainError(err.message, status=409, code="stale_forward", failed=rerouted) from None
                if err.code == "chain_broken":  # broken further down, not at this replica
                    raise ChainError(
                        err.message, failed=rerouted + list((err.details or {}).get("failed", []))
                    ) from None
                if err.code == "overloaded" and waits < MAX_OVERLOAD_WAITS and err.retry_after_s is not None:
                    waits += 1
                    await asyncio.sleep(min(MAX_OVERLOAD_WAIT_S, max(0.1, err.retry_after_s)))
                    continue
                if not err.retryable:  # a refusal no other replica would answer differently (bad payload, auth)
                    raise ChainError(
                        f"stage {stage} at {url} refused the microbatch: {err.message}",
                        status=err.status or 502,
                        code=err.code,
                        failed=rerouted,
                    ) from None
                rerouted.append({"stage": stage, "replica": url, "code": err.code, "message": err.message[:200]})
                break
    tried = ", ".join(f"{f['replica']} ({f['code']})" for f in rerouted if f["stage"] == stage) or "none tried in time"
    raise ChainError(f"no replica of stage {stage} completed the chain: {tried}", failed=rerouted)


def add_chain_routes(app: web.Application, settings: StageServerSettings) -> None:
    """``POST /chain`` and the session its next hops go through (closed on shutdown)."""

    async def ctx(app: web.Application):
        async with swarm_session(settings, limit=0) as session:  # limit 0: a connection per chain in flight
            app[CHAIN] = ChainHops(session, HeldBudget(int(settings.chain_held_mb * 2**20)))
            yield

    app.cleanup_ctx.append(ctx)
    app.router.add_post("/chain", chain)
