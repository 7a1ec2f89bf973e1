"""App factory of the stage server."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from shared import codec, package_version
from shared.config import StageServerSettings, advertised_url
from shared.http import error_middleware
from shared.log import get_logger
from services.stage_server.membership import Membership
from services.stage_server.routes import RUNTIME, SETTINGS, WORKER, add_routes
from services.stage_server.runtime import OptimizerConfig, StageRuntime
from services.stage_server.worker import ComputeWorker

MEMBERSHIP = web.AppKey("membership", Membership)


def build_runtime(settings: StageServerSettings) -> StageRuntime:
    if not isinstance(settings.stage, int):
        raise ValueError("SWARM_STAGE=auto must be resolved by the coordinator before the server is built")
    if settings.stage >= settings.num_stages:
        raise ValueError(f"SWARM_STAGE={settings.stage} but the model has SWARM_NUM_STAGES={settings.num_stages}")
    return StageRuntime(
        settings.gpt_config(),
        settings.stage,
        settings.num_stages,
        seed=settings.seed,
        optim=OptimizerConfig(
            lr=settings.lr, weight_decay=settings.weight_decay, samples_per_step=settings.samples_per_step, warmup_steps=settings.warmup_steps
        ),
        device=settings.device,
        cache_size=settings.backward_cache,
    )


def create_app(settings: StageServerSettings, runtime: StageRuntime | None = None) -> web.Application:
    log = get_logger(service="stage_server", run=settings.run_id, stage=settings.stage)
    max_bytes = int(settings.max_body_mb * 2**20)
    app = web.Application(client_max_size=max_bytes, middlewares=[error_middleware(log)])
    app[SETTINGS] = settings
    app[RUNTIME] = runtime if runtime is not None else build_runtime(settings)
    app[WORKER] = ComputeWorker(settings.max_queue, inject_delay_s=settings.inject_delay_s)
    add_routes(app)

    async def lifecycle(app: web.Application):
        spec = app[RUNTIME].spec
        if settings.wire_codec == "int8":
            await asyncio.to_thread(codec.warm_up)
        log.info("server.ready", layers=[spec.layers.start, spec.layers.stop], codec=settings.wire_codec)
        yield
        drained = await app[WORKER].drain(settings.drain_timeout_s)
        app[WORKER].close()
        log.info("server.stopped", drained=drained, stats=app[RUNTIME].stats.__dict__)

    app.cleanup_ctx.append(lifecycle)
    if settings.coordinator:
        app.cleanup_ctx.append(_membership(settings, log))
    if settings.mdns:
        app.cleanup_ctx.append(_announcement(settings))
    app.on_shutdown.append(_drain(settings, log))
    return app


def _load(app: web.Application):
    """(throughput in samples per busy second, queue length): what the heartbeat reports."""
    worker, runtime = app[WORKER], app[RUNTIME]
    return lambda: (runtime.stats.samples / worker.busy_s if worker.busy_s else 0.0, worker.queue_depth)


def _membership(settings: StageServerSettings, log):
    async def ctx(app: web.Application):
        async with aiohttp.ClientSession() as session:
            membership = Membership(
                session, settings.coordinator, run_id=settings.run_id, stage=settings.stage,
                url=advertised_url(settings.host, settings.port, settings.advertise_url), version=package_version(),
                heartbeat_s=settings.heartbeat_s, load=_load(app), log=log,
            )
            app[MEMBERSHIP] = membership
            task = asyncio.create_task(membership.run())
            yield
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await membership.deregister()  # no-op if the drain already did it

    return ctx


def _announcement(settings: StageServerSettings):
    async def ctx(app: web.Application):
        from shared.discovery import STAGE_TYPE, Announcer

        url = advertised_url(settings.host, settings.port, settings.advertise_url)
        async with Announcer(settings.mdns_interfaces) as announcer:
            await announcer.start(STAGE_TYPE, f"stage{settings.stage}-{settings.port}-{settings.run_id}", url, {"run_id": settings.run_id, "stage": str(settings.stage)})
            yield

    return ctx


def _drain(settings: StageServerSettings, log):
    """On shutdown: 503 to new work, leave the registry at once, finish what was accepted."""

    async def on_shutdown(app: web.Application) -> None:
        worker = app[WORKER]
        worker.draining = True
        log.info("server.draining", in_flight=worker.queue_depth)
        if MEMBERSHIP in app:
            await app[MEMBERSHIP].deregister()
        await worker.drain(settings.drain_timeout_s)

    return on_shutdown
