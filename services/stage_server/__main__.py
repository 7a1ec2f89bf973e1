"""``swarm server`` / ``python -m services.stage_server``: serve one stage.

With a coordinator (``--coordinator URL``, or found by mDNS when none is given) the
server registers and heartbeats; ``--stage auto`` lets the coordinator pick the stage
with the least capacity. SIGTERM or Ctrl-C drains: 503 to new work, deregistration,
then the accepted requests finish before the process exits.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import torch
from aiohttp import web

from services.stage_server.app import create_app
from services.stage_server.latency import probe_swarm
from services.stage_server.membership import assign_stage
from services.stage_server.routes import MOVE
from shared.config import StageServerSettings, parse_settings
from shared.errors import RemoteError
from shared.http import server_ssl_context, swarm_session
from shared.log import configure_logging, get_logger


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
    if stage == "auto":
        if not coordinator:
            raise ValueError(
                "SWARM_STAGE=auto needs a coordinator: set SWARM_COORDINATOR or run one on this LAN with mDNS"
            )
        async with swarm_session(settings) as session:
            rtt_ms = await probe_swarm(session, coordinator)  # the coordinator places by the network where it can
            stage = await assign_stage(session, coordinator, settings.run_id, region=settings.region, rtt_ms=rtt_ms)
        log.info("stage.assigned", stage=stage, region=settings.region or None, peers_timed=len(rtt_ms))
    return settings.model_copy(update={"coordinator": coordinator, "stage": stage})


def main(
    argv: list[str] | None = None,
    *,
    settings_class: type[StageServerSettings] = StageServerSettings,
    module: str = "services.stage_server",
) -> int:
    """Serve until stopped. ``settings_class`` and ``module`` let a variant of the server (the
    benches' ``bench.stage_proc``) run the same way and restart as itself after a move."""
    settings = parse_settings(settings_class, argv, "swarm server", "Serve one pipeline stage over HTTP.")
    configure_logging(settings.log_format, settings.log_level)
    torch.set_num_threads(settings.num_threads)
    try:
        settings = asyncio.run(resolve(settings, get_logger(service="stage_server", run=settings.run_id)))
        app = create_app(settings)
        ssl_context = server_ssl_context(settings)
    except (ValueError, RemoteError) as exc:
        print(f"swarm server: {exc}", file=sys.stderr)
        return 2
    order = app[MOVE]
    order.on_order = lambda: os.kill(os.getpid(), signal.SIGTERM)  # drain, deregister, then restart below
    web.run_app(
        app,
        host=settings.host,
        port=settings.port,
        print=None,
        shutdown_timeout=settings.drain_timeout_s,
        access_log=None,
        ssl_context=ssl_context,
    )
    if order.to_stage is not None:  # moved by the coordinator: start again as a server of the new stage
        argv = [a for a in (sys.argv[1:] if argv is None else argv)]
        os.execv(sys.executable, [sys.executable, "-m", module, *argv, "--stage", str(order.to_stage)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
