"""The process helpers of shared/processes.py on real (tiny) child processes."""

from __future__ import annotations

import ast
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import shared.processes
from shared.processes import free_port, stop_processes, wait_healthy


def python(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def test_a_free_port_can_be_bound():
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))


def test_stop_processes_terminates_and_kills_what_ignores_sigterm():
    polite = python("import time; time.sleep(60)")
    stubborn = python(
        "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(60)"
    )
    time.sleep(0.5)  # the stubborn one has installed its handler
    started = time.monotonic()
    stop_processes([polite, stubborn], grace_s=1.0)
    assert polite.returncode is not None and stubborn.returncode is not None
    assert time.monotonic() - started < 10


def test_wait_healthy_fails_at_once_when_the_child_exited():
    proc = python("raise SystemExit(3)")
    proc.wait()
    with pytest.raises(RuntimeError, match="exited with status 3"):
        wait_healthy(f"http://127.0.0.1:{free_port()}", proc, timeout_s=30)


def test_wait_healthy_gives_up_at_its_deadline():
    proc = python("import time; time.sleep(60)")
    try:
        with pytest.raises(RuntimeError, match="not healthy within"):
            wait_healthy(f"http://127.0.0.1:{free_port()}", proc, timeout_s=0.5)
    finally:
        stop_processes([proc], grace_s=1.0)


def test_the_helpers_import_no_service():
    # the tests, the benches and `swarm up` import them: they build on shared/, nothing else of the project
    source = Path(shared.processes.__file__).read_text()
    imported = {
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assert {m.split(".")[0] for m in imported} - set(sys.stdlib_module_names) <= {"shared"}, imported
