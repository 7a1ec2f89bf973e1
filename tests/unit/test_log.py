"""shared.log: JSON lines with SWARM_LOG_FORMAT=json (standard-library loggers included), readable lines otherwise."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import logging
import structlog
from shared.log import configure_logging, get_logger
configure_logging({fmt!r}, "info")
log = get_logger(service="stage_server", run="r1", stage=2)
with structlog.contextvars.bound_contextvars(microbatch="r1:t1:7"):
    log.info("forward.done", seconds=0.01)
log.debug("hidden.at.info")
logging.getLogger("aiohttp.server").warning("a library speaks")
try:
    1 / 0
except ZeroDivisionError:
    log.exception("request.crashed")
"""


def run(fmt: str) -> list[str]:
    result = subprocess.run([sys.executable, "-c", SCRIPT.format(fmt=fmt)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [line for line in result.stderr.splitlines() if line.strip()]


def test_json_format_writes_one_object_per_line_with_bound_ids():
    records = [json.loads(line) for line in run("json")]
    assert [r["event"] for r in records] == ["forward.done", "a library speaks", "request.crashed"]
    done = records[0]
    assert (done["service"], done["run"], done["stage"], done["microbatch"], done["level"]) == (
        "stage_server",
        "r1",
        2,
        "r1:t1:7",
        "info",
    )
    assert records[1]["logger"] == "aiohttp.server" and records[1]["level"] == "warning"
    assert "ZeroDivisionError" in records[2]["exception"]
    assert all("timestamp" in r for r in records)


def test_console_format_is_one_readable_line_per_event():
    lines = run("console")
    assert "forward.done" in lines[0] and "microbatch=r1:t1:7" in lines[0] and not lines[0].startswith("{")
    assert any("a library speaks" in line for line in lines)
    assert not any("hidden.at.info" in line for line in lines)
