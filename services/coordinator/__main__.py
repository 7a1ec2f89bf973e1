"""``python -m services.coordinator``: keep the registry of a run's stage servers."""

from __future__ import annotations

import sys

from aiohttp import web

from services.coordinator.app import create_app
from shared.config import CoordinatorSettings, parse_settings
from shared.http import check_can_listen, server_ssl_context
from shared.log import configure_logging


def main(argv: list[str] | None = None) -> int:
    settings = parse_settings(
        CoordinatorSettings, argv, "swarm coordinator", "Keep the registry of a run's stage servers and their leases."
    )
    configure_logging(settings.log_format, settings.log_level)
    try:
        check_can_listen(settings.host, settings.port)
        app = create_app(settings)
        ssl_context = server_ssl_context(settings)
    except ValueError as exc:
        print(f"swarm coordinator: {exc}", file=sys.stderr)
        return 2
    web.run_app(app, host=settings.host, port=settings.port, print=None, access_log=None, ssl_context=ssl_context)
    return 0


if __name__ == "__main__":
    sys.exit(main())
