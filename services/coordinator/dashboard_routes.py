"""The coordinator's dashboard over HTTP (the data is ``dashboard.py``)::

GET  /                 the live dashboard: one self-contained HTML page (no CDN) that
                       polls /dashboard.json and redraws; its prompt box streams text
                       from POST /v1/completions (completions.py)
GET  /dashboard.json   (both open without a signature, like /health and /metrics)
                       {run_id, now, num_stages, heartbeat_s, lease_s, weakest_stage,
                        stages: [{stage, capacity, queue_length, replicas: [{server_id,
                        url, throughput, queue_length, lease_age_s, health, ...}],
                        utilisation: {mfu_busy, mfu_wall, ...} | null}],
                        trainers: {id: [{t, step, loss, tokens_per_s, elapsed_s}]},
                        events: [{t, event, level, ...}] (newest first), event_counts}
POST /progress         {run_id, trainer_id, records: [{step, loss, tokens_per_s, elapsed_s?}]}
                       -> {recorded, trainers}: a trainer's step records since its last
                       report (1..256; JSON, like the registry's messages)
"""

from __future__ import annotations

import time
from pathlib import Path

from aiohttp import web

from services.coordinator.dashboard import RecentEvents, TrainingProgress, dashboard_view
from services.coordinator.routes import SETTINGS, _check_run, read_json, swarm_view

EVENTS = web.AppKey("events", RecentEvents)
PROGRESS = web.AppKey("progress", TrainingProgress)
PAGE = Path(__file__).with_name("static") / "dashboard.html"
# Open like /health and /metrics when the swarm signs its requests: a browser holds no secret,
# and what these show (replicas, speeds, loss) /metrics shows too. POST /progress is signed.
DASHBOARD_PATHS = frozenset({"/", "/dashboard.json"})
_PAGE_BYTES = web.AppKey("dashboard_page", bytes)


async def page(request: web.Request) -> web.Response:
    return web.Response(
        body=request.app[_PAGE_BYTES], content_type="text/html", charset="utf-8", headers={"Cache-Control": "no-cache"}
    )


async def dashboard_json(request: web.Request) -> web.Response:
    app = request.app
    view = dashboard_view(app[SETTINGS].run_id, swarm_view(app), app[PROGRESS], app[EVENTS], now=time.time())
    return web.json_response(view, headers={"Cache-Control": "no-store"})


async def progress(request: web.Request) -> web.Response:
    msg = await read_json(request)
    _check_run(request, msg)
    board = request.app[PROGRESS]
    recorded = board.record(msg)
    return web.json_response({"recorded": recorded, "trainers": len(board)})


def add_dashboard_routes(app: web.Application, events: RecentEvents) -> None:
    """The page, its data and the trainers' progress reports; ``events`` is what the
    coordinator's :class:`~services.coordinator.dashboard.EventRecorder` fills."""
    app[EVENTS] = events
    app[PROGRESS] = TrainingProgress(events=events)
    app[_PAGE_BYTES] = PAGE.read_bytes()
    app.router.add_get("/", page)
    app.router.add_get("/dashboard.json", dashboard_json)
    app.router.add_post("/progress", progress)
