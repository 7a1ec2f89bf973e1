"""App factory of the stage server."""

from __future__ import annotations

import asyncio

from aiohttp import web

from services.stage_server.allreduce import AVERAGER, add_allreduce_routes, finish_rounds
from services.stage_server.chain import add_chain_routes
from services.stage_server.latency import LatencyProbe
from services.stage_server.local_sync import OuterConfig
from services.stage_server.membership import Membership
from services.stage_server.memory import check_stage_memory
from services.stage_server.metrics import STAGE_METRICS, StageMetrics
from services.stage_server.move import MoveOrder
from services.stage_server.recovery import Neighbour, checkfree_weights, neighbour_stages
from services.stage_server.routes import MOVE, RUNTIME, SETTINGS, STEPPER, WORKER, add_routes
from services.stage_server.runtime import ComputeWorker, OptimizerConfig, StageRuntime
from services.stage_server.sessions import add_session_routes
from services.stage_server.state import StepSnapshots, load_stage_state, stage_state
from services.stage_server.state_routes import add_state_routes, download_state, state_from_peers
from services.stage_server.stepping import StepClient, StepRound
from services.stage_server.utilisation import StageUtilisation
from shared import checkpoint, package_version
from shared.config import StageServerSettings, advertised_url
from shared.errors import RemoteError
from shared.hf import load_stage_from_hf
from shared.http import (
    auth_middlewares,
    error_middleware,
    from_any_replica,
    get_json,
    request_log_middleware,
    swarm_session,
)
from shared.log import get_logger
from shared.metrics import Metrics, add_metrics_route, metrics_middleware
from shared.model import PRESETS, partition

MEMBERSHIP = web.AppKey("membership", Membership)
_DEPARTURE = web.AppKey("departure", object)  # _Departure: leave() runs once


def build_runtime(settings: StageServerSettings) -> StageRuntime:
    if not isinstance(settings.stage, int):
        raise ValueError("SWARM_STAGE=auto must be resolved by the coordinator before the server is built")
    if settings.stage >= settings.num_stages:
        raise ValueError(f"SWARM_STAGE={settings.stage} but the model has SWARM_NUM_STAGES={settings.num_stages}")
    cfg = settings.gpt_config()
    spec = partition(cfg, settings.num_stages)[settings.stage]
    lora = settings.lora.config()
    if settings.memory_check:
        check_stage_memory(cfg, spec, settings.device, max_staleness=settings.max_staleness, lora=lora)
    model, report = (
        load_stage_from_hf(settings.model, cfg, spec, settings.device)
        if settings.model not in PRESETS
        else (None, None)
    )
    runtime = StageRuntime(
        cfg,
        settings.stage,
        settings.num_stages,
        seed=settings.seed,
        optim=OptimizerConfig(
            lr=settings.lr,
            weight_decay=settings.weight_decay,
            name=settings.optimizer,
            betas=(settings.beta1, OptimizerConfig.betas[1]),
            global_batch=settings.global_batch,
            warmup_steps=settings.warmup_steps,
            schedule=settings.lr_schedule,
            total_steps=settings.total_steps,
            min_lr_ratio=settings.min_lr_ratio,
            max_grad_norm=settings.max_grad_norm,
            recovery_warmup_steps=settings.recovery_warmup_steps,
        ),
        device=settings.device,
        cache_size=settings.backward_cache,
        max_staleness=settings.max_staleness,
        solo=not settings.coordinator,  # no coordinator counts the stage's samples: this server steps on its own
        outer=OuterConfig(settings.local_steps, settings.outer_lr, settings.outer_momentum)
        if settings.sync == "local"
        else None,
        model=model,
        precision=settings.precision,
        activation_checkpointing=settings.activation_checkpointing,
        lora=lora,
    )
    runtime.load_report = report
    if settings.step_snapshot_dir:
        runtime.on_step = StepSnapshots(settings.step_snapshot_dir)
    return runtime


def create_app(settings: StageServerSettings, runtime: StageRuntime | None = None) -> web.Application:
    log = get_logger(
        service="stage_server",
        run=settings.run_id,
        stage=settings.stage,
        replica=settings.advertise_url or f"http://{settings.host}:{settings.port}",
    )
    max_bytes = int(settings.max_body_mb * 2**20)
    metrics = Metrics("stage_server", run_id=settings.run_id, stage=str(settings.stage), version=package_version())
    app = web.Application(
        client_max_size=max_bytes,
        middlewares=[
            metrics_middleware(metrics),
            request_log_middleware(log),
            error_middleware(log),
            *auth_middlewares(settings, log),
        ],
    )
    app[SETTINGS] = settings
    app[RUNTIME] = runtime if runtime is not None else build_runtime(settings)
    app[WORKER] = ComputeWorker(settings.max_queue, inject_delay_s=settings.inject.delay_s)
    app[MOVE] = MoveOrder()
    add_routes(app)
    add_chain_routes(app, settings)
    add_session_routes(app, settings)
    add_allreduce_routes(app)
    app[AVERAGER].kinds["step"] = StepRound(app[AVERAGER])  # global steps (stepping.py)
    add_state_routes(app)
    add_metrics_route(app, metrics)
    app[STAGE_METRICS] = StageMetrics(
        metrics,
        app[RUNTIME],
        app[WORKER],
        app[AVERAGER],
        StageUtilisation.for_runtime(app[RUNTIME], settings.peak_tflops),
    )

    async def lifecycle(app: web.Application):
        spec = app[RUNTIME].spec
        if (report := getattr(app[RUNTIME], "load_report", None)) is not None:
            log.info(
                "stage.weights_loaded", model_dir=report.model_dir, tensors=len(report.names), bytes=report.bytes_read
            )
        if (lora := app[RUNTIME].lora_report) is not None:
            log.info(
                "stage.lora",
                targets=len(lora.targets),
                trainable=lora.trainable,
                frozen=lora.frozen,
                base_fingerprint=lora.base_fingerprint,
            )
            if not lora.targets:
                log.warning(
                    "stage.lora_no_target",
                    reason="no SWARM_LORA_TARGET_MODULES module is in this stage: it trains nothing and passes "
                    "gradients on to earlier stages",
                )
        log.info("server.ready", layers=[spec.layers.start, spec.layers.stop], codec=settings.wire_codec)
        yield
        drained = await app[WORKER].drain(settings.drain_timeout_s)
        app[WORKER].close()
        log.info("server.stopped", drained=drained, stats=app[RUNTIME].stats.__dict__)

    app.cleanup_ctx.append(lifecycle)
    app.cleanup_ctx.append(_join(settings, log))
    if settings.coordinator:
        app.cleanup_ctx.append(_membership(settings, log))
    if settings.mdns:
        app.cleanup_ctx.append(_announcement(settings))
    app[_DEPARTURE] = _Departure(settings, log)
    app.on_shutdown.append(leave)
    return app


def _load(app: web.Application):
    """(throughput in samples per busy second, queue length): what the heartbeat reports."""
    worker, runtime = app[WORKER], app[RUNTIME]
    return lambda: (runtime.stats.samples / worker.busy_s if worker.busy_s else 0.0, worker.queue_depth)


def _report(settings: StageServerSettings, app: web.Application):
    """What the coordinator needs to know of this server, beyond its load: where it is, the
    work of its stage (parameters averaged, samples per optimizer step, measured wire bytes
    per sample of the activation crossing its boundary), and its global step."""
    parameters = sum(p.numel() for p in app[RUNTIME].params)
    stage_metrics = app[STAGE_METRICS]

    def report() -> dict:
        workload = {
            "parameters": parameters,
            "samples_per_step": settings.global_batch,
            "activation_bytes_per_sample": round(stage_metrics.activation_bytes_per_sample, 3),
        }
        # step: the coordinator leaves a replica out of a step round it has not reached
        # (e.g. a joiner that took a peer's state a step ago)
        return {
            "workload": workload,
            "step": app[RUNTIME].step,
            "utilisation": stage_metrics.utilisation.report(),  # MFU, shown by swarm status and the dashboard
            **({"region": settings.region} if settings.region else {}),
            **({"speed_flops": settings.speed_flops} if settings.speed_flops else {}),
            **({"link_mbit": settings.link_mbit} if settings.link_mbit else {}),
        }

    return report


def _membership(settings: StageServerSettings, log):
    async def ctx(app: web.Application):
        async with swarm_session(settings) as session:
            membership = Membership(
                session,
                settings.coordinator,
                run_id=settings.run_id,
                stage=settings.stage,
                url=advertised_url(settings.host, settings.port, settings.advertise_url, tls=settings.tls),
                version=package_version(),
                heartbeat_s=settings.heartbeat_s,
                load=_load(app),
                log=log,
                probe=LatencyProbe(
                    session,
                    settings.coordinator,
                    stage=settings.stage,
                    own_url=advertised_url(settings.host, settings.port, settings.advertise_url, tls=settings.tls),
                ),
                report=_report(settings, app),
            )
            app[MEMBERSHIP] = membership
            app[STEPPER] = StepClient.for_server(app, settings, session, log)
            task = asyncio.create_task(membership.run())
            yield
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await app[STEPPER].close()
            await membership.deregister()  # no-op if the drain already did it

    return ctx


def _join(settings: StageServerSettings, log):
    """Before serving (and registering): take the stage's current state from a live replica
    (weights and optimizer state); else, every replica of the stage being gone, recover it
    as ``SWARM_RECOVERY`` says (see :func:`_recover`)."""

    async def ctx(app: web.Application):
        runtime = app[RUNTIME]
        state = await state_from_peers(settings, log) if settings.coordinator else None
        source = "peer" if state else None
        if state is None:
            state, source = await _recover(settings, app, log)
        if state is not None:
            await app[WORKER].run(load_stage_state, runtime, *state)
            log.info("stage.joined", source=source, optimizer_steps=runtime.stats.optimizer_steps)
        yield

    return ctx


async def _recover(settings: StageServerSettings, app: web.Application, log) -> tuple[tuple | None, str | None]:
    """(state, source) for a stage none of whose replicas has state to give, or (None, None)
    to start from the initial weights. ``checkpoint``: the stage's newest state saved (the
    latest checkpoint's, or a newer one the checkpointer kept when another stage had none, if
    not past the stage's step in the swarm).
    ``checkfree``: the neighbouring stages' weights averaged (``recovery.py``) when they have
    trained past the latest checkpoint (at the run's start, or on a checkpoint as new as they
    are, nothing is lost: the checkpoint, or the initial weights, are right); else as
    ``checkpoint``. ``fresh``: the initial weights. The server then catches up the stage's
    step number; with fresh moments its learning rate warms up again."""
    newest = None
    if settings.checkpoint_dir and settings.recovery != "fresh":
        swarm_step = await _swarm_stage_step(settings, log) if settings.coordinator else None
        newest = checkpoint.newest_stage_file(settings.checkpoint_dir, settings.stage, not_past=swarm_step)
    ckpt, data = None, None
    if newest is not None:  # the latest checkpoint's, or a newer state kept
        ckpt = newest[0]
        data = await asyncio.to_thread(ckpt.read_bytes)
    if settings.recovery == "checkfree" and settings.coordinator:
        # the header alone: the tensors are decoded only if the checkpoint is what gets loaded
        checkpoint_step = checkpoint.state_metadata(data)["optimizer_steps"] if data is not None else None
        rebuilt = await _checkfree_state(settings, app, log, checkpoint_step)
        if rebuilt is not None:
            return rebuilt, "checkfree"
    if data is None:
        return None, None
    return await asyncio.to_thread(checkpoint.state_from_bytes, data), str(ckpt)


async def _swarm_stage_step(settings: StageServerSettings, log) -> int | None:
    """The stage's global step as the coordinator counts it, or None if it does not say."""
    async with swarm_session(settings) as session:
        try:
            view = await get_json(session, settings.coordinator + "/swarm", timeout_s=10)
            return int(view["stages"][settings.stage]["step"]["step"])
        except (RemoteError, KeyError, IndexError, TypeError, ValueError) as exc:
            log.warning("stage.recovery.no_step", error=repr(exc))
            return None


async def _checkfree_state(settings: StageServerSettings, app: web.Application, log, checkpoint_step: int | None):
    """The stage rebuilt from its neighbours' live states (``recovery.checkfree_weights``), as
    a state to load (fresh AdamW moments), or None: a neighbour is missing or untrained, the
    checkpoint is as new as they are, or their cuts do not fit."""
    runtime = app[RUNTIME]
    neighbours: list[Neighbour] = []
    steps: list[int] = []  # the neighbours' global steps
    async with swarm_session(settings) as session:
        try:
            view = await get_json(session, settings.coordinator + "/swarm", timeout_s=10)
        except RemoteError as exc:
            log.warning("stage.recovery.no_view", error=repr(exc))
            return None
        for j in neighbour_stages(settings.stage, settings.num_stages):
            got = await from_any_replica(
                [r["url"] for r in view["stages"][j]["replicas"]],
                lambda url: download_state(session, url, settings.join_timeout_s),
                deadline_s=settings.join_timeout_s,
                on_error=lambda url, exc: log.warning("stage.recovery.download_failed", replica=url, error=str(exc)),
            )
            if got is not None:
                tensors, meta = got
                neighbours.append(Neighbour(j, range(*meta["layers"]), tensors, float(meta.get("grad_norm") or 0.0)))
                steps.append(int(meta["optimizer_steps"]))
    if not neighbours or max(steps) == 0 or (checkpoint_step is not None and checkpoint_step >= max(steps)):
        log.info("stage.recovery.no_rebuild", neighbours=len(neighbours), steps=steps, checkpoint_step=checkpoint_step)
        return None
    own, meta = await app[WORKER].run(stage_state, runtime)
    try:
        tensors, done = checkfree_weights(
            own, settings.stage, settings.num_stages, runtime.spec.layers, neighbours, tied=runtime.cfg.tie_embeddings
        )
    except ValueError as exc:
        log.warning("stage.recovery.no_rebuild", reason=str(exc))
        return None
    log.warning("stage.recovered", how="checkfree", neighbour_steps=steps, **done)
    return tensors, {**meta, "adam_step": {}, "caught_up": [], "recovered_at": None}


def _announcement(settings: StageServerSettings):
    async def ctx(app: web.Application):
        from shared.discovery import STAGE_TYPE, Announcer

        url = advertised_url(settings.host, settings.port, settings.advertise_url, tls=settings.tls)
        async with Announcer(settings.mdns_interfaces) as announcer:
            await announcer.start(
                STAGE_TYPE,
                f"stage{settings.stage}-{settings.port}-{settings.run_id}",
                url,
                {"run_id": settings.run_id, "stage": str(settings.stage)},
            )
            yield

    return ctx


async def leave(app: web.Application) -> None:
    """Leave the swarm, once: 503 to new work; a step round under way here ends; the averager
    takes no round more; the server leaves the registry; what was accepted finishes. A server
    leaves while it still listens (``__main__.serve_stage`` calls this before it stops
    listening): its step round's peers fetch its reduction from it. The app's shutdown calls
    it too (first, for an app stopped some other way; else a no-op)."""
    await app[_DEPARTURE].run(app)


class _Departure:
    def __init__(self, settings: StageServerSettings, log):
        self.settings, self.log = settings, log
        self._task: asyncio.Future | None = None

    async def run(self, app: web.Application) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._leave(app))
        await asyncio.shield(self._task)

    async def _leave(self, app: web.Application) -> None:
        worker = app[WORKER]
        worker.draining = True  # a step round's compute jobs pass (they are unbounded)
        self.log.info("server.draining", in_flight=worker.queue_depth)
        await finish_rounds(app)
        if MEMBERSHIP in app:
            await app[MEMBERSHIP].deregister()
        await worker.drain(self.settings.drain_timeout_s)
