"""HTTP handlers of the coordinator: decode JSON, call the registry, the averaging
scheduler or the checkpointer, encode JSON. The global step's handlers (``/step/reserve``,
``/step/done``) are in ``steps.py``, the dashboard's and the OpenAI-compatible API's in
``dashboard_routes.py`` and ``completions.py``.

Request bodies are JSON objects (``Content-Type: application/json``, at most 64 KiB);
unknown fields are ignored, so old and new servers interoperate::

    POST /register   {run_id, server_id, stage, url, version, throughput, queue_length}
                     -> {server_id, stage, heartbeat_s, lease_s}
    POST /assign     {run_id, region?, rtt_ms?: {peer URL: ms}, speed_flops?, link_mbit?} -> {stage, placement}
                     the stage a joining server should serve (see placement.py)
                     {..., standby: true, server_id, wait_s?}: a standby server; answered
                     when a stage needs it ({stage, placement: "standby", reason}) or after
                     wait_s (at most 20 s) with {stage: null}: it asks again
    POST /heartbeat  {server_id, throughput, queue_length, rtt_ms?: {peer URL: ms},
                      region?, workload?: {parameters, samples_per_step, activation_bytes_per_sample},
                      utilisation?: {model_flops, compute_s, peak_flops, peak_source, mfu_busy, mfu_wall, ...}}
                     -> {lease_s}   (/register takes region, workload and utilisation too)
                     404 unknown_server: the lease is gone, register again
    POST /deregister {server_id} -> {removed}
    GET  /swarm      -> {run_id, num_stages, heartbeat_s, lease_s, stages: [{stage, capacity, replicas,
                         step: {step, reserved, accumulated, global_batch, round, samples_dropped,
                                duplicates_refused, last_effective_batch, steps_lost,
                                steps_lost_total},
                         utilisation: {mfu_busy, mfu_wall, flops_per_s_wall, peak_flops, ...} | null}]}
                     (each replica with its own ``utilisation`` report, see utilisation.py)
    POST /step/reserve {run_id, stage, url, step, samples, global_batch, microbatch_id, until_step?}
                     -> {verdict, bucket, step, replicas}
    POST /step/done  {run_id, stage, url, step, bucket, reserved, samples, global_batch, microbatch_id,
                      closes?} -> {round, step}
                     global steps (their handlers are in steps.py, the messages in
                     shared/step_protocol.py): which step a backward's gradient goes to (or a
                     verdict without one: resync, catch_up, complete, duplicate), and what it
                     accumulated; the step round starts once a step is complete
    GET  /health     -> {status: "ok", servers}
    GET  /metrics, GET /, GET /dashboard.json, POST /progress: metrics.py, dashboard_routes.py
    GET  /v1/models, POST /v1/completions, POST /v1/chat/completions: the OpenAI-compatible
                     API, generation and scoring through the swarm (completions.py), with
                     vLLM's GET /tokenizer_info, POST /tokenize, POST /detokenize
    POST /average    -> {checks, rounds: [{stage, round_id, members, accepted, ended}]}
                     an averaging pass of every stage with 2+ replicas, answered when it ended
    POST /checkpoint -> {path, step}   (with SWARM_CHECKPOINT_DIR) save the run now

Errors are ``{"error": {"code", "message"}}``: 400 bad_payload, 404 unknown_server,
409 wrong_run / stage_out_of_range, 413, 415, 503 registry_full.
"""

from __future__ import annotations

import asyncio

import structlog
from aiohttp import web

from services.coordinator.admission import Admission
from services.coordinator.assignment import network_inputs
from services.coordinator.averaging import AveragingScheduler
from services.coordinator.checkpointer import Checkpointer
from services.coordinator.placement import Joiner, stage_for_joiner, uses_topology
from services.coordinator.registry import Registry, check_link, check_region, check_report, check_rtt, check_speed
from services.coordinator.steps import STEPS
from services.coordinator.utilisation import UtilisationBoard, check_utilisation
from shared import checkpoint
from shared.config import CoordinatorSettings
from shared.errors import BadPayload, Overloaded
from shared.http import check_run
from shared.http import read_json as http_read_json
from shared.policy.spares import spare_replicas
from shared.policy.view import PlacementInputs

SETTINGS = web.AppKey("settings", CoordinatorSettings)
REGISTRY = web.AppKey("registry", Registry)
TRAFFIC = web.AppKey("traffic", dict)  # loop name -> {"sent": bytes, "received": bytes}
AVERAGING = web.AppKey("averaging", AveragingScheduler)
CHECKPOINTER = web.AppKey("checkpointer", Checkpointer)
LOG = web.AppKey("log", structlog.typing.FilteringBoundLogger)
ASSIGN_LOCK = web.AppKey("assign_lock", asyncio.Lock)
ADMISSION = web.AppKey("admission", Admission)
UTILISATION = web.AppKey("utilisation", UtilisationBoard)  # the servers' MFU reports (utilisation.py)
SPARES = web.AppKey("spares", dict)  # server_id -> why, as GET /swarm last showed them (logged when they change)
# the rebalancing loop's latest check: {"servers": the live ones it saw, "settled": nothing to order or wait for}
PLACEMENT = web.AppKey("placement", dict)
JOINER_ID, PENDING_PREFIX = "<joiner>", "<pending>"  # peer ids no server can have (server ids are [A-Za-z0-9._-])

MAX_BODY_BYTES = 64 * 1024
_MAX_STANDBY_WAIT_S = 20.0  # the longest a standby server's /assign is held open
_STANDBY_CHECK_S = 0.1  # how often a held /assign looks for a stage that needs its standby


async def read_json(request: web.Request) -> dict:
    """Read a JSON object, refusing the wrong content type (415) and oversize bodies (413)."""
    return await http_read_json(request, MAX_BODY_BYTES, setting="the coordinator's fixed limit")


def _check_run(request: web.Request, msg: dict) -> None:
    check_run(msg, request.app[SETTINGS].run_id)


async def _register(request: web.Request) -> web.Response:
    msg = await read_json(request)
    _check_run(request, msg)
    registry = request.app[REGISTRY]
    fields = ("server_id", "stage", "url", "version", "throughput", "queue_length")
    report, utilisation = check_report(msg), _utilisation(msg)
    server = registry.register(*(msg.get(f) for f in fields), report=report)
    if utilisation is not None:
        request.app[UTILISATION].record(server.server_id, utilisation)
    if STEPS in request.app:  # a new incarnation at this URL: what its predecessor said of its step is void
        request.app[STEPS].counter.registered(server.stage, server.url, report.step if report else None)
    request.app[LOG].info(
        "registry.registered",
        server_id=server.server_id,
        stage=server.stage,
        url=server.url,
        version=server.version,
        throughput=server.throughput,
    )
    return web.json_response(
        {
            "server_id": server.server_id,
            "stage": server.stage,
            "heartbeat_s": registry.heartbeat_s,
            "lease_s": registry.lease_s,
        }
    )


async def _assign(request: web.Request) -> web.Response:
    """The stage a joining server should serve: where a loss would hurt most (the policy's
    rule: an empty stage first, then one with a single replica, ...; a joiner that declared
    a slow link, the strongest stage of that need); once every stage has two replicas, by
    the network cost model when placement plans with it (the joiner's
    region and measured RTTs in the body). Joins are placed one at a time, each counting the
    stages handed out before it. A plan the network planner cannot make falls back to the
    policy's stage (logged), never to an error."""
    msg = await read_json(request)
    _check_run(request, msg)
    joiner = Joiner(JOINER_ID, check_region(msg.get("region", "")), check_rtt(msg.get("rtt_ms", {})))
    speed = check_speed(msg.get("speed_flops", 0.0))  # placed by it where every server declared one
    link = check_link(msg.get("link_mbit", 0.0))  # a slow one goes where the stage has most to spare
    registry, settings, log = request.app[REGISTRY], request.app[SETTINGS], request.app[LOG]
    if msg.get("standby") is True:
        return await _assign_standby(request, msg, joiner.region)
    async with request.app[ASSIGN_LOCK]:
        choice = registry.join_choice(link)
        stage, placement, reason = choice.stage, "throughput", choice.reason
        if choice.free and uses_topology(settings.placement.mode, registry.rtt_ms, registry.reports, joiner):
            try:
                inputs = _network_inputs(registry, settings, joiner)
                stage = await asyncio.to_thread(
                    stage_for_joiner,
                    inputs,
                    JOINER_ID,
                    registry.num_stages,
                    time_budget_s=settings.placement.budget_s / 5,
                )
                placement, reason = "topology", "the cheapest stage by the network cost model"
            except (ValueError, KeyError) as exc:  # inputs the planner cannot work with: the policy's stage
                log.warning("placement.joiner.fallback", error=repr(exc), stage=stage, reason=reason)
        registry.hand_out(stage, joiner.region, dict(joiner.rtt_ms), speed, link)
    log.info(
        "placement.joiner",
        stage=stage,
        placement=placement,
        reason=reason,
        region=joiner.region or None,
        peers_timed=len(joiner.rtt_ms),
        speed_gflops=round(speed / 1e9, 3) if speed else None,
        link_mbit=link or None,
    )
    return web.json_response({"stage": stage, "placement": placement})


async def _assign_standby(request: web.Request, msg: dict, region: str) -> web.Response:
    """A standby server's ``/assign``, held open until a stage needs it (the policy's
    ``standby_stage``: a stage left with fewer than two replicas) or ``wait_s`` passes."""
    registry, log = request.app[REGISTRY], request.app[LOG]
    server_id, wait_s = msg.get("server_id"), msg.get("wait_s", _MAX_STANDBY_WAIT_S)
    if type(wait_s) not in (int, float) or not 0 <= wait_s <= 3600:
        raise BadPayload("'wait_s' must be a number of seconds in [0, 3600]")
    registry.note_standby(server_id, region)  # checks the id
    deadline = asyncio.get_running_loop().time() + min(float(wait_s), _MAX_STANDBY_WAIT_S)
    while True:
        if request.transport is None or request.transport.is_closing():  # it went away: hand it nothing
            raise asyncio.CancelledError
        async with request.app[ASSIGN_LOCK]:
            choice = registry.standby_choice()
            if choice is not None:
                registry.hand_out(choice.stage, region)
                registry.note_standby(server_id, assigned=True)
                break
            registry.note_standby(server_id, region)
        if asyncio.get_running_loop().time() >= deadline:
            return web.json_response({"stage": None, "placement": "standby", "reason": "every stage has two replicas"})
        await asyncio.sleep(_STANDBY_CHECK_S)
    log.info("placement.standby", stage=choice.stage, server_id=server_id, reason=choice.reason, region=region or None)
    return web.json_response({"stage": choice.stage, "placement": "standby", "reason": choice.reason})


def _network_inputs(registry: Registry, settings: CoordinatorSettings, joiner: Joiner) -> PlacementInputs:
    """The network planner's inputs for placing ``joiner``: the live servers, and the pending
    hand-outs with their stages."""
    pending = [
        Joiner(f"{PENDING_PREFIX}{i}", p.region, p.rtt_ms, p.stage) for i, p in enumerate(registry.pending_joins())
    ]
    return network_inputs(registry, settings, registry.live(), [*pending, joiner])


async def _heartbeat(request: web.Request) -> web.Response:
    msg = await read_json(request)
    registry, utilisation = request.app[REGISTRY], _utilisation(msg)
    registry.heartbeat(
        msg.get("server_id"),
        msg.get("throughput"),
        msg.get("queue_length"),
        rtt_ms=msg.get("rtt_ms"),
        report=check_report(msg),
    )
    if utilisation is not None:
        request.app[UTILISATION].record(msg["server_id"], utilisation)
    return web.json_response({"lease_s": registry.lease_s})


def _utilisation(msg: dict) -> dict | None:
    """The server's MFU report in a registration or heartbeat (validated), or None."""
    return None if msg.get("utilisation") is None else check_utilisation(msg["utilisation"])


async def _deregister(request: web.Request) -> web.Response:
    server_id = (await read_json(request)).get("server_id")
    removed = request.app[REGISTRY].deregister(server_id)
    request.app[LOG].info("registry.deregistered", server_id=server_id, removed=removed)
    return web.json_response({"removed": removed})


def swarm_view(app: web.Application) -> dict:
    """The registry's view, each stage with its global step (``steps.py``) and utilisation,
    and each replica with whether it is a hot spare (``spare``; ``spare_reason``)."""
    view = app[REGISTRY].view()
    app[UTILISATION].annotate(view)
    spares = spare_replicas(app[REGISTRY].swarm()) if app[SETTINGS].hot_spares else {}
    for stage in view["stages"]:
        for replica in stage["replicas"]:
            replica["spare"] = replica["server_id"] in spares
            if replica["spare"]:
                replica["spare_reason"] = spares[replica["server_id"]]
    if set(spares) != set(app[SPARES]):
        app[SPARES].clear()
        app[SPARES].update(spares)
        app[LOG].info("placement.spares", spares=sorted(spares), reasons=[spares[s] for s in sorted(spares)])
    if STEPS in app:
        for stage, steps in zip(view["stages"], app[STEPS].counter.view()):
            stage["step"] = {k: v for k, v in steps.items() if k != "stage"}
    return view


async def _swarm(request: web.Request) -> web.Response:
    return web.json_response({"run_id": request.app[SETTINGS].run_id, **swarm_view(request.app)})


async def _health(request: web.Request) -> web.Response:
    """Status, live servers, the bytes the coordinator's own loops sent and received
    (averaging: control messages only; checkpoints: the states it saves), and
    ``placement_settled``: the live servers the latest rebalancing check saw if it found no
    move to order and no join or move under way, else 0 (0 too without rebalancing): a swarm
    formed, its placement done (what a bench waits for before it starts the clock)."""
    placement = request.app[PLACEMENT]
    return web.json_response(
        {
            "status": "ok",
            "servers": len(request.app[REGISTRY].live()),
            "placement_settled": placement["servers"] if placement["settled"] else 0,
            "traffic": request.app[TRAFFIC],
        }
    )


async def _run(request: web.Request) -> web.Response:
    """``GET /run``: the run's id, step and latest checkpoint, and the stage assignment."""
    return web.json_response(request.app[REGISTRY].run_state())


async def _average_now(request: web.Request) -> web.Response:
    """``POST /average``: once the step rounds running now have ended (a trainer asks before
    its final evaluation, which must see the run's last step applied), check that each
    stage's replicas are identical, repair those that drifted, and answer when the repairs
    ended: {checks: [{stage, verdict, replicas, steps, digests}],
    rounds: [{stage, round_id, members, accepted, ended}]}."""
    await request.app[STEPS].settled()
    scheduler = request.app[AVERAGING]
    rounds = await scheduler.average_now()
    return web.json_response({"checks": scheduler.checks, "rounds": [r.as_json() for r in rounds]})


async def _checkpoint_now(request: web.Request) -> web.Response:
    """``POST /checkpoint``: save the run now; 200 {path, step}, or 503 if a stage had no state."""
    path = await request.app[CHECKPOINTER].checkpoint_once()
    if path is None:
        raise Overloaded("no checkpoint: some stage has no live replica that gave its state", retry_after_s=5)
    return web.json_response({"path": str(path), "step": checkpoint.read_meta(path)["step"]})


def add_routes(app: web.Application) -> None:
    app[ASSIGN_LOCK] = asyncio.Lock()
    app[UTILISATION] = UtilisationBoard()
    app[SPARES] = {}
    app[PLACEMENT] = {"servers": 0, "settled": False}
    app.router.add_post("/register", _register)
    app.router.add_post("/assign", _assign)
    app.router.add_post("/heartbeat", _heartbeat)
    app.router.add_post("/deregister", _deregister)
    app.router.add_get("/swarm", _swarm)
    app.router.add_get("/run", _run)
    app.router.add_get("/health", _health)
    app.router.add_post("/average", _average_now)
    if CHECKPOINTER in app:
        app.router.add_post("/checkpoint", _checkpoint_now)
