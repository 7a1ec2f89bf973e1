"""The global-step protocol between a stage server and the coordinator: its messages and
the one verdict a reservation gets. The coordinator counts (``services/coordinator/steps.py``),
the replica asks and reports (``services/stage_server/stepping.py``)::

    POST /step/reserve  ReserveRequest -> ReserveAnswer {verdict, bucket, step, replicas}
    POST /step/done     DoneReport     -> {round, step}

Messages are validated on arrival (:class:`BadPayload` names the field) and unknown fields
are ignored. A reservation is for one microbatch (``microbatch_id``): a stage reserves and
accumulates each microbatch at most once, whichever replica runs its backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from shared.errors import BadPayload

MAX_URL_LEN = 512
MAX_MICROBATCH_ID_LEN = 512
MAX_INT = 2**53  # JSON integers stay exact below this


class Verdict(str, Enum):
    """What a replica does with the backward it asked a reservation for."""

    RESERVED = "reserved"  # accumulate its gradient into ``bucket``
    CLOSES = "closes"  # the same, and this reservation completed the step's global batch
    RESYNC = "resync"  # behind the stage: take a live replica's state (at ``step``), then ask again
    CATCH_UP = "catch_up"  # behind, and no live replica holds ``step`` any more: take its number, ask again
    COMPLETE = "complete"  # the trainer's ``until_step`` steps are all reserved here: accumulate nothing
    DUPLICATE = "duplicate"  # the stage holds this microbatch already (another backward of it): accumulate nothing
    WAIT = "wait"  # no step is open to it yet; the coordinator holds the request (never sent)

    @property
    def accumulates(self) -> bool:
        """Does the backward accumulate its gradient (into ``bucket``)?"""
        return self in (Verdict.RESERVED, Verdict.CLOSES)


@dataclass(frozen=True)
class ReserveRequest:
    """A replica about to run the backward of ``microbatch_id`` (``samples``) at its ``step``."""

    stage: int
    url: str  # the replica's URL, without a trailing slash
    step: int  # the replica's global step
    samples: int
    global_batch: int  # the replica's SWARM_GLOBAL_BATCH (all replicas must agree)
    microbatch_id: str
    until_step: int | None = None  # the trainer's run ends at this step
    admitted_step: int | None = None  # the step the coordinator admitted the microbatch for (its bucket's floor)

    @classmethod
    def from_json(cls, msg: dict, num_stages: int) -> ReserveRequest:
        """The request in a ``/step/reserve`` body; :class:`BadPayload` for a bad field."""
        stage, url = _stage_and_url(msg, num_stages)
        step, samples, global_batch = (_int(msg, name) for name in ("step", "samples", "global_batch"))
        until_step, admitted_step = msg.get("until_step"), msg.get("admitted_step")
        if until_step is not None:
            until_step = _int(msg, "until_step", low=1)
        if admitted_step is not None:
            admitted_step = _int(msg, "admitted_step")
        return cls(
            stage, url, step, samples, global_batch, _microbatch_id(msg.get("microbatch_id")), until_step, admitted_step
        )

    def as_json(self) -> dict:
        body = {
            "stage": self.stage,
            "url": self.url,
            "step": self.step,
            "samples": self.samples,
            "global_batch": self.global_batch,
            "microbatch_id": self.microbatch_id,
        }
        for name in ("until_step", "admitted_step"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        return body


@dataclass(frozen=True)
class ReserveAnswer:
    """The coordinator's answer to a :class:`ReserveRequest`. ``bucket``: the step the
    gradient goes to, for a verdict that accumulates (else None); ``step``: the stage's step;
    ``replicas``: the stage's live replicas (0: not said)."""

    verdict: Verdict
    bucket: int | None
    step: int
    replicas: int = 0

    def as_json(self) -> dict:
        return {"verdict": self.verdict.value, "bucket": self.bucket, "step": self.step, "replicas": self.replicas}

    @classmethod
    def from_json(cls, msg: dict) -> ReserveAnswer:
        """The answer in a ``/step/reserve`` reply; :class:`BadPayload` if it is not one."""
        try:
            verdict = Verdict(msg.get("verdict"))
        except ValueError:
            raise BadPayload(f"'verdict' must be one of {[v.value for v in Verdict]}") from None
        bucket = _int(msg, "bucket") if verdict.accumulates else None
        replicas = msg.get("replicas", 0)
        if type(replicas) is not int or replicas < 0:
            raise BadPayload("'replicas' must be an int >= 0")
        return cls(verdict, bucket, _int(msg, "step"), replicas)


@dataclass(frozen=True)
class DoneReport:
    """What a replica accumulated after the backward it reserved ``bucket`` for: ``samples``
    of the ``reserved`` it asked for (0 gives the reservation back: a failed backward, a
    duplicate). ``reserved`` 0: accumulated without a reservation (the coordinator was
    away); such a report may hold many microbatches and names none."""

    stage: int
    url: str
    step: int  # the replica's global step when it reports
    bucket: int
    reserved: int
    samples: int
    global_batch: int
    microbatch_id: str | None = None  # the reservation's; required when ``reserved`` > 0
    closes: bool = False  # the reservation completed its step's global batch

    @property
    def gives_back(self) -> bool:
        """Fewer samples accumulated than reserved: the rest of the reservation goes back."""
        return 0 < self.reserved and self.samples < self.reserved

    @classmethod
    def from_json(cls, msg: dict, num_stages: int) -> DoneReport:
        """The report in a ``/step/done`` body; :class:`BadPayload` for a bad field."""
        stage, url = _stage_and_url(msg, num_stages)
        step, bucket, reserved, samples, global_batch = (
            _int(msg, name) for name in ("step", "bucket", "reserved", "samples", "global_batch")
        )
        if reserved and samples > reserved:
            raise BadPayload(f"'samples' ({samples}) must not exceed 'reserved' ({reserved})")
        microbatch_id = msg.get("microbatch_id")
        if reserved or microbatch_id is not None:
            microbatch_id = _microbatch_id(microbatch_id)
        closes = msg.get("closes", False)
        if type(closes) is not bool:
            raise BadPayload("'closes' must be a bool")
        return cls(stage, url, step, bucket, reserved, samples, global_batch, microbatch_id, closes)

    def as_json(self) -> dict:
        body = {
            "stage": self.stage,
            "url": self.url,
            "step": self.step,
            "bucket": self.bucket,
            "reserved": self.reserved,
            "samples": self.samples,
            "global_batch": self.global_batch,
            "closes": self.closes,
        }
        return body if self.microbatch_id is None else {**body, "microbatch_id": self.microbatch_id}


def _stage_and_url(msg: dict, num_stages: int) -> tuple[int, str]:
    stage, url = msg.get("stage"), msg.get("url")
    if type(stage) is not int or not 0 <= stage < num_stages:
        raise BadPayload(f"'stage' must be an int in [0, {num_stages})")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")) or len(url) > MAX_URL_LEN:
        raise BadPayload("'url' must be the replica's http(s) URL")
    return stage, url.rstrip("/")


def _int(msg: dict, name: str, low: int | None = None) -> int:
    low = (1 if name == "global_batch" else 0) if low is None else low
    value = msg.get(name)
    if type(value) is not int or not low <= value < MAX_INT:
        raise BadPayload(f"'{name}' must be an int >= {low}")
    return value


def _microbatch_id(value) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_MICROBATCH_ID_LEN:
        raise BadPayload(f"'microbatch_id' must be a string of 1..{MAX_MICROBATCH_ID_LEN} characters")
    return value
