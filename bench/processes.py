"""Child processes of a bench: coordinators and stage servers on explicit loopback ports.

The generic helpers (free ports, waiting for ``/health``, stopping) are in
:mod:`shared.processes`; what is here is the bench's own: its children's settings and CPU time.

Every child runs in its own session with ``SWARM_*`` settings given here only (the
caller's own ``SWARM_*`` variables do not leak in), mDNS off, one torch thread, and logs
in the bench's log directory. :class:`BenchProcesses` is a context manager: leaving it,
normally, on an error or on Ctrl-C, stops every child it started (SIGTERM, then SIGKILL
after a grace period). CPU time of children is read from ``/proc`` so a bench can say
where the machine's cores went.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from shared.processes import STOP_GRACE_S, fixed_port, stop_processes, wait_healthy

START_TIMEOUT_S = 180.0  # many children import torch at once on 2 cores
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_ROOT = str(Path(__file__).resolve().parent.parent)  # children import ``bench`` from here


def run_id(name: str) -> str:
    """The run id of a bench's swarm: unique to this invocation (its children carry it in
    ``SWARM_RUN_ID``, so a test can check that none outlived the bench)."""
    return f"bench-{name}-{os.getpid()}"


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime, stime (fields 14 and 15 of stat)


def machine_idle_seconds() -> float:
    """Idle CPU seconds of the whole machine (all cores) since boot, from ``/proc/stat``."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except OSError:
        return 0.0
    return (int(fields[4]) + int(fields[5])) / _CLK_TCK  # idle, iowait


class BenchProcesses:
    def __init__(self, run_id: str, log_dir: Path):
        self.run_id, self.log_dir = run_id, log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}

    def __enter__(self) -> "BenchProcesses":
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()

    def start(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        """``python -m ARGS`` with the bench's base settings plus ``env``."""
        clean = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_")}
        pythonpath = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH", "")) if p)
        base = {
            "PYTHONPATH": pythonpath,
            "SWARM_RUN_ID": self.run_id,
            "SWARM_MDNS": "false",
            "SWARM_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1",
            "SWARM_LOG_LEVEL": "warning",
        }
        with open(self.log_dir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", *args],
                env={**clean, **base, **env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs[name] = proc
        return proc

    def coordinator(self, num_stages: int, env: dict[str, str] | None = None) -> tuple[str, str]:
        """A coordinator (averaging and rebalancing off unless ``env`` turns them on), not
        waited for: servers started with its URL keep trying to register. Returns (name, URL)."""
        port = fixed_port()
        settings = {
            "SWARM_PORT": str(port),
            "SWARM_NUM_STAGES": str(num_stages),
            "SWARM_STATE_DB": str(self.log_dir / f"coordinator-{port}.sqlite"),
            "SWARM_AVERAGE_EVERY_S": "0",
            "SWARM_REBALANCE_EVERY_S": "0",
            **(env or {}),
        }
        name = f"coordinator-{port}"
        self.start(name, ["services.coordinator"], settings)
        return name, f"http://127.0.0.1:{port}"

    def stage_server(
        self,
        stage: int,
        num_stages: int,
        env: dict[str, str] | None = None,
        *,
        dims: dict[str, int] | None = None,
        name: str = "",
    ) -> tuple[str, str]:
        """A stage server (not waited for); ``dims`` (d_model, n_layer, n_head) gives its model
        other dimensions than the preset's (``bench.stage_proc``). Returns (name, URL)."""
        port = fixed_port()
        settings = {
            "SWARM_STAGE": str(stage),
            "SWARM_PORT": str(port),
            "SWARM_NUM_STAGES": str(num_stages),
            "SWARM_DRAIN_TIMEOUT_S": "2",
            **(env or {}),
        }
        args = ["services.stage_server"]
        if dims:
            args = ["bench.stage_proc"] + [f"--bench-{k.replace('_', '-')}={v}" for k, v in dims.items()]
        name = name or f"stage{stage}-{port}"
        self.start(name, args, settings)
        return name, f"http://127.0.0.1:{port}"

    def wait_healthy(self, servers: dict[str, str], timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait until every ``name -> URL`` answers ``/health``."""
        for name, url in servers.items():
            wait_healthy(url, self.procs[name], timeout_s)

    def pid(self, name: str) -> int:
        return self.procs[name].pid

    def cpu_seconds(self, names: list[str] | None = None) -> float:
        return sum(cpu_seconds(p.pid) for n, p in self.procs.items() if names is None or n in names)

    def kill(self, name: str) -> None:
        """SIGKILL: a crash, not a shutdown (no drain, no deregistration)."""
        proc = self.procs.pop(name)
        proc.kill()
        proc.wait()

    def stop(self, names: list[str]) -> None:
        self._stop([self.procs.pop(n) for n in names if n in self.procs])

    def stop_all(self) -> None:
        """Servers first, then coordinators, so that servers can deregister."""
        coordinators = [n for n in self.procs if n.startswith("coordinator")]
        self.stop([n for n in self.procs if n not in coordinators])
        self.stop(coordinators)

    @staticmethod
    def _stop(procs: list[subprocess.Popen]) -> None:
        stop_processes(procs, STOP_GRACE_S)
