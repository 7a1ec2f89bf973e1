"""App factory of the stage server."""

from __future__ import annotations

import asyncio

from aiohttp import web

from shared import codec
from shared.config import StageServerSettings
from shared.http import error_middleware
from shared.log import get_logger
from services.stage_server.routes import RUNTIME, SETTINGS, WORKER, add_routes
from services.stage_server.runtime import OptimizerConfig, StageRuntime
from services.stage_server.worker import ComputeWorker


def build_runtime(settings: StageServerSettings) -> StageRuntime:
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
    return app
