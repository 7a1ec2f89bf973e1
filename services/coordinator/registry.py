"""The registry of stage servers: who serves which stage, at what URL, and until when.

A server registers, then heartbeats every ``heartbeat_s``; its lease runs
``lease_heartbeats * heartbeat_s`` seconds from its last heartbeat (or registration).
A server whose lease has run out is no longer live: it is invisible to every query at
once and removed from the table by :meth:`Registry.expire`, which returns it so that the
caller can log it. State lives in SQLite, so a restarted coordinator keeps its servers
and their lease times (wall-clock seconds, hence ``clock=time.time``).
"""

from __future__ import annotations

import json
import math
import re
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from shared.errors import BadPayload, Overloaded, SwarmError
from shared.policy.resilience import JoinChoice
from shared.policy.view import PlacementInputs, SwarmView

SERVER_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
MAX_URL_LEN = 512
MAX_VERSION_LEN = 64
# How long a stage handed out by /assign (or a move) counts for a server that has not
# registered yet: a weak peer takes tens of seconds between its /assign and its
# registration (torch's import, the model, the stage's state over a slow link: 30-50 s
# under a fifteenth of a core in the arena), and a hand-out that lapsed sooner sent the
# next joiners to the stage it covered (three replicas there, one on another stage). A
# joiner that died meanwhile holds its stage's place this long at most.
JOIN_WINDOW_S = 60.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS servers (
    server_id      TEXT PRIMARY KEY,
    stage          INTEGER NOT NULL,
    url            TEXT NOT NULL UNIQUE,
    version        TEXT NOT NULL,
    throughput     REAL NOT NULL,
    queue_length   INTEGER NOT NULL,
    registered_at  REAL NOT NULL,
    last_heartbeat REAL NOT NULL
)
"""
_COLUMNS = "server_id, stage, url, version, throughput, queue_length, registered_at, last_heartbeat"
# the global steps' duplicate window (services/coordinator/steps.py): microbatch ids each stage holds
_STEP_WINDOW_SCHEMA = """
CREATE TABLE IF NOT EXISTS step_window (
    stage          INTEGER NOT NULL,
    microbatch_id  TEXT NOT NULL,
    step           INTEGER NOT NULL,
    url            TEXT NOT NULL,
    PRIMARY KEY (stage, microbatch_id)
)
"""
# each stage's step and the counts of its open steps (StepCounter.snapshot, JSON): a restarted
# coordinator goes on counting them instead of from 0
_STEP_COUNTS_SCHEMA = """
CREATE TABLE IF NOT EXISTS step_counts (
    stage          INTEGER PRIMARY KEY,
    counts         TEXT NOT NULL
)
"""


class UnknownServer(SwarmError):
    """No live server has this id (never registered, deregistered or lease expired): re-register."""

    status = 404
    code = "unknown_server"


class StageOutOfRange(SwarmError):
    """The stage is not one of this run's ``[0, num_stages)``."""

    status = 409
    code = "stage_out_of_range"


class RegistryFull(Overloaded):
    """``max_servers`` servers are live; room comes back as leases expire."""

    code = "registry_full"


@dataclass(frozen=True)
class RegisteredServer:
    server_id: str
    stage: int
    url: str
    version: str
    throughput: float  # what the server reports it can do (e.g. samples/s); capacity sums it
    queue_length: int
    registered_at: float  # wall-clock seconds
    last_heartbeat: float  # wall-clock seconds

    def to_json(self, now: float) -> dict:
        return {
            "server_id": self.server_id,
            "url": self.url,
            "version": self.version,
            "throughput": self.throughput,
            "queue_length": self.queue_length,
            "lease_age_s": now - self.last_heartbeat,
            "registered_at": self.registered_at,
        }


@dataclass(frozen=True)
class ServerReport:
    """What a server says about itself for placement (soft state, from every registration
    and heartbeat): where it runs and the work of its stage."""

    region: str = ""  # a region of the network table, any shared name, or "" (unknown)
    parameters: int = 0  # of its stage: what an averaging round moves
    samples_per_step: int = 0  # samples per optimizer step (0: unknown)
    activation_bytes_per_sample: float = 0.0  # wire bytes per sample crossing its boundary, measured (0: none yet)
    step: int | None = None  # the global step its state is at, as of the message (None: not said)
    speed_flops: float = 0.0  # the compute rate it measured as it joined (FLOP/s; 0: none declared)
    link_mbit: float = 0.0  # the link rate it declared (Mbit/s; 0: none)


@dataclass(frozen=True)
class PendingJoin:
    """A stage handed to a joining server (``/assign``) that has not registered yet."""

    stage: int
    until: float  # wall-clock seconds when the hand-out lapses
    region: str = ""
    rtt_ms: dict = field(default_factory=dict)  # peer URL -> ms, as the joiner measured
    speed_flops: float = 0.0  # the compute rate the joiner declared (0: none)
    link_mbit: float = 0.0  # the link rate the joiner declared (Mbit/s; 0: none)


class Registry:
    """Live stage servers of one run, kept in the SQLite file ``db_path`` (":memory:" allowed)."""

    def __init__(
        self,
        db_path: str,
        *,
        num_stages: int,
        heartbeat_s: float,
        lease_heartbeats: int = 3,
        max_servers: int = 4096,
        clock: Callable[[], float] = time.time,
    ):
        assert num_stages >= 1 and heartbeat_s > 0 and lease_heartbeats >= 1 and max_servers >= 1, "bad registry limits"
        self.num_stages = num_stages
        self.heartbeat_s = heartbeat_s
        self.lease_s = lease_heartbeats * heartbeat_s
        self.max_servers = max_servers
        self._clock = clock
        # Stages handed out (to joiners by /assign, to servers ordered to move) whose server
        # has not registered there yet, with the time each hand-out lapses: servers started
        # together (a Deployment scaled up, `swarm up`) spread over the stages instead of all
        # joining the same one, and a moving server is not replaced while it moves.
        self._pending: list[PendingJoin] = []
        self._standbys: dict[str, tuple[float, str]] = {}  # standby server id -> (last asked, region)
        # Round-trip times each live server measured to its peers (peer URL -> ms), from its
        # heartbeats: soft state, kept in memory only (a restarted coordinator relearns it).
        self.rtt_ms: dict[str, dict[str, float]] = {}
        self.reports: dict[str, ServerReport] = {}  # likewise: each live server's ServerReport
        self._db = sqlite3.connect(db_path)
        try:
            self._open_schema()
        except BaseException:
            self._db.close()
            raise

    def _open_schema(self) -> None:
        self._db.execute("PRAGMA journal_mode=WAL")  # a heartbeat is a write: no fsync of a journal each time
        self._db.execute("PRAGMA synchronous=NORMAL")
        with self._db:
            self._db.execute(_SCHEMA)
            self._db.execute("CREATE TABLE IF NOT EXISTS run (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            self._db.execute(_STEP_WINDOW_SCHEMA)
            self._db.execute(_STEP_COUNTS_SCHEMA)
        (top,) = self._db.execute("SELECT MAX(stage) FROM servers").fetchone()
        if top is not None and top >= self.num_stages:
            raise ValueError(
                f"the registry file holds a server of stage {top} but num_stages is {self.num_stages}; "
                "use another file for this run"
            )

    def close(self) -> None:
        self._db.close()

    # ------------------------------------------------------------ run state
    def bind_run(self, run_id: str) -> None:
        """Tie the file to ``run_id``: the first run that opens it owns it; another is refused."""
        with self._db:
            self._db.execute("INSERT OR IGNORE INTO run (key, value) VALUES ('run_id', ?)", (json.dumps(run_id),))
        owner = self._run_value("run_id")
        if owner != run_id:
            raise ValueError(
                f"the registry file belongs to run {owner!r}, not {run_id!r}; use another file for this run"
            )

    def record_checkpoint(self, step: int, path: str) -> None:
        """The run's progress: the step and place of its latest checkpoint."""
        with self._db:
            self._db.executemany(
                "INSERT OR REPLACE INTO run (key, value) VALUES (?, ?)",
                [("step", json.dumps(step)), ("checkpoint", json.dumps(path))],
            )

    def run_state(self) -> dict:
        """{run_id, step, checkpoint, assignment: server ids per stage}: what a restarted
        coordinator (or an operator) needs to know about the run."""
        assignment = [[] for _ in range(self.num_stages)]
        for server in self.live():
            assignment[server.stage].append(server.server_id)
        return {
            "run_id": self._run_value("run_id"),
            "step": self._run_value("step", 0),
            "checkpoint": self._run_value("checkpoint"),
            "assignment": assignment,
        }

    def save_step_window(self, journal: list[tuple]) -> bool:
        """Apply the changes of the global steps' duplicate window and counts, in order, in one
        transaction (``StepCounter.journal``'s hold, release, prune and counts entries); False
        if the file refused them (e.g. a full disk)."""
        try:
            with self._db:
                for op, stage, *args in journal:
                    if op == "hold":
                        mb, step, url = args
                        self._db.execute(
                            "INSERT OR REPLACE INTO step_window (stage, microbatch_id, step, url) VALUES (?, ?, ?, ?)",
                            (stage, mb, step, url),
                        )
                    elif op == "release":
                        self._db.execute(
                            "DELETE FROM step_window WHERE stage = ? AND microbatch_id = ?", (stage, *args)
                        )
                    elif op == "prune":
                        self._db.execute("DELETE FROM step_window WHERE stage = ? AND step < ?", (stage, *args))
                    elif op == "counts":
                        self._db.execute(
                            "INSERT OR REPLACE INTO step_counts (stage, counts) VALUES (?, ?)",
                            (stage, json.dumps(args[0])),
                        )
                    else:
                        raise ValueError(f"unknown change of the step window: {op!r}")
        except sqlite3.Error:
            return False
        return True

    def step_window(self) -> list[tuple[int, str, int, str]]:
        """The duplicate window as saved: (stage, microbatch id, step, replica URL) rows."""
        return self._db.execute(
            "SELECT stage, microbatch_id, step, url FROM step_window WHERE stage < ? ORDER BY stage, step",
            (self.num_stages,),
        ).fetchall()

    def step_counts(self) -> list[tuple[int, dict]]:
        """Each stage's saved step counts: (stage, ``StepCounter.snapshot``) rows."""
        rows = self._db.execute(
            "SELECT stage, counts FROM step_counts WHERE stage < ? ORDER BY stage", (self.num_stages,)
        ).fetchall()
        return [(stage, json.loads(counts)) for stage, counts in rows]

    def _run_value(self, key: str, default=None):
        row = self._db.execute("SELECT value FROM run WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else default

    def register(
        self, server_id, stage, url, version, throughput, queue_length, report: ServerReport | None = None
    ) -> RegisteredServer:
        """Add a server, replacing any row with the same id or the same URL."""
        server_id, url, version = _check_id(server_id), _check_url(url), _check_str("version", version, MAX_VERSION_LEN)
        throughput, queue_length = _check_throughput(throughput), _check_count("queue_length", queue_length)
        if type(stage) is not int:
            raise BadPayload("'stage' must be an int")
        if not 0 <= stage < self.num_stages:
            raise StageOutOfRange(
                f"stage {stage} is not in [0, {self.num_stages}) (this coordinator's SWARM_NUM_STAGES)"
            )
        now = self._clock()
        server = RegisteredServer(server_id, stage, url, version, throughput, queue_length, now, now)
        with self._db:
            self._check_room(server_id, url, now)
            replaced = [
                row[0]
                for row in self._db.execute(
                    "SELECT server_id FROM servers WHERE server_id = ? OR url = ?", (server_id, url)
                )
            ]
            self._db.execute("DELETE FROM servers WHERE server_id = ? OR url = ?", (server_id, url))
            self._db.execute(f"INSERT INTO servers ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", _row(server))
        for old_id in replaced:
            self._forget(old_id)
        if report is not None:
            self.reports[server_id] = report
        for i, pending in enumerate(self._pending):
            if pending.stage == stage:  # the hand-out this server came with, or one like it
                del self._pending[i]
                break
        return server

    def _check_room(self, server_id: str, url: str, now: float) -> None:
        (others,) = self._db.execute(
            "SELECT COUNT(*) FROM servers WHERE last_heartbeat >= ? AND server_id != ? AND url != ?",
            (now - self.lease_s, server_id, url),
        ).fetchone()
        if others >= self.max_servers:
            raise RegistryFull(
                f"the registry is full: {others} live servers (raise SWARM_MAX_SERVERS)", retry_after_s=self.lease_s
            )

    def heartbeat(self, server_id, throughput, queue_length, rtt_ms=None, report: ServerReport | None = None) -> float:
        """Renew a live server's lease and update its load (and its measured round-trip times
        to peers and its report, if given); returns when the new lease expires."""
        server_id = _check_id(server_id)
        throughput, queue_length = _check_throughput(throughput), _check_count("queue_length", queue_length)
        rtt = check_rtt(rtt_ms) if rtt_ms is not None else None
        now = self._clock()
        with self._db:
            renewed = self._db.execute(
                "UPDATE servers SET throughput = ?, queue_length = ?, last_heartbeat = ? "
                "WHERE server_id = ? AND last_heartbeat >= ?",
                (throughput, queue_length, now, server_id, now - self.lease_s),
            ).rowcount
        if not renewed:
            raise UnknownServer(
                f"no live server {server_id!r} (never registered, deregistered or its lease expired): register again"
            )
        if rtt is not None:
            self.rtt_ms[server_id] = rtt
        if report is not None:
            self.reports[server_id] = report
        return now + self.lease_s

    def deregister(self, server_id: str) -> bool:
        """Remove a server at once; False when there was none with this id."""
        server_id = _check_id(server_id)
        self._forget(server_id)
        with self._db:
            return self._db.execute("DELETE FROM servers WHERE server_id = ?", (server_id,)).rowcount > 0

    def expire(self) -> list[RegisteredServer]:
        """Remove and return the servers whose last heartbeat is older than ``lease_s``."""
        cutoff = self._clock() - self.lease_s
        with self._db:
            expired = self._select("WHERE last_heartbeat < ?", (cutoff,))
            self._db.execute("DELETE FROM servers WHERE last_heartbeat < ?", (cutoff,))
        for server in expired:
            self._forget(server.server_id)
        return expired

    def _forget(self, server_id: str) -> None:
        """Drop a server's soft state (round-trip times, report)."""
        self.rtt_ms.pop(server_id, None)
        self.reports.pop(server_id, None)

    def live(self) -> list[RegisteredServer]:
        """Servers whose lease runs, by stage then URL (expired ones are left for :meth:`expire`)."""
        return self._select("WHERE last_heartbeat >= ?", (self._clock() - self.lease_s,))

    def pending_joins(self) -> list[PendingJoin]:
        """Stages handed out in the last join window to servers that have not registered yet."""
        now = self._clock()
        self._pending = [p for p in self._pending if p.until > now and p.stage < self.num_stages]
        return list(self._pending)

    def hand_out(
        self,
        stage: int,
        region: str = "",
        rtt_ms: dict[str, float] | None = None,
        speed_flops: float = 0.0,
        link_mbit: float = 0.0,
    ) -> int:
        """Note that ``stage`` was handed to a joining server (it counts until it registers
        or :data:`JOIN_WINDOW_S` passes, or a lease period if longer); returns ``stage``."""
        until = self._clock() + max(self.lease_s, JOIN_WINDOW_S)
        self._pending.append(PendingJoin(stage, until, region, dict(rtt_ms or {}), speed_flops, link_mbit))
        return stage

    def join_choice(self, link_mbit: float = 0.0) -> JoinChoice:
        """Where a joining server should go, and why: the policy's stage where a loss would hurt
        most (:func:`shared.policy.resilience.join_stage`: an empty stage, then one with a single
        replica, ...; a joiner on a slow link, ``link_mbit``, the strongest stage of that need),
        the stages handed out in the last join window to servers that have not registered yet
        counted as pending joins."""
        return self.swarm(self.pending_joins()).join_stage(link_mbit)

    def standby_choice(self) -> JoinChoice | None:
        """Where a standby server should go now (pending joins counted), or None: it waits
        while every stage has two replicas (:func:`shared.policy.resilience.standby_stage`)."""
        return self.swarm(self.pending_joins()).standby_stage()

    def note_standby(self, server_id: str, region: str = "", *, assigned: bool = False) -> None:
        """A standby server asked for a stage (``assigned``: and got one, so it waits no more)."""
        server_id = _check_id(server_id)
        if assigned:
            self._standbys.pop(server_id, None)
        else:
            self._standbys[server_id] = (self._clock(), region)

    def standbys(self) -> list[dict]:
        """The standby servers that asked for a stage within the lease: {server_id, region}."""
        now = self._clock()
        self._standbys = {k: v for k, v in self._standbys.items() if now - v[0] < self.lease_s}
        return [{"server_id": k, "region": region} for k, (_, region) in sorted(self._standbys.items())]

    def assign_stage(self) -> int:
        """Hand out :meth:`join_choice`'s stage; returns it."""
        return self.hand_out(self.join_choice().stage)

    def swarm(
        self,
        pending: Iterable[PendingJoin] = (),
        *,
        live: Sequence[RegisteredServer] | None = None,
        topology: PlacementInputs | None = None,
    ) -> SwarmView:
        """The ``live`` servers (default: :meth:`live`) as the placement policy's view, with
        these ``pending`` joins, the speeds and links every one declared, and ``topology``."""
        pending = list(pending)
        return SwarmView.of(
            self.live() if live is None else live,
            self.num_stages,
            pending=[p.stage for p in pending],
            topology=topology,
            speeds={sid: report.speed_flops for sid, report in self.reports.items()},
            pending_speeds=[p.speed_flops for p in pending],
            links={sid: report.link_mbit for sid, report in self.reports.items()},
            pending_links=[p.link_mbit for p in pending],
        )

    def view(self) -> dict:
        """The swarm as JSON: every stage in order with its capacity and live replicas by URL."""
        now = self._clock()
        servers = self._select("WHERE last_heartbeat >= ?", (now - self.lease_s,))
        stages = [{"stage": i, "capacity": 0.0, "replicas": []} for i in range(self.num_stages)]
        for s in servers:
            stages[s.stage]["capacity"] += s.throughput
            report = self.reports.get(s.server_id, ServerReport())
            stages[s.stage]["replicas"].append(
                {
                    **s.to_json(now),
                    "rtt_ms": self.rtt_ms.get(s.server_id, {}),
                    "region": report.region,
                    "link_mbit": report.link_mbit,  # declared (0: none): a joiner downloads from the fastest first
                }
            )
        return {
            "num_stages": self.num_stages,
            "heartbeat_s": self.heartbeat_s,
            "lease_s": self.lease_s,
            "stages": stages,
            "standby": self.standbys(),
        }

    def _select(self, where: str, args: tuple) -> list[RegisteredServer]:
        rows = self._db.execute(f"SELECT {_COLUMNS} FROM servers {where} ORDER BY stage, url", args).fetchall()
        return [RegisteredServer(*row) for row in rows]


def _row(s: RegisteredServer) -> tuple:
    return (s.server_id, s.stage, s.url, s.version, s.throughput, s.queue_length, s.registered_at, s.last_heartbeat)


def _check_id(server_id) -> str:
    if not isinstance(server_id, str) or not SERVER_ID.fullmatch(server_id):
        raise BadPayload("'server_id' must be 1..64 characters of A-Z a-z 0-9 . _ -")
    return server_id


def _check_str(name: str, value, max_len: int) -> str:
    if not isinstance(value, str) or len(value) > max_len:
        raise BadPayload(f"'{name}' must be a string of at most {max_len} characters")
    return value


def _check_url(url) -> str:
    url = _check_str("url", url, MAX_URL_LEN)
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        raise BadPayload(f"'url' is not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadPayload(f"'url' must be an http(s) URL with a host, got {url!r}")
    return url.rstrip("/")


MAX_RTT_PEERS = 64


def check_rtt(value) -> dict[str, float]:
    """``{peer URL: round-trip ms}`` from a heartbeat: at most MAX_RTT_PEERS valid URLs with
    finite times in [0, 600000]."""
    if not isinstance(value, dict) or len(value) > MAX_RTT_PEERS:
        raise BadPayload(f"'rtt_ms' must be an object of at most {MAX_RTT_PEERS} peer URLs")
    out = {}
    for url, ms in value.items():
        if type(ms) not in (int, float) or not math.isfinite(ms) or not 0 <= ms <= 600_000:
            raise BadPayload("'rtt_ms' values must be finite milliseconds in [0, 600000]")
        out[_check_url(url)] = float(ms)
    return out


REGION = re.compile(r"[A-Za-z0-9._-]{0,64}")
MAX_PARAMETERS = 10**13
MAX_SAMPLES_PER_STEP = 10**9
MAX_ACTIVATION_BYTES = 2.0**40
MAX_SPEED_FLOPS = 2.0**70
MAX_LINK_MBIT = 1e7  # 10 Tbit/s: more than any link a server has


def check_region(value) -> str:
    if not isinstance(value, str) or not REGION.fullmatch(value):
        raise BadPayload("'region' must be 0..64 characters of A-Z a-z 0-9 . _ -")
    return value


def check_speed(value) -> float:
    """A declared compute rate (``speed_flops``): a finite number of FLOP/s in [0, 2**70]."""
    if type(value) not in (int, float) or not math.isfinite(value) or not 0 <= value <= MAX_SPEED_FLOPS:
        raise BadPayload("'speed_flops' must be a finite number of FLOP/s in [0, 2**70]")
    return float(value)


def check_link(value) -> float:
    """A declared link rate (``link_mbit``): a finite number of Mbit/s in [0, 10**7]."""
    if type(value) not in (int, float) or not math.isfinite(value) or not 0 <= value <= MAX_LINK_MBIT:
        raise BadPayload(f"'link_mbit' must be a finite number of Mbit/s in [0, {MAX_LINK_MBIT:g}]")
    return float(value)


def check_report(msg: dict) -> ServerReport | None:
    """The ServerReport in a registration or heartbeat (``region``, ``workload``:
    {parameters, samples_per_step, activation_bytes_per_sample}, ``step``, ``speed_flops``,
    ``link_mbit``), None if it has none."""
    region, workload, step = msg.get("region"), msg.get("workload"), msg.get("step")
    speed, link = check_speed(msg.get("speed_flops", 0.0)), check_link(msg.get("link_mbit", 0.0))
    if region is None and workload is None and step is None and not speed and not link:
        return None
    if step is not None and (type(step) is not int or not 0 <= step < 2**53):
        raise BadPayload("'step' must be an int >= 0")
    region = "" if region is None else check_region(region)
    workload = {} if workload is None else workload
    if not isinstance(workload, dict):
        raise BadPayload("'workload' must be an object {parameters, samples_per_step, activation_bytes_per_sample}")
    parameters, samples, activation = (
        workload.get(k, 0) for k in ("parameters", "samples_per_step", "activation_bytes_per_sample")
    )
    if type(parameters) is not int or not 0 <= parameters <= MAX_PARAMETERS:
        raise BadPayload(f"'workload.parameters' must be an int in [0, {MAX_PARAMETERS}]")
    if type(samples) is not int or not 0 <= samples <= MAX_SAMPLES_PER_STEP:
        raise BadPayload(f"'workload.samples_per_step' must be an int in [0, {MAX_SAMPLES_PER_STEP}]")
    if (
        type(activation) not in (int, float)
        or not math.isfinite(activation)
        or not 0 <= activation <= MAX_ACTIVATION_BYTES
    ):
        raise BadPayload("'workload.activation_bytes_per_sample' must be a finite number in [0, 2**40]")
    return ServerReport(region, parameters, samples, float(activation), step, speed, link)


def _check_throughput(value) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        raise BadPayload("'throughput' must be a finite number >= 0")
    return float(value)


def _check_count(name: str, value) -> int:
    if type(value) is not int or not 0 <= value < 2**31:
        raise BadPayload(f"'{name}' must be an int in [0, 2**31)")
    return value
