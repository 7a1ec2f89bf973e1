"""Real processes on loopback, each stopped by the test that started it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from shared.processes import fixed_port, wait_healthy

SWARM = (
    [str(Path(sys.executable).with_name("swarm"))]
    if Path(sys.executable).with_name("swarm").exists()
    else [sys.executable, "-m", "services.cli"]
)


def processes_of_run(run_id: str) -> list[int]:
    """PIDs of live processes started for this run (their environment names the run id)."""
    variable = f"SWARM_RUN_ID={run_id}".encode()
    return live_processes_where(lambda env: variable in env)


def live_processes_where(match) -> list[int]:
    """PIDs of live (not zombie) processes whose environment (a list of ``NAME=value`` bytes) ``match`` accepts."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            state = next((x for x in (proc / "status").read_text().splitlines() if x.startswith("State:")), "")
        except OSError:
            continue
        if match(env) and "zombie" not in state:
            pids.append(int(proc.name))
    return pids


def run_story(run_dir: Path, limit: int = 40) -> str:
    """For a failure message: the run's warnings and errors, and how far each stage's global
    steps went (the coordinator's ``step.done`` lines), from the logs of a ``swarm up`` run dir."""
    steps: dict[str, list[str]] = {}
    notable = []
    for log in sorted(run_dir.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if "step.done" in line and (stage := re.search(r" stage=(\d+)", line)):
                steps.setdefault(stage.group(1), []).append(line)
            elif "[warning" in line or "[error" in line or "caught_up" in line or "resync" in line:
                notable.append(f"{log.name}: {line}")
    lines = [f"stage {s}: {len(v)} steps done, the last: {v[-1]}" for s, v in sorted(steps.items())]
    return "\n".join([*lines, *notable[:limit]])


def get_json(url: str, timeout_s: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def wait_until(condition, timeout_s: float, what: str, poll_s: float = 0.05):
    """Poll ``condition()`` until it returns something truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def run_bench(argv: list[str], timeout_s: float) -> tuple[int, str]:
    """Run a bench command to its end (killed past ``timeout_s``): (exit status, its output);
    fails if a process it started (``SWARM_RUN_ID=bench-...-PID``) outlived it."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    suffix = f"-{proc.pid}".encode()
    left = live_processes_where(
        lambda env: any(e.startswith(b"SWARM_RUN_ID=bench-") and e.endswith(suffix) for e in env)
    )
    assert left == [], f"processes started by {argv[:4]} outlived it: {left}"
    return proc.returncode, output


def stop_swarm_up(proc: subprocess.Popen) -> None:
    """Stop a `swarm up` the way a user would (Ctrl-C), so it stops its children; kill as a last resort."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Processes:
    """Start ``python -m <module>`` children with SWARM_* settings; stop them all at the end."""

    def __init__(self, run_id: str, log_dir: Path):
        self.run_id, self.log_dir = run_id, log_dir
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, module: str, env: dict[str, str]) -> subprocess.Popen:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_")}
        log = open(self.log_dir / f"{name}.log", "wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", module],
            env={**clean, "SWARM_RUN_ID": self.run_id, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        self.procs.append(proc)
        return proc

    def coordinator(
        self, *, heartbeat_s: float, mdns: bool = False, num_stages: int = 4, extra: dict | None = None
    ) -> tuple[subprocess.Popen, str]:
        """A coordinator; averaging and rebalancing are off unless ``extra`` turns them on."""
        port = fixed_port()
        env = {
            "SWARM_PORT": str(port),
            "SWARM_HEARTBEAT_S": str(heartbeat_s),
            "SWARM_NUM_STAGES": str(num_stages),
            "SWARM_STATE_DB": str(self.log_dir / "coordinator.sqlite"),
            "SWARM_MDNS": str(mdns).lower(),
            "SWARM_MDNS_INTERFACES": "127.0.0.1",
            "SWARM_AVERAGE_EVERY_S": "0",
            "SWARM_REBALANCE_EVERY_S": "0",
            **(extra or {}),
        }
        proc = self.start("coordinator", "services.coordinator", env)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, 60)
        return proc, url

    def server(
        self, stage: int | str, *, coordinator: str = "", heartbeat_s: float = 1.0, extra: dict | None = None
    ) -> tuple[subprocess.Popen, str]:
        port = fixed_port()
        env = {
            "SWARM_STAGE": str(stage),
            "SWARM_PORT": str(port),
            "SWARM_HEARTBEAT_S": str(heartbeat_s),
            "SWARM_COORDINATOR": coordinator,
            "SWARM_MDNS": "false",
            **(extra or {}),
        }
        proc = self.start(f"server-{stage}-{port}", "services.stage_server", env)
        return proc, f"http://127.0.0.1:{port}"

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def processes(tmp_path, request):
    run_id = f"e2e-{request.node.name[:40]}-{os.getpid()}".replace("[", "-").replace("]", "")
    procs = Processes(run_id, tmp_path)
    yield procs
    procs.stop_all()
    assert processes_of_run(run_id) == [], "a process of this test outlived it"
