"""App factory of the coordinator: the registry behind a JSON API, and the loop that expires leases."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time

import aiohttp
from aiohttp import web

from services.coordinator.admission import Admission
from services.coordinator.admission_routes import add_admission_routes
from services.coordinator.assignment import rebalancing_policy, swarm_view
from services.coordinator.averaging import AveragingScheduler
from services.coordinator.checkpointer import Checkpointer
from services.coordinator.completions import add_completion_routes, openai_middleware, outside_api
from services.coordinator.dashboard import EventRecorder, RecentEvents
from services.coordinator.dashboard_routes import DASHBOARD_PATHS, EVENTS, PROGRESS, add_dashboard_routes
from services.coordinator.metrics import CoordinatorMetrics
from services.coordinator.registry import RegisteredServer, Registry, ServerReport
from services.coordinator.routes import (
    ADMISSION,
    AVERAGING,
    CHECKPOINTER,
    LOG,
    MAX_BODY_BYTES,
    PLACEMENT,
    REGISTRY,
    SETTINGS,
    TRAFFIC,
    add_routes,
)
from services.coordinator.steps import STEPS, StepScheduler, add_step_routes
from shared import package_version
from shared.auth import OPEN_PATHS
from shared.config import CoordinatorSettings, advertised_url
from shared.errors import RemoteError
from shared.http import auth_middlewares, error_middleware, post_message, request_log_middleware, swarm_session
from shared.log import get_logger
from shared.metrics import Metrics, add_metrics_route, metrics_middleware
from shared.policy.move import Move

MOVE_SETTLE_S = 60.0  # how long a move of a link exchange may take before the second is left to a later check
MOVE_POLL_S = 0.25  # how often the registry is read meanwhile


def build_registry(settings: CoordinatorSettings) -> Registry:
    try:
        registry = Registry(
            settings.state_db,
            num_stages=settings.num_stages,
            heartbeat_s=settings.heartbeat_s,
            lease_heartbeats=settings.lease_heartbeats,
            max_servers=settings.max_servers,
        )
        registry.bind_run(settings.run_id)
        return registry
    except (sqlite3.Error, ValueError) as exc:
        raise ValueError(f"SWARM_STATE_DB={settings.state_db!r}: {exc}") from exc


def expire_leases(registry: Registry, log) -> list[RegisteredServer]:
    """Remove the servers whose lease ran out, one ``registry.expired`` line each."""
    expired = registry.expire()
    for server in expired:
        log.info(
            "registry.expired",
            server_id=server.server_id,
            stage=server.stage,
            url=server.url,
            last_heartbeat=server.last_heartbeat,
        )
    return expired


async def _expire_loop(registry: Registry, log) -> None:
    while True:
        await asyncio.sleep(registry.heartbeat_s)
        try:
            expire_leases(registry, log)
        except sqlite3.Error as exc:  # e.g. a locked or full disk: try again next period
            log.exception("registry.expire.failed", error=repr(exc))


def create_app(settings: CoordinatorSettings, registry: Registry | None = None) -> web.Application:
    """The coordinator app; a ``registry`` passed in stays the caller's to close."""
    log = EventRecorder(
        get_logger(service="coordinator", run=settings.run_id), RecentEvents()
    )  # its events feed the dashboard
    metrics = Metrics("coordinator", run_id=settings.run_id, version=package_version())
    # /v1/ (the OpenAI-compatible API) answers in OpenAI's error shape and takes a bearer token
    # instead of the swarm's signature
    signed = outside_api(auth_middlewares(settings, log, open_paths=OPEN_PATHS | DASHBOARD_PATHS))
    app = web.Application(
        client_max_size=MAX_BODY_BYTES,
        middlewares=[
            metrics_middleware(metrics),
            request_log_middleware(log),
            error_middleware(log),
            openai_middleware(settings, log),
            *signed,
        ],
    )
    app[SETTINGS] = settings
    app[REGISTRY] = registry if registry is not None else build_registry(settings)
    app[LOG] = log
    app[TRAFFIC] = {}
    add_dashboard_routes(app, log.events)
    add_completion_routes(app)
    add_metrics_route(app, metrics)
    CoordinatorMetrics(
        metrics,
        app[REGISTRY],
        app[EVENTS],
        app[PROGRESS],
        app[TRAFFIC],
        step_view=lambda: app[STEPS].counter.view() if STEPS in app else [],
    )

    async def lifecycle(app: web.Application):
        reg = app[REGISTRY]
        task = asyncio.create_task(_expire_loop(reg, log), name="registry.expire")
        log.info("coordinator.ready", num_stages=reg.num_stages, lease_s=reg.lease_s, servers=len(reg.live()))
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if registry is None:
            reg.close()
        log.info("coordinator.stopped")

    app.cleanup_ctx.append(lifecycle)
    app[AVERAGING] = AveragingScheduler(
        app[REGISTRY].live,
        every_s=settings.average_every_s,
        codec=settings.averaging_codec,
        timeout_s=settings.averaging_timeout_s,
        log=log,
        aggregator=settings.averaging_aggregator,
    )
    app.cleanup_ctx.append(_averaging(settings))
    app[STEPS] = StepScheduler(
        settings.num_stages,
        app[REGISTRY].live,
        codec=settings.averaging_codec,
        timeout_s=settings.step_timeout_s,
        aggregator=settings.averaging_aggregator,
        log=log,
        lease_s=app[REGISTRY].lease_s,
        reported_step=lambda server: app[REGISTRY].reports.get(server.server_id, ServerReport()).step,
        store=app[REGISTRY],  # the duplicate window survives a restart in the run's state file
        error_feedback=settings.error_feedback,
        lookahead=_lookahead(settings),  # a stage moves with its round's first member (see steps.py)
    )
    app.cleanup_ctx.append(_steps())
    app.on_shutdown.append(_stop_waiting_for_steps)
    app[ADMISSION] = Admission(
        global_batch=0,  # as the servers report it (SWARM_GLOBAL_BATCH), see add_admission_routes
        lookahead=_lookahead(settings),
        lease_s=settings.step_timeout_s,  # an admission not renewed for a step timeout: its trainer is gone
        clock=time.monotonic,
    )
    add_step_routes(app, run_id=settings.run_id, num_stages=settings.num_stages, admitted_floor=app[ADMISSION].floor)
    add_admission_routes(
        app,
        swarm_step=lambda: min(st.step for st in app[STEPS].counter.stages),
        global_batch=lambda: _global_batch(app),
        wait_changed=app[STEPS].wait_changed,
        closing=lambda: app[STEPS].closing,
        timeout_s=settings.step_timeout_s,
    )
    if settings.rebalance_every_s > 0:
        app.cleanup_ctx.append(_rebalancing(settings, log))
    if settings.checkpoint_dir:
        app[CHECKPOINTER] = Checkpointer(
            app[REGISTRY],
            root=settings.checkpoint_dir,
            run_id=settings.run_id,
            keep=settings.keep_checkpoints,
            timeout_s=settings.checkpoint_every_s,
            log=log,
            stage_steps=lambda: [st.step for st in app[STEPS].counter.stages],
        )
        app.cleanup_ctx.append(_checkpoints(settings))
    add_routes(app)  # the registry's, averaging's and checkpoints' handlers (routes.py)
    if settings.mdns:
        app.cleanup_ctx.append(_announcement(settings))
    return app


def _lookahead(settings) -> int:
    """The admission's lookahead: steps past the swarm's that admit microbatches (0: ``sync``)."""
    return 0 if settings.schedule == "sync" else settings.max_staleness


def _global_batch(app: web.Application) -> int:
    """The run's global batch as its stage servers said it (0: none said it yet)."""
    counted = [st.global_batch for st in app[STEPS].counter.stages if st.global_batch]
    reported = [r.samples_per_step for r in app[REGISTRY].reports.values() if r.samples_per_step]
    return max(counted or reported or [0])


async def _stop_waiting_for_steps(app: web.Application) -> None:
    """On SIGTERM, before aiohttp waits for the handlers in flight: those waiting for a step
    answer now, rather than hold the exit for up to ``step_timeout_s``."""
    await app[STEPS].close()


def _steps():
    """Step rounds with their own client session (its bytes counted as 'steps': control only)."""
    return _background("steps", lambda app, session: app[STEPS].run(session))


def _averaging(settings: CoordinatorSettings):
    """Averaging passes every ``average_every_s`` (0: only when ``POST /average`` asks)."""

    return _background("averaging", lambda app, session: app[AVERAGING].run(session))


def _rebalancing(settings: CoordinatorSettings, log):
    """Every ``rebalance_every_s``: the policy's moves (``RebalancingPolicy.check``, confirmed
    on consecutive checks), if any, are ordered: each server drains, switches stage, loads
    that stage's state, rejoins.

    A stage short of replicas (none, or one while the swarm has two servers a stage) gets
    one first; else, with topology placement (see ``placement.py``), the network cost model
    replans, moving a few servers at most; else the single move that raises the weakest
    stage's capacity (or, every stage at its replica floor, the exchange of two replicas
    that does); a slow link in the weakest stage changes places with a fast one of about its
    speed (``shared.policy.links``: the fast one moves first, the slow one once the other
    serves at its new stage). Each move is logged with the policy's reason, and so is a move the policy
    holds back (``rebalance.held``, when its reason changes); a moving server's new stage
    counts as handed out until it registers there."""

    async def loop(registry: Registry, placement: dict, session: aiohttp.ClientSession) -> None:
        policy = rebalancing_policy(settings)
        held = None
        while True:
            await asyncio.sleep(settings.rebalance_every_s)
            live = registry.live()
            url_of = {s.server_id: s.url for s in live}
            view = swarm_view(registry, settings, live)
            try:
                moves = await asyncio.to_thread(policy.check, view)
            except (ValueError, KeyError) as exc:  # inputs the planner cannot work with: say so, keep the loop
                log.error("rebalance.failed", error=repr(exc), servers=len(view.replicas))
                continue
            placement.update(servers=len(view.replicas), settled=not moves and not view.pending)
            if policy.held != held and policy.held is not None:
                log.info("rebalance.held", reason=policy.held, servers=len(view.replicas))
            held = policy.held
            if policy.replan is not None:
                log.info(
                    "rebalance.replan",
                    cost_before_s=round(policy.replan.cost_before_s, 4),
                    cost_after_s=round(policy.replan.cost_after_s, 4),
                    moves=len(moves),
                    deferred=len(policy.deferred),
                    servers=len(view.replicas),
                )
            mode = "throughput" if view.topology is None else "topology"
            if policy.in_turn:  # each once the one before serves at its new stage
                for n, move in enumerate(moves):
                    if n and not await _serving_at(registry, url_of[moves[n - 1].server_id], moves[n - 1].to_stage):
                        log.warning("rebalance.move.abandoned", server_id=move.server_id, after=moves[n - 1].server_id)
                        break
                    _log_move(log, move, url_of, registry, mode)
                    await _order_move(session, settings, url_of[move.server_id], move, log)
                continue
            for move in moves:
                _log_move(log, move, url_of, registry, mode)
            await asyncio.gather(*(_order_move(session, settings, url_of[m.server_id], m, log) for m in moves))

    return _background("rebalancing", lambda app, session: loop(app[REGISTRY], app[PLACEMENT], session))


def _log_move(log, move: Move, url_of: dict[str, str], registry: Registry, placement: str) -> None:
    """Log the move with the policy's reason; its new stage counts as handed out until the server registers there."""
    figures = {"placement": placement}
    if move.capacity_before is not None:
        figures["capacity_before"] = round(move.capacity_before, 1)
        figures["capacity_after"] = round(move.capacity_after, 1)
    log.info(
        "rebalance.move",
        server_id=move.server_id,
        replica=url_of[move.server_id],
        from_stage=move.from_stage,
        to_stage=move.to_stage,
        reason=move.reason,
        **figures,
    )
    registry.hand_out(move.to_stage)


async def _order_move(session: aiohttp.ClientSession, settings: CoordinatorSettings, url: str, move: Move, log) -> None:
    """``POST /move`` to the server; a refusal or an unreachable server is logged (the next check plans again)."""
    body = {"run_id": settings.run_id, "stage": move.from_stage, "to_stage": move.to_stage}
    try:
        await post_message(session, url + "/move", body, timeout_s=10)
    except RemoteError as exc:
        log.warning("rebalance.move.failed", server_id=move.server_id, error=str(exc))


async def _serving_at(registry: Registry, url: str, stage: int, timeout_s: float = MOVE_SETTLE_S) -> bool:
    """Whether the server at ``url`` registers at ``stage`` (a moved server keeps its address)
    within ``timeout_s``: the registry is polled, a few times a second."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        if any(s.url == url and s.stage == stage for s in registry.live()):
            return True
        await asyncio.sleep(MOVE_POLL_S)
    return False


def _checkpoints(settings: CoordinatorSettings):
    """Save the run every ``checkpoint_every_s`` (and on ``POST /checkpoint``)."""

    async def loop(app: web.Application, session: aiohttp.ClientSession) -> None:
        app[CHECKPOINTER].session = session
        await app[CHECKPOINTER].run(settings.checkpoint_every_s)

    return _background("checkpoints", loop)


def _background(name: str, run):
    """A cleanup_ctx that runs ``run(app, session)`` as a task with its own client session,
    cancelled and awaited when the app stops. The session counts the bytes it moves into
    ``app[TRAFFIC][name]``."""

    async def ctx(app: web.Application):
        counts = app[TRAFFIC].setdefault(name, {"sent": 0, "received": 0})
        async with swarm_session(app[SETTINGS], trace_configs=[_byte_counter(counts)]) as session:
            task = asyncio.create_task(run(app, session), name=name)
            yield
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    return ctx


def _byte_counter(counts: dict) -> aiohttp.TraceConfig:
    async def sent(_session, _ctx, params) -> None:
        counts["sent"] += len(params.chunk)

    async def received(_session, _ctx, params) -> None:
        counts["received"] += len(params.chunk)

    trace = aiohttp.TraceConfig()
    trace.on_request_chunk_sent.append(sent)
    trace.on_response_chunk_received.append(received)
    return trace


def _announcement(settings: CoordinatorSettings):
    """Announce the coordinator on the LAN (mDNS) so servers and trainers find it unconfigured."""

    async def ctx(app: web.Application):
        from shared.discovery import COORDINATOR_TYPE, Announcer

        url = advertised_url(settings.host, settings.port, settings.advertise_url, tls=settings.tls)
        async with Announcer(settings.mdns_interfaces) as announcer:
            await announcer.start(
                COORDINATOR_TYPE, f"coordinator-{settings.run_id}-{settings.port}", url, {"run_id": settings.run_id}
            )
            yield

    return ctx
