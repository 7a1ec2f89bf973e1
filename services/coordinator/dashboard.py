"""What the coordinator's dashboard shows, as plain objects (no HTTP): recent events, the
trainers' progress, and the swarm with its weakest stage.

- :class:`RecentEvents` keeps the last events of the swarm (joins, leaves, expiries,
  moves, averaging rounds, checkpoints) in a bounded deque, with a count per event name
  since the start. :class:`EventRecorder` fills it: it wraps the coordinator's logger and
  records the lines whose event names are in :data:`DASHBOARD_EVENTS`, so every part of
  the coordinator that logs an event shows it on the dashboard without knowing about it.
- :class:`TrainingProgress` keeps each trainer's step records (``POST /progress``: step,
  loss, tokens/s, sent in batches) with a bounded history per trainer: past
  ``max_points`` it keeps every other point, so a long run stays whole at a coarser
  resolution.
"""

from __future__ import annotations

import math
import re
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable

from shared.errors import BadPayload
from shared.policy.throughput import weakest

DASHBOARD_EVENTS = frozenset(
    {
        "registry.registered",
        "registry.deregistered",
        "registry.expired",
        "placement.joiner",
        "placement.joiner.fallback",
        "rebalance.move",
        "rebalance.move.failed",
        "rebalance.held",
        "averaging.round.started",
        "averaging.start.refused",
        "averaging.pass.failed",
        "checkpoint.saved",
        "checkpoint.failed",
        "checkpoint.skipped",
        "trainer.joined",
    }
)
COUNTED_EVENTS = frozenset(
    {"step.round.started"}
)  # too frequent for the list (one per stage per global step): counted only
EVENT_FIELDS = (
    "server_id",
    "stage",
    "url",
    "replica",
    "member",
    "from_stage",
    "to_stage",
    "round_id",
    "members",
    "accepted",
    "step",
    "path",
    "trainer_id",
    "reason",
    "error",
    "removed",
)
MAX_FIELD_CHARS = 200
TRAINER_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
MAX_RECORDS = 256  # step records in one progress report (64 KiB body limit)


class RecentEvents:
    """The last ``maxlen`` events, newest last, and how many of each name since the start."""

    def __init__(self, maxlen: int = 200, clock: Callable[[], float] = time.time):
        self._events: deque[dict] = deque(maxlen=maxlen)
        self.counts: Counter[str] = Counter()
        self._clock = clock

    def add(self, event: str, level: str = "info", **fields) -> None:
        record = {"t": self._clock(), "event": event, "level": level}
        for key in EVENT_FIELDS:
            if key in fields and fields[key] is not None:
                record[key] = _json_safe(fields[key])
        self._events.append(record)
        self.counts[event] += 1

    def recent(self, limit: int | None = None) -> list[dict]:
        """Newest first."""
        events = list(reversed(self._events))
        return events if limit is None else events[:limit]


def _json_safe(value):
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        return value if math.isfinite(value) else None
    if isinstance(value, (list, tuple)) and len(value) <= 64:
        return [_json_safe(v) for v in value]
    return str(value)[:MAX_FIELD_CHARS]


class EventRecorder:
    """A structlog logger that also records its :data:`DASHBOARD_EVENTS` lines in ``events``.

    Behaves as the logger it wraps (same lines, same bound fields); ``bind`` returns a
    recorder too, so loggers derived from it keep recording."""

    _LEVELS = ("debug", "info", "warning", "warn", "error", "critical", "exception")

    def __init__(self, log, events: RecentEvents):
        self._log, self.events = log, events

    def bind(self, **fields) -> EventRecorder:
        return EventRecorder(self._log.bind(**fields), self.events)

    def __getattr__(self, name: str):
        attr = getattr(self._log, name)
        if name not in self._LEVELS:
            return attr

        def log_and_record(event: str, *args, **fields):
            if event in DASHBOARD_EVENTS:
                self.events.add(event, level="error" if name == "exception" else name, **fields)
            elif event in COUNTED_EVENTS:
                self.events.counts[event] += 1
            return attr(event, *args, **fields)

        return log_and_record


class TrainingProgress:
    """The latest reports of at most ``max_trainers`` trainers (the longest silent is dropped)."""

    def __init__(
        self,
        *,
        max_trainers: int = 32,
        max_points: int = 512,
        events: RecentEvents | None = None,
        clock: Callable[[], float] = time.time,
    ):
        assert max_trainers >= 1 and max_points >= 2, "bad progress limits"
        self.max_trainers, self.max_points, self.events, self._clock = max_trainers, max_points, events, clock
        self._trainers: OrderedDict[str, list[dict]] = OrderedDict()  # least recently reporting first

    def record(self, msg: dict) -> int:
        """Validate a ``POST /progress`` body (all records or none) and keep the records newer
        than the trainer's latest (a report sent again adds nothing); returns how many were kept."""
        trainer_id, points = _parse_progress(msg, self._clock())
        history = self._trainers.pop(trainer_id, None)
        if history is None:
            history = []
            if len(self._trainers) >= self.max_trainers:
                self._trainers.popitem(last=False)
            if self.events is not None:
                self.events.add("trainer.joined", trainer_id=trainer_id, step=points[0]["step"])
        kept = 0
        for point in points:
            if history and point["step"] <= history[-1]["step"]:
                continue  # sent again: a report whose answer the trainer did not get
            history.append(point)
            kept += 1
            if len(history) > self.max_points:
                history[:] = history[-1::-2][::-1]  # every other point, the newest kept
        self._trainers[trainer_id] = history
        return kept

    def __len__(self) -> int:
        return len(self._trainers)

    def view(self) -> dict[str, list[dict]]:
        """Each trainer's points, oldest first."""
        return {trainer_id: list(history) for trainer_id, history in self._trainers.items()}


def _parse_progress(msg: dict, now: float) -> tuple[str, list[dict]]:
    trainer_id = msg.get("trainer_id")
    if not isinstance(trainer_id, str) or not TRAINER_ID.fullmatch(trainer_id):
        raise BadPayload("'trainer_id' must be 1..64 characters of A-Z a-z 0-9 . _ -")
    records = msg.get("records")
    if not isinstance(records, list) or not 1 <= len(records) <= MAX_RECORDS:
        raise BadPayload(f"'records' must be a list of 1..{MAX_RECORDS} step records")
    return trainer_id, [_parse_record(r, now) for r in records]


def _parse_record(record, now: float) -> dict:
    if not isinstance(record, dict):
        raise BadPayload("each of 'records' must be an object {step, loss, tokens_per_s, elapsed_s}")
    step = record.get("step")
    if type(step) is not int or not 0 <= step < 2**31:
        raise BadPayload("'step' must be an int in [0, 2**31)")
    loss = record.get("loss")
    if loss is not None and (type(loss) not in (int, float) or not math.isfinite(loss)):
        raise BadPayload("'loss' must be a finite number or null (a step whose microbatches all failed)")
    point = {"t": now, "step": step, "loss": None if loss is None else float(loss)}
    for key in ("tokens_per_s", "elapsed_s"):
        value = record.get(key, 0.0)
        if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
            raise BadPayload(f"'{key}' must be a finite number >= 0")
        point[key] = float(value)
    return point


def weakest_stage(stages: list[dict]) -> int | None:
    """The stage the swarm waits on, by the policy's rule (:func:`shared.policy.throughput.weakest`)
    on ``Registry.view()``'s stages (``stage``, ``capacity``, ``replicas``, in stage order);
    None without stages."""
    index = weakest([s["capacity"] for s in stages], [len(s["replicas"]) for s in stages])
    return None if index is None else stages[index]["stage"]


def replica_health(lease_age_s: float, heartbeat_s: float) -> str:
    """'ok' while heartbeats arrive on time; 'late' once one is missed (the lease still runs)."""
    return "ok" if lease_age_s <= 1.5 * heartbeat_s else "late"


def dashboard_view(
    run_id: str, swarm: dict, progress: TrainingProgress, events: RecentEvents, *, now: float, event_limit: int = 50
) -> dict:
    """Everything the page draws, as one JSON object; ``swarm`` is ``Registry.view()``."""
    stages = []
    for stage in swarm["stages"]:
        replicas = [{**r, "health": replica_health(r["lease_age_s"], swarm["heartbeat_s"])} for r in stage["replicas"]]
        stages.append({**stage, "replicas": replicas, "queue_length": sum(r["queue_length"] for r in replicas)})
    return {
        "run_id": run_id,
        "now": now,
        "num_stages": swarm["num_stages"],
        "heartbeat_s": swarm["heartbeat_s"],
        "lease_s": swarm["lease_s"],
        "weakest_stage": weakest_stage(stages),
        "stages": stages,
        "trainers": progress.view(),
        "events": events.recent(event_limit),
        "event_counts": dict(events.counts),
    }
