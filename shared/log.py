"""structlog set-up: JSON lines in containers, readable colours in a terminal.

One event name per line (``forward.done``), fields after it, and ids bound with
``logger.bind(run=..., stage=..., replica=..., microbatch=...)`` so a microbatch can be
followed across services: the trainer sends its microbatch id in the header
``X-Swarm-Microbatch`` and each server binds it (``structlog.contextvars``) to every line
logged while it handles the request (``shared.http.request_log_middleware``).
``SWARM_LOG_FORMAT=json`` renders every line as one JSON object, those of standard-library
loggers (aiohttp, asyncio) included; ``console`` renders readable lines.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(fmt: str = "console", level: str = "info") -> None:
    renderer = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),
        cache_logger_on_first_use=False,
    )
    # Libraries that log through the standard logging module: warnings and worse only,
    # rendered like our own lines (in JSON mode every line on stderr stays one JSON object).
    stdlib = logging.StreamHandler(_CurrentStderr())
    stdlib.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processor=renderer,
            foreign_pre_chain=[
                structlog.processors.add_log_level,
                structlog.stdlib.add_logger_name,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.processors.format_exc_info,
            ],
        )
    )
    logging.basicConfig(level=logging.WARNING, handlers=[stdlib])
    # bitsandbytes warns at import that an optional 4-bit CPU kernel (fetched from a hub,
    # which we never use) is missing; our int8 codec does not need it.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is now (test runners swap it), not the one at set-up."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def get_logger(**bound) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger().bind(**bound)
