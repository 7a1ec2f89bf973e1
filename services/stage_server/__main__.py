"""``swarm server`` / ``python -m services.stage_server``: serve one stage."""

from __future__ import annotations

import sys

import torch
from aiohttp import web

from shared.config import StageServerSettings, parse_settings
from shared.log import configure_logging
from services.stage_server.app import create_app


def main(argv: list[str] | None = None) -> int:
    settings = parse_settings(StageServerSettings, argv, "swarm server", "Serve one pipeline stage over HTTP.")
    configure_logging(settings.log_format, settings.log_level)
    torch.set_num_threads(settings.num_threads)
    try:
        app = create_app(settings)
    except ValueError as exc:
        print(f"swarm server: {exc}", file=sys.stderr)
        return 2
    web.run_app(app, host=settings.host, port=settings.port, print=None, shutdown_timeout=settings.drain_timeout_s, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
