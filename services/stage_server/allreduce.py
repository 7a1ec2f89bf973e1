"""The all-reduce among the replicas of one stage: a butterfly over HTTP that moves and
reduces one flat vector per member; what the vector is and what a member does with the
reduction is its round's kind (:class:`RoundKind`): ``step``, a global step (the members'
accumulated gradients, then one optimizer step on each, ``stepping.StepRound``), or
``params``, the weights averaged (no longer started by the coordinator, see
:class:`_WeightsAverage`).

HTTP (bodies are msgpack maps, like ``/forward``)::

    POST /average/start  {round_id, stage, members, index, codec, timeout_s, aggregator?, kind?, step?,
                         error_feedback?} -> {round_id, accepted}; answered at once, the round runs
                         in the background; refused (409) if the round's kind does not admit it
                         (a step round for another step than this replica's)
    POST /average/part   {round_id, from, part, weight, data} -> {round_id, part}
    POST /average/result {round_id, part} -> {round_id, part, data, contributors, weight}
                         waits (at most until the round's deadline) for the reduction
    GET  /average/status[?wait=ROUND_ID&wait_s=S] -> JSON {step, rounds_completed, running,
                         last_round: {round_id, members, contributors, bytes_sent, seconds, ok, ...}};
                         with ``wait``: answered once that round ended here (at most S seconds)

Errors are JSON: 400 bad_payload (malformed), 409 wrong_stage (another stage's round) or
round_conflict (busy, unknown or finished round, not this member's part, duplicate part).

A round as member ``i`` of ``k`` runs it (``T`` = the round's ``timeout_s``; times count
from the moment this member accepted ``/average/start``):

1. The round's kind gives the flat fp32 vector and its weight ``w_i`` (a step round: the
   accumulated gradient and its samples, 0 for a replica that served none).
2. Split the vector into ``k`` contiguous parts (sizes differ by at most 1); post part
   ``j`` to member ``j``; keep part ``i``.
3. As reducer of part ``i``: once all ``k`` parts are in, or at ``DEADLINES.reduce_at * T`` with what
   arrived, compute ``sum(w x) / sum(w)`` (or CenteredClip, ``aggregation.py``) and serve it
   to whoever asks.
4. Fetch reduced part ``j`` from member ``j`` (by ``DEADLINES.fetch_by * T``). If member ``j`` cannot
   be reached or fails, re-send the ORIGINAL part ``j`` with its weight to a backup reducer
   (the first member after ``j`` in cyclic index order not seen failing) under round id
   ``"<round_id>/retry-<j>"`` and fetch its reduction (by ``DEADLINES.retry_fetch_by * T``). The
   backup reduces once every member whose part reached it in step 3 (but ``j``) re-sent
   part ``j``, or at ``DEADLINES.retry_reduce_at * T``. If that fails too, part ``j`` keeps the
   local values (``averaging.part.failed``).
5. The kind gets the concatenated parts, with which came from a backup reducer and who
   contributed to each (a step round steps only where ``stepping.step_verdict`` says so).

Every member, the reducer included, loads a reduced part as it comes out of the round's
codec, so the members of a round end with identical values (a round of one member, a
stage of one replica, sends nothing and loses nothing: its codec is ``fp32``, whatever the
run's). Nothing waits past ``T``: at the deadline the round closes here and later messages
for it are refused.

A round with ``error_feedback`` and a lossy codec compensates what the codec lost
(``error_feedback.py``): a member adds to its vector what the codec lost of the parts it
sent last time (step 2, by its kind), a reducer adds to its reduction what the codec lost of
its part last time (step 3). The residuals are each member's own: they change what it
sends, never what the members load, so the members still end with identical values.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import math
import re
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import torch
from aiohttp import web

from services.stage_server.aggregation import AGGREGATORS, byzantine_values, centered_clip, sample_weight
from services.stage_server.routes import RUNTIME, SETTINGS, WORKER
from services.stage_server.runtime import apply_average, snapshot
from shared.codec import FLOAT_CODECS, decode_tensor, encode_tensor, pack_message, unpack_message
from shared.errors import BadPayload, RemoteError, SwarmError, WrongStage
from shared.http import MSGPACK, msgpack_response, post_message, read_message, swarm_session
from shared.log import get_logger

_START_WAIT_S = 5.0  # how long a result request waits for a round whose parts came before its start

_MAX_MEMBERS = 256
_MAX_TIMEOUT_S = 3600.0
_MAX_WEIGHT = 1e15
_OFF_LOOP_VALUES = 64 * 1024  # codec and reduction work on larger parts runs in a thread
_RETRY_SEP = "/retry-"


@dataclass(frozen=True)
class _Deadlines:
    """When each phase of a round ends, as fractions of its ``timeout_s`` (see above)."""

    reduce_at: float = 0.4
    fetch_by: float = 0.6
    retry_reduce_at: float = 0.8
    retry_fetch_by: float = 0.95


DEADLINES = _Deadlines()
_ROUND_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class RoundConflict(SwarmError):
    """The message does not fit this server's round: busy, unknown, over, or not its part."""

    status = 409
    code = "round_conflict"


class Transport(Protocol):
    async def post(self, url: str, body: bytes, *, timeout_s: float) -> dict:
        """POST a packed message, return the decoded reply; raise :class:`RemoteError` on any failure."""

    async def refuses(self, url: str) -> bool:
        """Whether nothing listens at ``url``'s address now: a new connection is refused (the
        peer's process is gone). False when it connects, or cannot tell."""


# ------------------------------------------------------------------ pure pieces
def split_bounds(n: int, k: int, shares: tuple[float, ...] | None = None) -> list[tuple[int, int]]:
    """``k`` contiguous ``[start, stop)`` ranges covering ``range(n)``: sizes that differ by at
    most 1, or in proportion to ``shares`` (k positive numbers, the coordinator's
    ``averaging.round_shares``; every part at least 1 value where ``n >= k``). A function of its arguments
    only: every member computes the same bounds."""
    assert k >= 1 and n >= 0, f"cannot split {n} values into {k} parts"
    if shares is None:
        base, extra = divmod(n, k)
        sizes = [base + (j < extra) for j in range(k)]
    else:
        assert len(shares) == k and all(x > 0 for x in shares), f"{k} positive shares, got {shares}"
        total = math.fsum(shares)
        exact = [n * x / total for x in shares]
        sizes = [math.floor(e) for e in exact]
        by_fraction = sorted(range(k), key=lambda j: (sizes[j] - exact[j], j))  # largest remainder first
        for j in by_fraction[: n - sum(sizes)]:
            sizes[j] += 1
        for j in range(k):  # no empty part while there are values enough: take one from the largest
            if sizes[j] == 0 and n >= k:
                largest = max(range(k), key=lambda i: (sizes[i], -i))
                sizes[largest] -= 1
                sizes[j] = 1
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


def backup_reducer(part: int, k: int, dead: set[int]) -> int | None:
    """The member that reduces ``part`` when its reducer failed: the next one after it, cyclically, not in ``dead``."""
    return next((b for b in ((part + s) % k for s in range(1, k)) if b not in dead), None)


def _values_sent(num_params: int, k: int, index: int) -> int:
    """Values member ``index`` sends in a round without failures: its k-1 other parts, then its
    reduced part to k-1 members; ``P + (k-2) * |part|``, about ``2 P (k-1) / k``."""
    start, stop = split_bounds(num_params, k)[index]
    return num_params + (k - 2) * (stop - start)


def retry_round_id(round_id: str, part: int) -> str:
    return f"{round_id}{_RETRY_SEP}{part}"


# ------------------------------------------------------------------ messages
def _require(cond: bool, message: str) -> None:
    if not cond:
        raise BadPayload(message)


def _is_number(x: Any) -> bool:
    return type(x) in (int, float) and math.isfinite(x)


_ROUND_KINDS = ("params", "step")


@dataclass(frozen=True)
class RoundSpec:
    """``/average/start``: the round, its members in index order, this member's index; a
    ``step`` round also names the stage's step it takes (the members must all be there)."""

    round_id: str
    stage: int
    members: tuple[str, ...]
    index: int
    codec: str
    timeout_s: float
    aggregator: str = "mean"
    kind: str = "params"
    step: int = 0
    error_feedback: bool = False  # a step round: each member adds back what its compression lost last step
    lookahead: int | None = None  # a step round: the admission's; see Averager.hold_for
    shares: tuple[float, ...] | None = None  # each member's part of the vector to reduce (None: equal parts)

    @property
    def k(self) -> int:
        return len(self.members)

    @classmethod
    def from_message(cls, msg: dict, stage: int) -> RoundSpec:
        round_id, members, index = msg.get("round_id"), msg.get("members"), msg.get("index")
        _require(
            isinstance(round_id, str) and bool(_ROUND_ID.fullmatch(round_id)),
            "'round_id' must be 1..128 characters of [A-Za-z0-9._:-]",
        )
        _require(type(msg.get("stage")) is int, "'stage' must be an int")
        _require(
            isinstance(members, list) and 1 <= len(members) <= _MAX_MEMBERS,
            f"'members' must be a list of 1..{_MAX_MEMBERS} URLs",
        )
        _require(
            all(isinstance(u, str) and u.startswith(("http://", "https://")) and len(u) <= 2048 for u in members),
            "'members' must be http(s) URLs",
        )
        _require(len(set(members)) == len(members), "'members' lists a URL twice")
        _require(type(index) is int and 0 <= index < len(members), f"'index' must be an int in [0, {len(members)})")
        _require(
            isinstance(msg.get("codec"), str) and msg["codec"] in FLOAT_CODECS, f"'codec' must be one of {FLOAT_CODECS}"
        )
        timeout_s = msg.get("timeout_s")
        _require(
            _is_number(timeout_s) and 0 < timeout_s <= _MAX_TIMEOUT_S,
            f"'timeout_s' must be a number in (0, {_MAX_TIMEOUT_S}]",
        )
        aggregator = msg.get("aggregator", "mean")
        _require(
            isinstance(aggregator, str) and aggregator in AGGREGATORS, f"'aggregator' must be one of {AGGREGATORS}"
        )
        kind, step = msg.get("kind", "params"), msg.get("step", 0)
        _require(isinstance(kind, str) and kind in _ROUND_KINDS, f"'kind' must be one of {_ROUND_KINDS}")
        _require(type(step) is int and 0 <= step < 2**53, "'step' must be an int >= 0")
        error_feedback = msg.get("error_feedback", False)
        _require(type(error_feedback) is bool, "'error_feedback' must be a boolean")
        lookahead = msg.get("lookahead")
        _require(
            lookahead is None or (type(lookahead) is int and 0 <= lookahead < 2**53), "'lookahead' must be an int >= 0"
        )
        shares = msg.get("shares")
        _require(
            shares is None
            or (
                isinstance(shares, list)
                and len(shares) == len(members)
                and all(_is_number(x) and 0 < x <= 2**53 for x in shares)
            ),
            "'shares' must be a list of one positive number per member",
        )
        if msg["stage"] != stage:
            raise WrongStage(f"this server holds stage {stage}, not {msg['stage']}")
        return cls(
            round_id,
            stage,
            tuple(u.rstrip("/") for u in members),
            index,
            msg["codec"],
            float(timeout_s),
            aggregator,
            kind,
            step,
            error_feedback,
            lookahead,
            None if shares is None else tuple(float(x) for x in shares),
        )


@dataclass(frozen=True)
class PartMessage:
    """``/average/part`` without its values: member ``sender`` contributes ``part`` with ``weight``."""

    round_id: str
    sender: int
    part: int
    weight: float

    @classmethod
    def from_message(cls, msg: dict) -> PartMessage:
        round_id, part = _parse_part_request(msg)
        sender, weight = msg.get("from"), msg.get("weight")
        _require(type(sender) is int and 0 <= sender < _MAX_MEMBERS, f"'from' must be an int in [0, {_MAX_MEMBERS})")
        _require(
            _is_number(weight) and 0 <= weight <= _MAX_WEIGHT, f"'weight' must be a number in [0, {_MAX_WEIGHT:g}]"
        )
        return cls(round_id, sender, part, float(weight))


def _parse_part_request(msg: dict) -> tuple[str, int]:
    """(round_id, part) of a ``/average/part`` or ``/average/result`` message."""
    round_id, part = msg.get("round_id"), msg.get("part")
    base, _, _ = round_id.partition(_RETRY_SEP) if isinstance(round_id, str) else ("", "", "")
    _require(bool(_ROUND_ID.fullmatch(base)) and len(round_id) <= 160, "'round_id' must name a round")
    _require(type(part) is int and 0 <= part < _MAX_MEMBERS, f"'part' must be an int in [0, {_MAX_MEMBERS})")
    return round_id, part


def decode_values(obj: Any, max_numel: int) -> torch.Tensor:
    """A part's values off the wire: a finite 1-D float tensor, as fp32."""
    values = decode_tensor(obj, name="data", max_numel=max_numel)
    _require(
        values.dim() == 1 and values.is_floating_point(),
        f"'data' must be a 1-D float tensor, got {values.dtype} {list(values.shape)}",
    )
    _require(bool(torch.isfinite(values).all()), "'data' contains non-finite values")
    return values.float()


@dataclass(frozen=True)
class ReducedPart:
    values: torch.Tensor  # fp32, as every member loads it (after the round codec)
    contributors: tuple[int, ...]
    weight: float
    body: bytes = b""  # the packed /average/result reply (reducer side)
    lost: torch.Tensor | None = None  # reducer side, with error feedback: what the codec lost of the reduction


def _parse_reduced(reply: dict, size: int) -> ReducedPart:
    values = decode_values(reply.get("data"), size)
    contributors, weight = reply.get("contributors"), reply.get("weight")
    _require(values.numel() == size, f"reduced part has {values.numel()} values, expected {size}")
    _require(
        isinstance(contributors, list) and all(type(c) is int for c in contributors),
        "'contributors' must be a list of ints",
    )
    _require(_is_number(weight), "'weight' must be a number")
    return ReducedPart(values, tuple(contributors), float(weight))


async def off_loop(numel: int, fn: Callable, *args: Any) -> Any:
    return await asyncio.to_thread(fn, *args) if numel >= _OFF_LOOP_VALUES else fn(*args)


def weighted_mean(contributions: Mapping[int, tuple[float, torch.Tensor]]) -> torch.Tensor:
    """``sum(w x) / sum(w)`` over ``{member: (w, x)}``, summed in member order in float64; fp32.
    All weights 0 (a step round of replicas that served no sample): zeros."""
    assert contributions, "a weighted mean needs a contribution"
    total = sum(w for w, _ in contributions.values())
    if total <= 0:
        return torch.zeros_like(next(iter(contributions.values()))[1], dtype=torch.float32)
    acc = None
    for member in sorted(contributions):
        w, x = contributions[member]
        if acc is None:
            acc = x.to(torch.float64) * (w / total)
        else:
            acc.add_(x.to(torch.float64), alpha=w / total)
    return acc.to(torch.float32)


# ------------------------------------------------------------------ reducers and rounds
class PartReducer:
    """Collects ``{member: (weight, values)}`` for one part of one round and reduces them once."""

    def __init__(
        self,
        round_id: str,
        part: int,
        size: int,
        codec: str,
        int8_block: int,
        expected: set[int] | None,
        aggregator: str = "mean",
    ):
        self.round_id, self.part, self.size, self.codec, self.int8_block = round_id, part, size, codec, int8_block
        self.aggregator = aggregator
        self.expected = expected  # None: not known yet (a backup reducer before its own round reduced)
        self.contributions: dict[int, tuple[float, torch.Tensor]] = {}
        self.feedback: torch.Tensor | None = None  # error feedback: added to the reduction before the codec
        self.closed = False
        self._complete = asyncio.Event()
        self._reduction: asyncio.Future | None = None

    def add(self, member: int, weight: float, values: torch.Tensor | None) -> None:
        """``values`` None: a member with no sample in a step round sent its weight (0) only."""
        if self.closed or self._reduction is not None:
            raise RoundConflict(f"part {self.part} of round {self.round_id!r} is already reduced")
        if member in self.contributions:
            raise RoundConflict(f"member {member} already sent part {self.part} of round {self.round_id!r}")
        if values is None:
            _require(weight == 0, "a part without values must have weight 0")
            values = torch.zeros(self.size)
        _require(values.numel() == self.size, f"part {self.part} has {self.size} values, got {values.numel()}")
        self.contributions[member] = (weight, values)
        self._check_complete()

    def expect(self, members: set[int]) -> None:
        self.expected = set(members)
        self._check_complete()

    def forget(self, member: int) -> None:
        """``member`` is gone and will send nothing: stop waiting for it."""
        if self.expected is not None:
            self.expected.discard(member)
            self._check_complete()

    def _check_complete(self) -> None:
        if self.expected is not None and self.expected <= self.contributions.keys():
            self._complete.set()

    def close(self) -> None:
        self.closed = True
        self.contributions = {}
        self._complete.set()  # wakes the waiters, who find the part closed

    async def reduced(self, reduce_at: float) -> ReducedPart:
        """The reduction, as soon as every expected member contributed, else at ``reduce_at``
        (loop time) with what arrived. Raises :class:`RoundConflict` once the round closed."""
        if self._reduction is None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._complete.wait(), max(0.0, reduce_at - asyncio.get_running_loop().time()))
            if self.closed:
                raise RoundConflict(f"round {self.round_id!r} is over")
            if self._reduction is None:
                contributions, self.contributions = self.contributions, {}
                if not contributions:
                    raise RoundConflict(f"nothing arrived for part {self.part} of round {self.round_id!r}")
                self._reduction = asyncio.ensure_future(
                    off_loop(self.size * len(contributions), self._reduce, contributions)
                )
        return await asyncio.shield(self._reduction)

    def _reduce(self, contributions: dict[int, tuple[float, torch.Tensor]]) -> ReducedPart:
        if self.aggregator == "centered_clip":
            mean, _ = centered_clip(contributions)
        else:
            mean = weighted_mean(contributions)
        contributors, weight = sorted(contributions), sum(w for w, _ in contributions.values())
        if self.feedback is not None:
            mean = mean + self.feedback
        wire = encode_tensor(mean, self.codec, int8_block=self.int8_block)
        body = pack_message(
            {"round_id": self.round_id, "part": self.part, "data": wire, "contributors": contributors, "weight": weight}
        )
        values = decode_values(unpack_message(body)["data"], self.size)  # what every fetcher will load
        lost = mean - values if self.feedback is not None else None
        return ReducedPart(values, tuple(contributors), weight, body, lost)


class AveragingRound:
    """One round as one member runs it: deadlines, snapshot, the reducers it serves, bytes sent."""

    def __init__(self, spec: RoundSpec, num_params: int, int8_block: int, started_at: float):
        self.spec, self.int8_block, self.started_at = spec, int8_block, started_at
        self.codec = spec.codec if spec.k > 1 else "fp32"  # a round of one member: nothing travels, nothing lost
        self.deadline = started_at + spec.timeout_s
        self.bounds = split_bounds(num_params, spec.k, spec.shares)
        self.main = self._reducer(spec.round_id, spec.index, set(range(spec.k)))
        self.retries: dict[int, PartReducer] = {}
        self.main_contributors: set[int] | None = None
        self.snapshot: torch.Tensor | None = None
        self.weight = 0.0
        self.dead: set[int] = set()
        self.bytes_sent = 0
        self.closed = False
        self.parts: list[ReducedPart | None] = []
        self.backups: set[int] = set()  # the parts that came from a backup reducer
        self.verdict: enum.Enum | None = None  # what the round's kind decided with its parts (a step round's)
        self.applied: bool | None = None  # whether it applied them (None: the parts' outcome says)
        self.samples: int | None = None  # a step round: the samples this member's gradient held (else its weight says)
        self.sent_lost: torch.Tensor | None = None  # with error feedback: what the codec lost of the parts sent
        self.outcome: dict = {
            "contributors": [],
            "part_contributors": [],
            "parts_failed": [],
            "seconds": None,
            "ok": False,
        }

    def at(self, fraction: float) -> float:
        return self.started_at + fraction * self.spec.timeout_s

    def _reducer(self, round_id: str, part: int, expected: set[int] | None) -> PartReducer:
        start, stop = self.bounds[part]
        return PartReducer(round_id, part, stop - start, self.codec, self.int8_block, expected, self.spec.aggregator)

    def reducer(self, round_id: str, part: int) -> tuple[PartReducer, float]:
        """The reducer of ``part`` under ``round_id`` (the round's or one of its retries) and its reduce time."""
        spec = self.spec
        if self.closed:
            raise RoundConflict(f"round {spec.round_id!r} is over")
        if round_id == spec.round_id:
            if part != spec.index:
                raise RoundConflict(
                    f"member {spec.index} reduces part {spec.index} of round {spec.round_id!r}, not part {part}"
                )
            return self.main, self.at(DEADLINES.reduce_at)
        if round_id != retry_round_id(spec.round_id, part) or part >= spec.k or part == spec.index:
            raise RoundConflict(f"{round_id!r} is no retry this member can reduce in round {spec.round_id!r}")
        if part not in self.retries:
            expected = None if self.main_contributors is None else self.main_contributors - {part}
            self.retries[part] = self._reducer(round_id, part, expected)
            if self.snapshot is not None:
                self.retries[part].add(spec.index, self.weight, self.own_part(part))
        return self.retries[part], self.at(DEADLINES.retry_reduce_at)

    def accept(self, msg: PartMessage, values: torch.Tensor | None) -> None:
        _require(
            msg.sender < self.spec.k and msg.sender != self.spec.index,
            f"'from' must be another member's index in [0, {self.spec.k})",
        )
        reducer, _ = self.reducer(msg.round_id, msg.part)
        reducer.add(msg.sender, msg.weight, values)

    def own_part(self, part: int) -> torch.Tensor:
        start, stop = self.bounds[part]
        return self.snapshot[start:stop]

    def set_snapshot(self, flat: torch.Tensor, weight: float) -> None:
        """Our own contributions go to every reducer still collecting (a slow snapshot may miss one)."""
        self.snapshot, self.weight = flat, weight
        for part, reducer in [(self.spec.index, self.main), *self.retries.items()]:
            with contextlib.suppress(RoundConflict):
                reducer.add(self.spec.index, weight, self.own_part(part))

    def set_main_contributors(self, contributors: tuple[int, ...]) -> None:
        """A backup reducer of part j waits for the members that reached us, but j."""
        self.main_contributors = set(contributors)
        for part, reducer in self.retries.items():
            reducer.expect(self.main_contributors - {part})

    def gone(self, member: int) -> None:
        """``member``'s server refused a connection: its process is gone (a restarted one would
        not know this round), so no reducer here waits for its parts until the reduce time."""
        if member == self.spec.index:
            return
        self.dead.add(member)
        for reducer in (self.main, *self.retries.values()):
            reducer.forget(member)

    def finish(self, parts: list[ReducedPart | None], seconds: float) -> None:
        reached = [set(p.contributors) for p in parts if p is not None]
        self.outcome = {
            "contributors": sorted(set.intersection(*reached)) if reached else [],
            "part_contributors": [list(p.contributors) if p is not None else None for p in parts],
            "parts_failed": [j for j, p in enumerate(parts) if p is None],
            "seconds": round(seconds, 4),
            "ok": all(p is not None for p in parts) if self.applied is None else self.applied,
            **({"verdict": self.verdict.value} if self.verdict is not None else {}),
        }

    def close(self) -> None:
        """At the deadline (or on shutdown): refuse everything for this round and free its tensors."""
        self.closed = True
        self.snapshot = None
        for reducer in (self.main, *self.retries.values()):
            reducer.close()

    def summary(self) -> dict:
        spec = self.spec
        return {
            "round_id": spec.round_id,
            "members": list(spec.members),
            "index": spec.index,
            "codec": spec.codec,
            "aggregator": spec.aggregator,
            "weight": self.weight,
            "bytes_sent": self.bytes_sent,
            **({"samples": self.samples} if self.samples is not None else {}),
            **({"error_feedback": True} if self.sent_lost is not None else {}),
            **self.outcome,
        }


# ------------------------------------------------------------------ one member's side of rounds
class RoundKind(Protocol):
    """What a kind of round does on a member: the vector it puts in and what it does with
    the reduction (``params``: the weights averaged, below; ``step``: a global step, see
    ``stepping.StepRound``). The all-reduce itself knows no kind."""

    def admit(self, spec: RoundSpec) -> None:
        """:class:`RoundConflict` if this member cannot take ``spec`` now."""

    async def run(self, rnd: AveragingRound, log) -> bool:
        """This member's side of ``rnd``, its vector reduced by :meth:`Averager.reduce`; True
        if the round did what it is for here."""

    def status(self) -> dict:
        """What ``GET /average/status`` shows of this kind."""


class Averager:
    """A stage server's part in averaging rounds: runs at most one round at a time, serves the
    reductions it owes, and hands each round to its kind (:attr:`kinds`). ``run_compute`` is
    the compute worker's ``run``; ``transport`` is set once the server has a client session."""

    def __init__(
        self,
        runtime,
        run_compute: Callable[..., Awaitable[Any]],
        *,
        int8_block: int,
        log,
        byzantine: tuple[str, float] | None = None,
    ):
        self.runtime, self.run_compute, self.int8_block, self.log = runtime, run_compute, int8_block, log
        self.byzantine = byzantine  # fault injection: (mode, factor) of what this replica sends instead
        self.num_params = sum(p.numel() for p in runtime.params)
        self.transport: Transport | None = None
        self.kinds: dict[str, RoundKind] = {"params": _WeightsAverage(self)}
        self.round: AveragingRound | None = None  # the latest round started here
        self.last_round: AveragingRound | None = None  # the latest round that ended here
        self.rounds_completed = 0
        self.rounds_started = 0  # started - completed - running = failed (metrics)
        self.bytes_sent = 0  # by the rounds that ended here, all kinds: parts posted and reductions served
        self._task: asyncio.Task | None = None
        self._close_handle: asyncio.TimerHandle | None = None
        self._early: tuple[str, dict[int, tuple[PartMessage, torch.Tensor]]] = ("", {})  # parts before their start
        self._refused = ""  # the last round whose start this server refused (another stage)
        self._started = asyncio.Event()
        self._stepped = asyncio.Event()  # set and replaced after every step taken here
        self.closing = False

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def status(self) -> dict:
        extra = {k: v for kind in self.kinds.values() for k, v in kind.status().items()}
        return {
            "step": self.runtime.step,
            "rounds_completed": self.rounds_completed,
            "bytes_sent": self.bytes_sent,
            **extra,
            "running": self.round.spec.round_id if self.running else None,
            "last_round": self.last_round.summary() if self.last_round else None,
        }

    def start(self, spec: RoundSpec) -> None:
        """Start ``spec`` in the background; refused while a round runs (one at a time)."""
        if self.closing or self.transport is None:
            raise RoundConflict("this server is not taking averaging rounds (starting up or shutting down)")
        if self.running:
            raise RoundConflict(f"round {self.round.spec.round_id!r} is still running here; one round at a time")
        kind = self.kinds.get(spec.kind)
        if kind is None:
            raise RoundConflict(f"this server takes no {spec.kind!r} rounds")
        kind.admit(spec)
        self._retire()
        loop = asyncio.get_running_loop()
        rnd = AveragingRound(spec, self.num_params, self.int8_block, loop.time())
        early_id, early = self._early
        self._early = ("", {})
        for msg, values in early.values() if early_id == spec.round_id else ():
            try:
                rnd.accept(msg, values)
            except SwarmError as exc:
                self.log.warning(
                    "averaging.part.dropped", round_id=spec.round_id, sender=msg.sender, reason=exc.message
                )
        self.round = rnd
        self.rounds_started += 1
        self._close_handle = loop.call_at(rnd.deadline, rnd.close)
        self._task = asyncio.create_task(self._run(rnd, kind), name=f"averaging-{spec.round_id}")
        self._wake_result_waiters()

    def stepped(self) -> None:
        """A round's kind took a global step here: wake :meth:`wait_step`."""
        self._stepped.set()
        self._stepped = asyncio.Event()

    async def wait_step(self, step: int, timeout_s: float) -> None:
        """Until this replica has taken global step ``step`` (at most ``timeout_s``)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.runtime.step < step:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stepped.wait(), left)

    async def hold_for(self, admitted_step: int | None) -> None:
        """Before a training forward of a microbatch admitted for ``admitted_step``: while a
        step round that moves the stage with its first member's step (``lookahead`` given) runs
        here, and the admission counts on the weights that round makes (the microbatch's step
        is more than ``lookahead`` past this replica's), wait until it ended here (at most its
        timeout). Its stage may have moved already, its faster members applied; the trainer's
        admission let the microbatch in on that, and a forward here on the weights before
        would put an older gradient in the step than the admission allows."""
        rnd = self.round
        if admitted_step is None or not self.running or rnd.spec.kind != "step" or rnd.spec.lookahead is None:
            return
        if admitted_step - rnd.spec.lookahead > self.runtime.step:
            await self.wait_round(rnd.spec.round_id, rnd.spec.timeout_s)

    async def wait_round(self, round_id: str, timeout_s: float) -> None:
        """Until round ``round_id`` ended here (at once if it is not the one running)."""
        if self.running and self.round.spec.round_id == round_id:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._task), timeout_s)

    def refuse(self, round_id: str) -> None:
        """A start for another stage came: drop its parts sent ahead, refuse its messages from now on."""
        self._refused = round_id
        if self._early[0] == round_id:
            self._early = ("", {})
        self._wake_result_waiters()

    def _wake_result_waiters(self) -> None:
        self._started.set()
        self._started = asyncio.Event()

    def accept_part(self, msg: PartMessage, values: torch.Tensor | None) -> None:
        rnd = self.round
        if rnd is not None and _of_round(msg.round_id, rnd.spec.round_id):
            rnd.accept(msg, values)
        elif self.running or self.closing:
            raise RoundConflict(
                f"busy with round {rnd.spec.round_id!r}, not {msg.round_id!r}" if self.running else "shutting down"
            )
        elif _RETRY_SEP in msg.round_id or msg.round_id == self._refused:
            raise RoundConflict(f"round {msg.round_id.partition(_RETRY_SEP)[0]!r} is unknown here")
        else:  # the part beat its round's start here: keep it (one round's worth) until the start comes
            early_id, early = self._early
            if early_id != msg.round_id:
                early_id, early = msg.round_id, {}
            if msg.sender in early:
                raise RoundConflict(f"member {msg.sender} already sent its part of round {msg.round_id!r}")
            if _numel(values) + sum(_numel(v) for _, v in early.values()) > self.num_params:
                raise RoundConflict(f"too many values sent ahead of round {msg.round_id!r}")
            early[msg.sender] = (msg, values)
            self._early = (early_id, early)

    async def result(self, round_id: str, part: int) -> ReducedPart:
        """The reduction of ``part`` this member owes in ``round_id``, once ready; counts the bytes served."""
        rnd = self.round
        if (rnd is None or not _of_round(round_id, rnd.spec.round_id)) and self._early[0] == round_id:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._started.wait(), _START_WAIT_S)
            rnd = self.round
        if rnd is None or not _of_round(round_id, rnd.spec.round_id):
            raise RoundConflict(f"round {round_id.partition(_RETRY_SEP)[0]!r} is unknown here")
        reducer, reduce_at = rnd.reducer(round_id, part)
        reduced = await reducer.reduced(reduce_at)
        rnd.bytes_sent += len(reduced.body)
        return reduced

    async def close(self) -> None:
        """Stop the running round (others leave this member out) and refuse new ones."""
        self.closing = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._retire()
        self._wake_result_waiters()

    def _retire(self) -> None:
        if self._close_handle is not None:
            self._close_handle.cancel()
        if self.round is not None:
            self.round.close()

    async def _run(self, rnd: AveragingRound, kind: RoundKind) -> None:
        spec, started = rnd.spec, time.perf_counter()
        log = self.log.bind(round_id=spec.round_id, index=spec.index, members=spec.k, kind=spec.kind)
        try:
            if await kind.run(rnd, log):
                self.rounds_completed += 1
            rnd.finish(rnd.parts, time.perf_counter() - started)
            log.info(
                "averaging.round.done",
                **{k: v for k, v in rnd.summary().items() if k not in ("round_id", "index", "members")},
            )
        except asyncio.CancelledError:
            log.warning("averaging.round.failed", reason="cancelled (server shutting down)")
            raise
        except SwarmError as exc:  # e.g. a params round's job refused: the compute queue is full, or a drain
            log.warning("averaging.round.failed", reason=exc.message)
        except Exception as exc:  # a bug: log it whole; the server keeps serving
            log.exception("averaging.round.failed", reason=repr(exc))
        finally:
            rnd.outcome["seconds"] = round(time.perf_counter() - started, 4)
            self.bytes_sent += rnd.bytes_sent
            self.last_round = rnd

    # -------------------------------------------------------------- the butterfly
    async def reduce(self, rnd: AveragingRound, sent: torch.Tensor, weight: float, log) -> torch.Tensor:
        """This member's side of the butterfly: ``sent`` in (as a fault-injected attacker sends
        it, if this replica is one), the reduced parts out (``rnd.parts``: None where a part
        failed, whose values stay ``sent``'s)."""
        sent = self._as_sent(sent, log)
        rnd.set_snapshot(sent, weight)
        log.info(
            "averaging.round.started",
            weight=weight,
            codec=rnd.spec.codec,
            aggregator=rnd.spec.aggregator,
            parameters=self.num_params,
        )
        rnd.parts = await asyncio.gather(*(self._obtain(rnd, sent, j, log) for j in range(rnd.spec.k)))
        reduced = sent.clone()
        for (start, stop), part in zip(rnd.bounds, rnd.parts):
            if part is not None:
                reduced[start:stop] = part.values
        return reduced

    def _sends_nothing(self, rnd: AveragingRound) -> bool:
        """A step round's member with no sample of the step (weight 0): under the mean its values
        change nothing, so it sends none (a weak replica the wiring gave no microbatch spent a
        fifth of a second of its CPU encoding zeros, and its peer's link as long receiving
        them). Not with CenteredClip (its median counts every member) nor error feedback."""
        spec = rnd.spec
        return spec.kind == "step" and rnd.weight == 0 and spec.aggregator == "mean" and rnd.sent_lost is None

    def _as_sent(self, flat: torch.Tensor, log) -> torch.Tensor:
        if self.byzantine is None:
            return flat
        log.warning("averaging.byzantine", mode=self.byzantine[0], factor=self.byzantine[1])
        return byzantine_values(flat, *self.byzantine, seed=self.rounds_completed)

    async def _obtain(self, rnd: AveragingRound, flat: torch.Tensor, j: int, log) -> ReducedPart | None:
        """Reduced part ``j``: reduced here, fetched from member ``j``, or from a backup reducer; None: keep ours."""
        spec = rnd.spec
        try:
            if j == spec.index:
                reduced = await rnd.main.reduced(rnd.at(DEADLINES.reduce_at))
                rnd.set_main_contributors(reduced.contributors)
                return reduced
            reduced = await self._exchange(
                rnd,
                flat,
                spec.members[j],
                spec.round_id,
                j,
                rnd.at(DEADLINES.reduce_at),
                rnd.at(DEADLINES.fetch_by),
                log,
            )
            if reduced is not None:
                return reduced
            rnd.dead.add(j)
            rnd.backups.add(j)
            backup = backup_reducer(j, spec.k, rnd.dead)
            log.info("averaging.part.retry", part=j, backup=backup)
            if backup == spec.index:  # our part j goes into its reduction as it is: nothing of it lost
                if rnd.sent_lost is not None:
                    rnd.sent_lost[slice(*rnd.bounds[j])] = 0.0
                reducer, reduce_at = rnd.reducer(retry_round_id(spec.round_id, j), j)
                return await reducer.reduced(reduce_at)
            if backup is not None:
                url = spec.members[backup]
                reduced = await self._exchange(
                    rnd,
                    flat,
                    url,
                    retry_round_id(spec.round_id, j),
                    j,
                    rnd.at(DEADLINES.retry_reduce_at),
                    rnd.at(DEADLINES.retry_fetch_by),
                    log,
                )
                if reduced is None:
                    rnd.dead.add(backup)
        except RoundConflict as exc:  # the round closed under us (deadline or shutdown)
            log.warning("averaging.part.failed", part=j, reason=exc.message)
            return None
        if reduced is None:
            log.warning(
                "averaging.part.failed", part=j, reason="its reducer and backup failed; keeping the local values"
            )
        return reduced

    async def _exchange(self, rnd, flat, url, round_id, part, send_by, fetch_by, log) -> ReducedPart | None:
        """Post our original ``part`` to the reducer at ``url`` under ``round_id``, then fetch
        its reduction; None on any failure. Bytes of posts that reached the peer are counted."""
        spec, (start, stop) = rnd.spec, rnd.bounds[part]
        msg = {"round_id": round_id, "from": spec.index, "part": part, "weight": rnd.weight}
        lost = rnd.sent_lost[start:stop] if rnd.sent_lost is not None else None
        if self._sends_nothing(rnd):  # no sample here: the reducer counts our weight 0 without values
            body = pack_message({**msg, "empty": True})
        else:
            body = await off_loop(stop - start, _pack_part, msg, flat[start:stop], rnd.codec, self.int8_block, lost)
        try:
            try:
                await self.transport.post(url + "/average/part", body, timeout_s=_left(send_by))
            except RemoteError as exc:
                rnd.bytes_sent += 0 if exc.code == "unreachable" else len(body)  # unreachable: nothing went out
                raise
            rnd.bytes_sent += len(body)
            request = pack_message({"round_id": round_id, "part": part})
            reply = await self.transport.post(url + "/average/result", request, timeout_s=_left(fetch_by))
            return await off_loop(stop - start, _parse_reduced, reply, stop - start)
        except RemoteError as exc:
            # A peer killed mid-round breaks the connections it had open (reset, not refused),
            # and the session's other idle connections to it are as dead: only a new connection
            # tells that it is gone. Else every reducer here waits for its parts until the reduce
            # time (``bench joins`` found a stage, and so the swarm, stalled 8 s by a replica
            # killed as its step round started).
            gone = exc.refused or (exc.code == "unreachable" and await self.transport.refuses(url))
            if gone and url in spec.members:
                rnd.gone(spec.members.index(url))
            log.info(
                "averaging.member.failed",
                url=url,
                round_id=round_id,
                part=part,
                status=exc.status,
                code=exc.code,
                reason=exc.message,
                gone=gone,
            )
        except BadPayload as exc:
            log.warning(
                "averaging.member.failed", url=url, round_id=round_id, part=part, code="bad_reply", reason=exc.message
            )
        return None


class _WeightsAverage:
    """A ``params`` round: the members' weights averaged (weighted by the samples each
    processed since its last round), what each learned meanwhile kept (``apply_average``).
    The coordinator starts none: replicas that take every global step together stay
    identical, and one that drifted takes a whole state (``state_routes.py``); averaging
    weights alone would leave the optimizer states apart."""

    def __init__(self, averager: Averager):
        self.averager = averager
        self.samples_at_last_round = 0

    def admit(self, spec: RoundSpec) -> None:
        pass

    def status(self) -> dict:
        return {}

    async def run(self, rnd: AveragingRound, log) -> bool:
        averager = self.averager
        flat, samples = await averager.run_compute(snapshot, averager.runtime)
        averaged = await averager.reduce(rnd, flat, sample_weight(samples, self.samples_at_last_round), log)
        await averager.run_compute(apply_average, averager.runtime, flat, averaged)
        self.samples_at_last_round = samples
        return True


def _of_round(round_id: str, base: str) -> bool:
    return round_id == base or round_id.startswith(base + _RETRY_SEP)


def _numel(values: torch.Tensor | None) -> int:
    return 0 if values is None else values.numel()


def _pack_part(msg: dict, values: torch.Tensor, codec: str, int8_block: int, lost: torch.Tensor | None) -> bytes:
    """The ``/average/part`` body of ``values``; ``lost`` (error feedback): set to what the codec lost of them."""
    body = pack_message({**msg, "data": encode_tensor(values, codec, int8_block=int8_block)})
    if lost is not None:
        lost.copy_(values - decode_values(unpack_message(body)["data"], values.numel()))
    return body


def _left(until: float) -> float:
    """Seconds left until loop time ``until``; never 0, which aiohttp reads as 'no timeout'."""
    return max(until - asyncio.get_running_loop().time(), 0.01)


# ------------------------------------------------------------------ the HTTP edge
AVERAGER = web.AppKey("averager", Averager)
_CONTROL_BYTES = 1 << 20  # /average/start and /average/result carry no tensors
_REFUSAL_PROBE_S = 1.0  # the longest a member waits to learn that a failed peer refuses connections


class _HttpTransport:
    """The :class:`Transport` of a running server."""

    def __init__(self, session: aiohttp.ClientSession):
        self.session = session

    async def post(self, url: str, body: bytes, *, timeout_s: float) -> dict:
        return await post_message(self.session, url, {}, timeout_s=timeout_s, body=body)

    async def refuses(self, url: str) -> bool:
        parts = urllib.parse.urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:  # a plain TCP connection, not the session's: its idle ones to a killed peer break the same way
            _, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, port), _REFUSAL_PROBE_S)
        except ConnectionRefusedError:
            return True
        except (OSError, asyncio.TimeoutError):
            return False
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return False


async def _start(request: web.Request) -> web.Response:
    msg, averager = await read_message(request, _CONTROL_BYTES), request.app[AVERAGER]
    try:
        spec = RoundSpec.from_message(msg, stage=request.app[SETTINGS].stage)
    except WrongStage:
        averager.refuse(msg["round_id"])  # so that peers find out at once that we are not in it
        raise
    try:
        averager.start(spec)
    except RoundConflict:
        if not averager.running:  # e.g. a step round for another step: peers find out at once
            averager.refuse(spec.round_id)
        raise
    return msgpack_response({"round_id": spec.round_id, "accepted": True})


async def _part(request: web.Request) -> web.Response:
    averager, settings = request.app[AVERAGER], request.app[SETTINGS]
    msg = await read_message(request, int(settings.max_body_mb * 2**20))
    header = PartMessage.from_message(msg)
    nbytes = request.content_length or 0
    if msg.get("empty") is True:  # a member with no sample: its weight (0), no values
        values = None
    elif nbytes >= 4 * _OFF_LOOP_VALUES:
        values = await asyncio.to_thread(decode_values, msg.get("data"), averager.num_params)
    else:
        values = decode_values(msg.get("data"), averager.num_params)
    averager.accept_part(header, values)
    return msgpack_response({"round_id": header.round_id, "part": header.part})


async def _result(request: web.Request) -> web.Response:
    round_id, part_index = _parse_part_request(await read_message(request, _CONTROL_BYTES))
    reduced = await request.app[AVERAGER].result(round_id, part_index)
    return web.Response(body=reduced.body, content_type=MSGPACK)


async def _status(request: web.Request) -> web.Response:
    """``?wait=ROUND_ID``: answered once that round ended here (at most ``wait_s``, default 10 s)."""
    averager, wait = request.app[AVERAGER], request.query.get("wait")
    if wait:
        try:
            wait_s = min(max(float(request.query.get("wait_s", "10")), 0.0), 60.0)
        except ValueError:
            raise BadPayload("'wait_s' must be a number of seconds") from None
        await averager.wait_round(wait, wait_s)
    return web.json_response(averager.status())


def add_allreduce_routes(app: web.Application) -> None:
    """Routes and lifecycle of the rounds; call after ``RUNTIME``, ``WORKER`` and ``SETTINGS`` are set."""
    settings = app[SETTINGS]
    log = get_logger(service="stage_server", run=settings.run_id, stage=settings.stage)
    byzantine = (settings.inject.byzantine, settings.inject.byzantine_factor) if settings.inject.byzantine else None
    averager = Averager(app[RUNTIME], app[WORKER].run, int8_block=settings.int8_block, log=log, byzantine=byzantine)
    app[AVERAGER] = averager
    app.router.add_post("/average/start", _start)
    app.router.add_post("/average/part", _part)
    app.router.add_post("/average/result", _result)
    app.router.add_get("/average/status", _status)

    async def client_session(app: web.Application):
        async with swarm_session(settings) as session:
            averager.transport = _HttpTransport(session)
            yield
            await averager.close()

    app.cleanup_ctx.append(client_session)


async def finish_rounds(app: web.Application) -> None:
    """Before this server leaves: a step round under way here ends first (its peers wait for
    this member's parts and fetch its reduction from it, so it must still listen: ``app.leave``),
    at most until the round's deadline; then the averager takes no round more, and its peers
    leave this member out of any other."""
    averager = app[AVERAGER]
    if averager.running and averager.round.spec.kind == "step":
        rnd = averager.round
        await averager.wait_round(rnd.spec.round_id, max(0.0, rnd.deadline - asyncio.get_running_loop().time()))
    await averager.close()
