"""``swarm server`` / ``python -m services.stage_server``: serve one stage.

With a coordinator (``--coordinator URL``, or found by mDNS when none is given) the
server registers and heartbeats; ``--stage auto`` lets the coordinator pick the stage
where a loss would hurt most; ``--stage standby`` waits, torch imported and nothing built,
until the coordinator hands it a stage left with fewer than two replicas (a fast join:
``bench/joins.py``). SIGTERM or Ctrl-C drains: 503 to new work, deregistration,
then the accepted requests finish before the process exits. A move ordered by the
coordinator (``POST /move``) drains the same way, then :func:`serve` starts the server
again, in this process, for the new stage (the steps: ``move.py``).
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import os
import signal
import sys
from collections.abc import Awaitable
from ssl import SSLContext
from typing import TypeVar

import torch
from aiohttp import web, web_app

from services.stage_server.app import create_app, leave
from services.stage_server.latency import probe_swarm
from services.stage_server.membership import assign_stage, wait_for_stage
from services.stage_server.routes import MOVE
from shared.config import StageServerSettings, parse_settings
from shared.errors import RemoteError
from shared.http import cannot_listen, check_can_listen, server_ssl_context, swarm_session
from shared.log import configure_logging, get_logger
from shared.peak_flops import sustained_flops

T = TypeVar("T")


def warm_up() -> None:
    """Pay torch's one-time costs before a stage is known (a standby's wait): the first AdamW
    of a process imports ``torch._dynamo``, 0.8 s of a 1.1 s build of the tiny model's stage
    here (``bench/joins.py``)."""
    param = torch.zeros(1, requires_grad=True)
    param.grad = torch.zeros(1)
    torch.optim.AdamW([param]).step()


async def resolve(settings: StageServerSettings, log) -> StageServerSettings:
    """Fill in the coordinator URL (mDNS) and the stage (``auto``) before the server is built."""
    coordinator = settings.coordinator
    if not coordinator and settings.mdns:
        from shared.discovery import find_coordinator

        coordinator = (
            await find_coordinator(
                settings.run_id, interfaces_spec=settings.mdns_interfaces, timeout_s=settings.mdns_timeout_s
            )
            or ""
        )
        log.info("coordinator.discovered" if coordinator else "coordinator.not_found", url=coordinator or None)
    stage = settings.stage
    if stage == "standby":
        if not coordinator:
            raise ValueError(
                "SWARM_STAGE=standby needs a coordinator: set SWARM_COORDINATOR or run one on this LAN with mDNS"
            )
        warm_up()
        log.info("standby.waiting", coordinator=coordinator)
        async with swarm_session(settings) as session:
            stage = await wait_for_stage(session, coordinator, settings.run_id, region=settings.region, log=log)
    elif stage == "auto":
        if not coordinator:
            raise ValueError(
                "SWARM_STAGE=auto needs a coordinator: set SWARM_COORDINATOR or run one on this LAN with mDNS"
            )
        if not settings.speed_flops:  # what this process gets (its CPU cap, its neighbours): placement's input
            speed = await asyncio.to_thread(sustained_flops, torch.device(settings.device), settings.precision)
            settings = settings.model_copy(update={"speed_flops": speed})
        async with swarm_session(settings) as session:
            rtt_ms = await probe_swarm(session, coordinator)  # the coordinator places by the network where it can
            stage = await assign_stage(
                session,
                coordinator,
                settings.run_id,
                region=settings.region,
                rtt_ms=rtt_ms,
                speed_flops=settings.speed_flops,
                link_mbit=settings.link_mbit,
                timeout_s=settings.join_timeout_s,
                log=log,
            )
        log.info(
            "stage.assigned",
            stage=stage,
            region=settings.region or None,
            peers_timed=len(rtt_ms),
            speed_gflops=round(settings.speed_flops / 1e9, 3),
            link_mbit=settings.link_mbit or None,
        )
    return settings.model_copy(update={"coordinator": coordinator, "stage": stage})


MALLOC_ARENAS = 2  # glibc heap arenas a stage server's threads share (glibc's default: 8 per core)


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Cap glibc's heap arenas (``mallopt(M_ARENA_MAX)``), unless ``MALLOC_ARENA_MAX`` is set
    (glibc then reads it itself); whether the cap was set. Each thread that allocates (the
    event loop, the compute worker, aiohttp's and torch's) otherwise gets an arena of its
    own, each growing to its own high-water mark: under the chaos suite's 32-stream load a
    server's RSS climbed 100-200 MB over half a minute and flattened (40-60 MB in the
    second half alone), and with two arenas it stayed 60-70 MB lower and grew 3-22 MB.
    Nothing to do where the C library is not glibc."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_arena_max = -8  # M_ARENA_MAX in glibc's malloc.h
    return mallopt(m_arena_max, arenas) == 1


def main(
    argv: list[str] | None = None,
    *,
    settings_class: type[StageServerSettings] = StageServerSettings,
) -> int:
    """Serve until stopped. ``settings_class`` lets a variant of the server (the benches'
    ``bench.stage_proc``) run the same way, moves included."""
    settings = parse_settings(settings_class, argv, "swarm server", "Serve one pipeline stage over HTTP.")
    configure_logging(settings.log_format, settings.log_level)
    limit_malloc_arenas()  # before the server's threads allocate
    torch.set_num_threads(settings.num_threads)
    try:
        asyncio.run(_run(settings))
    except (ValueError, RemoteError) as exc:
        print(f"swarm server: {exc}", file=sys.stderr)
        return 2
    return 0


async def _run(settings: StageServerSettings) -> None:
    check_can_listen(settings.host, settings.port)  # before the stage is built and its state downloaded
    settings = await resolve(settings, get_logger(service="stage_server", run=settings.run_id))
    ssl_context = server_ssl_context(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await serve(settings, stop, ssl_context=ssl_context)


async def serve(settings: StageServerSettings, stop: asyncio.Event, *, ssl_context: SSLContext | None = None) -> None:
    """Serve ``settings.stage`` until ``stop`` is set. A move ordered by the coordinator
    (``POST /move``) shuts the server down as ``stop`` would, then this loop serves the new
    stage at the same address (``move.py`` has the steps)."""
    while not stop.is_set():
        to_stage = await serve_stage(settings, stop, ssl_context)
        if to_stage is None:
            return
        log = get_logger(service="stage_server", run=settings.run_id, stage=settings.stage)
        log.info("server.moving", to_stage=to_stage)
        settings = settings.model_copy(update={"stage": to_stage})
        _release_stopped_apps()  # the old stage's weights go before the new stage's are built


def _release_stopped_apps() -> None:
    """Free the apps that were shut down, and the weights they hold, now: aiohttp keeps every
    app whose handlers ran in a cache of handlers wrapped in their middlewares (1024 entries),
    and an app's objects refer to each other (cycles)."""
    cache = getattr(web_app, "_cached_build_middleware", None)  # aiohttp's, private: nothing to clear once gone
    if cache is not None:
        cache.cache_clear()
    gc.collect()


async def serve_stage(settings: StageServerSettings, stop: asyncio.Event, ssl_context: SSLContext | None) -> int | None:
    """Run the app of ``settings.stage`` until ``stop`` is set or a move is ordered, then shut
    it down; the stage ordered (None: stopped).

    Starting the app joins the stage (downloads its state from a live replica, ``app._join``)
    and starts the membership (registration, heartbeats); shutting it down answers 503 to new
    work, ends a step round under way, deregisters and finishes the accepted requests while it
    still listens (``app.leave``), then stops listening and stops the background tasks (the
    ``cleanup_ctx`` of ``app.create_app``)."""
    app = create_app(settings)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=settings.drain_timeout_s)
    listening = False
    try:
        await _unless_stopped(runner.setup(), stop)  # joining may take join_timeout_s: a stop cuts it short
        if stop.is_set():
            return None
        try:
            await web.TCPSite(runner, settings.host, settings.port, ssl_context=ssl_context).start()
        except OSError as exc:  # taken since the check in _run
            raise cannot_listen(settings.host, settings.port, exc) from None
        listening = True
        return await _unless_stopped(app[MOVE].wait(), stop)
    finally:
        if listening:  # stopping the site first would cut off a step round's peers (SIGTERM waited out its deadline)
            await leave(app)
        await runner.cleanup()


async def _unless_stopped(work: Awaitable[T], stop: asyncio.Event) -> T | None:
    """``await work``, cancelled if ``stop`` is set first (None then)."""
    task, stopped = asyncio.ensure_future(work), asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((task, stopped), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, stopped):
            pending.cancel()
        await asyncio.gather(task, stopped, return_exceptions=True)
    return None if task.cancelled() else task.result()


if __name__ == "__main__":
    sys.exit(main())
