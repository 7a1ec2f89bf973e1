"""A swarm whose processes the chaos tests kill and restart: a coordinator, stage servers
and trainers as real processes on loopback (mDNS off), each remembered with its port and
environment so that it can be restarted as it was (same port, same stage, same settings).
Their ports lie outside the kernel's ephemeral range (``fixed_port``): a port in that range
is free for any bind to port 0 (the other pytest worker's servers) while its server restarts.
A CI run's restarted server exited with status 1, as one then did (its log was not kept);
a server whose port is taken now says so and exits with 2.

Built on the e2e ``processes`` fixture, which stops every process at the end of a test,
also when it fails. Logs are JSON lines (``SWARM_LOG_FORMAT=json``) so that the tests read
events (``hop.failed``, ``stage.joined``) from them rather than matching text.
"""

from __future__ import annotations

import json
import subprocess
import urllib.error
from dataclasses import dataclass, field
from pathlib import Path

from shared.processes import fixed_port, wait_healthy
from tests.e2e.conftest import Processes, get_json, wait_until

START_S = 120  # several children import torch at once on 2 busy cores
MODEL = {
    "SWARM_MODEL": "tiny",
    "SWARM_WIRE_CODEC": "fp32",
    "SWARM_LOG_FORMAT": "json",
}  # fp32: no int8 warm-up at each (re)start


@dataclass
class Member:
    """One process of the swarm and how to start it again."""

    name: str
    module: str
    env: dict[str, str]
    proc: subprocess.Popen
    logs: list[Path] = field(default_factory=list)  # one per start, oldest first

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.env['SWARM_PORT']}"

    @property
    def stage(self) -> int:
        return int(self.env["SWARM_STAGE"])

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def events(self, name: str | None = None) -> list[dict]:
        """Every JSON log line of every start of this process (``name``: only that event)."""
        return [e for log in self.logs for e in read_events(log) if name is None or e.get("event") == name]


def read_events(log: Path) -> list[dict]:
    """The JSON lines of a log (other lines, e.g. a traceback of a crash, are skipped)."""
    events = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except ValueError:
                pass
    return events


class ChaosSwarm:
    def __init__(self, processes: Processes, *, num_stages: int, heartbeat_s: float):
        self.processes, self.num_stages, self.heartbeat_s = processes, num_stages, heartbeat_s
        self.common = {
            **MODEL,
            "SWARM_NUM_STAGES": str(num_stages),
            "SWARM_MDNS": "false",
            "SWARM_HEARTBEAT_S": str(heartbeat_s),
        }
        self.coordinator: Member | None = None
        self.servers: list[Member] = []
        self.trainers: list[Member] = []

    # ------------------------------------------------------------ starting and restarting
    def _start(self, name: str, module: str, env: dict[str, str]) -> Member:
        proc = self.processes.start(name, module, env)
        return Member(name, module, env, proc, [self.processes.log_dir / f"{name}.log"])

    def restart(self, member: Member) -> None:
        """Start ``member`` again with the same settings (port included); its new log is a new file."""
        assert not member.alive, f"{member.name} still runs"
        name = f"{member.name}-r{len(member.logs)}"
        member.proc = self.processes.start(name, member.module, member.env)
        member.logs.append(self.processes.log_dir / f"{name}.log")

    @staticmethod
    def kill(member: Member) -> None:
        """SIGKILL: no drain, no deregistration, connections reset."""
        member.proc.kill()
        member.proc.wait(timeout=10)

    def start_coordinator(self, extra: dict | None = None) -> str:
        """Averaging and rebalancing off unless ``extra`` turns them on."""
        env = {
            **self.common,
            "SWARM_PORT": str(fixed_port()),
            "SWARM_STATE_DB": str(self.processes.log_dir / "coordinator.sqlite"),
            "SWARM_AVERAGE_EVERY_S": "0",
            "SWARM_REBALANCE_EVERY_S": "0",
            **(extra or {}),
        }
        self.coordinator = self._start("coordinator", "services.coordinator", env)
        self.wait_coordinator()
        return self.coordinator.url

    def wait_coordinator(self) -> None:
        wait_healthy(self.coordinator.url, self.coordinator.proc, START_S)

    def add_server(self, stage: int, extra: dict | None = None) -> Member:
        port = fixed_port()
        env = {
            **self.common,
            "SWARM_STAGE": str(stage),
            "SWARM_PORT": str(port),
            "SWARM_COORDINATOR": self.coordinator.url,
            **(extra or {}),
        }
        server = self._start(f"server-{stage}-{port}", "services.stage_server", env)
        self.servers.append(server)
        return server

    def start_trainer(self, name: str, extra: dict) -> Member:
        """A trainer of this swarm; its summary goes to ``<log dir>/<name>-summary.json``.
        ``SWARM_STEPS`` (less ``SWARM_START_STEP``, if given) is how many global steps it
        trains from the swarm's step now: steps count for the whole run, so a trainer
        started on a swarm that trained already goes on from there."""
        log_dir = self.processes.log_dir
        if "SWARM_STEPS" in extra:
            now, more = self.global_step(), int(extra["SWARM_STEPS"]) - int(extra.get("SWARM_START_STEP", 0))
            extra = {**extra, "SWARM_START_STEP": str(now), "SWARM_STEPS": str(now + more)}
        env = {
            **self.common,
            "SWARM_COORDINATOR": self.coordinator.url,
            "SWARM_PROGRESS": "off",
            "SWARM_LOG_EVERY": "1000",
            "SWARM_SUMMARY_FILE": str(log_dir / f"{name}-summary.json"),
            "SWARM_METRICS_FILE": str(log_dir / f"{name}-metrics.jsonl"),
            **extra,
        }
        trainer = self._start(name, "services.trainer", env)
        self.trainers.append(trainer)
        return trainer

    # ------------------------------------------------------------ observing
    def global_step(self) -> int:
        """The swarm's global step: the least step any live replica reports (stage 0 steps last)."""
        return min((get_json(url + "/health")["step"] for url in self.listed()), default=0)

    def listed(self) -> set[str]:
        """URLs the coordinator lists as live."""
        return {r["url"] for s in get_json(self.coordinator.url + "/swarm")["stages"] for r in s["replicas"]}

    def wait_serving(self, servers: list[Member] | None = None, timeout_s: float = START_S) -> None:
        """Until every server (default: all) is listed by the coordinator and answers /health."""
        servers = self.servers if servers is None else servers

        def all_listed() -> bool:
            for s in servers:
                assert s.alive, (
                    f"{s.name} exited with status {s.proc.returncode}; {s.logs[-1]} ends:\n{tail(s.logs[-1])}"
                )
            return {s.url for s in servers} <= self.listed()

        wait_until(all_listed, timeout_s, f"{[s.name for s in servers]} to register", poll_s=0.2)
        for s in servers:
            wait_healthy(s.url, s.proc, timeout_s)


def tail(log: Path, lines: int = 20) -> str:
    """The last lines of a log, for a failure message (CI keeps only what the test prints)."""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def health(url: str) -> dict | None:
    """GET /health, or None if the server does not answer."""
    try:
        return get_json(url + "/health", timeout_s=2)
    except (urllib.error.URLError, OSError, ValueError):
        return None


def summary_of(trainer: Member) -> dict:
    return json.loads(Path(trainer.env["SWARM_SUMMARY_FILE"]).read_text())


def steps_done(trainer: Member) -> int:
    """Steps the trainer completed so far (lines of its metrics file)."""
    path = Path(trainer.env["SWARM_METRICS_FILE"])
    return len(path.read_text().splitlines()) if path.exists() else 0


def vm_rss_mib(pid: int) -> float | None:
    """Resident memory of a process (VmRSS in /proc), or None if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None
