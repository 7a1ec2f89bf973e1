"""Child processes on this machine: start them in their own sessions, wait for their ``/health``, stop them.

Plain ``subprocess`` and blocking HTTP, for the supervisors that start swarm members as
processes (``swarm up``, the benches, the end-to-end tests). Children run in their own
sessions, so a Ctrl-C reaches only the supervisor, which then stops them: SIGTERM, then
SIGKILL after a grace period.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
from pathlib import Path

from shared.config import CommonSettings
from shared.http import urlopen_swarm

STOP_GRACE_S = 10.0
HEALTH_POLL_S = 0.2  # how often a starting child's /health is asked, until its deadline


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")
FIXED_PORT_TRIES = 200


def ephemeral_ports(path: Path = EPHEMERAL_PORTS) -> range | None:
    """The ports the kernel hands out by itself (``ip_local_port_range``), or None if unknown."""
    try:
        low, high = map(int, path.read_text().split())
    except (OSError, ValueError):
        return None
    return range(low, high + 1)


def fixed_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, outside the kernel's ephemeral range, as a deployed
    server's port is (8000, 8100): the OS never hands such a port out by itself (to a bind to
    port 0, to an outgoing connection), so a server restarted on it finds it free again. For
    a port that a child process listens on: it binds seconds later (imports, the download of
    its stage's state), and a port from :func:`free_port` may be taken meanwhile by any
    process's bind to port 0 or outgoing connection. Falls back to :func:`free_port` where
    the range is unknown or leaves no room below 65536."""
    ephemeral = ephemeral_ports(EPHEMERAL_PORTS)
    if ephemeral is None:
        return free_port(host)
    candidates = [*range(10_000, ephemeral.start), *range(ephemeral.stop, 65_536)]
    rng = random.SystemRandom()
    for _ in range(FIXED_PORT_TRIES if candidates else 0):
        port = rng.choice(candidates)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    return free_port(host)


class LocalProcesses:
    """Child processes started in their own sessions and stopped, all of them, on exit."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs: list = []

    def start(self, name: str, args: list[str], env: dict[str, str], *, log_to_file: bool = True) -> subprocess.Popen:
        """``python -m ARGS`` with this environment plus ``env``, its output in ``RUN_DIR/NAME.log``."""
        out = open(self.run_dir / f"{name}.log", "wb") if log_to_file else None
        if out:
            self._logs.append(out)
        proc = subprocess.Popen(
            [sys.executable, "-m", *args],
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,
        )
        self.procs[name] = proc
        return proc

    def stop_all(self) -> None:
        """Trainers and servers first, then the coordinator, so that servers can deregister."""
        last = [p for name, p in self.procs.items() if name == "coordinator"]
        stop_processes([p for p in self.procs.values() if p not in last])
        stop_processes(last)
        for f in self._logs:
            f.close()


def stop_processes(procs: list[subprocess.Popen], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM, then SIGKILL what still runs after ``grace_s``."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Return once ``url`` answers ``GET /health`` with 200; raise if ``proc`` exits first or time runs out.

    The request is signed and trusts TLS as this environment's ``SWARM_*`` settings say
    (SWARM_SECRET or SWARM_SECRET_FILE, SWARM_TLS_*), the settings the children get too.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with status {proc.returncode} before it was healthy")
        try:
            with urlopen_swarm(CommonSettings(), url + "/health", timeout_s=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(HEALTH_POLL_S)  # polling a child process's readiness, bounded by the deadline
    raise RuntimeError(f"{url} not healthy within {timeout_s} s")
