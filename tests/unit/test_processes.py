"""The process helpers of shared/processes.py on real (tiny) child processes."""

from __future__ import annotations

import ast
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import shared.processes
from shared.processes import ephemeral_ports, fixed_port, free_port, stop_processes, wait_healthy


def python(code: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True, **kwargs)


def test_a_free_port_can_be_bound():
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))


def test_a_fixed_port_is_free_and_outside_the_range_the_os_hands_out():
    ephemeral = ephemeral_ports()
    assert free_port() in ephemeral  # what the OS picks by itself: why a restarted server may find its port taken
    for _ in range(20):
        port = fixed_port()
        assert 10_000 <= port < 65_536 and port not in ephemeral, port
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_fixed_port_skips_ports_in_use(monkeypatch, tmp_path):
    ports = tmp_path / "ip_local_port_range"
    ports.write_text("10001 65534\n")  # outside it: 10000 and 65535 only
    monkeypatch.setattr(shared.processes, "EPHEMERAL_PORTS", ports)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 10_000))
        assert fixed_port() == 65_535
        with socket.socket() as also_held:
            also_held.bind(("127.0.0.1", 65_535))
            port = fixed_port()  # none left: one the OS picks
            assert port not in (10_000, 65_535) and port in ephemeral_ports()


def test_a_fixed_port_is_a_free_port_where_the_range_is_unknown_or_full(monkeypatch, tmp_path):
    monkeypatch.setattr(shared.processes, "EPHEMERAL_PORTS", tmp_path / "missing")
    assert fixed_port() in ephemeral_ports()
    full = tmp_path / "ip_local_port_range"
    full.write_text("1024 65535\n")
    monkeypatch.setattr(shared.processes, "EPHEMERAL_PORTS", full)
    assert fixed_port() in ephemeral_ports()


def test_stop_processes_terminates_and_kills_what_ignores_sigterm():
    polite = python("import time; time.sleep(60)")
    stubborn = python(
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ignoring', flush=True); "
        "time.sleep(60)",
        stdout=subprocess.PIPE,
        text=True,
    )
    assert stubborn.stdout.readline() == "ignoring\n"  # its handler is installed
    stubborn.stdout.close()
    started = time.monotonic()
    stop_processes([polite, stubborn], grace_s=1.0)
    assert polite.returncode == -signal.SIGTERM and stubborn.returncode == -signal.SIGKILL
    assert 1.0 <= time.monotonic() - started < 10


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
