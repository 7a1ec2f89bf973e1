"""Averaging: a butterfly all-reduce among the replicas of one stage.

A round reduces one flat vector per member: in a ``step`` round the member's accumulated
mean gradient, weighted by its samples (every member then applies the same optimizer
step, see ``stepping.py``), or in ``SWARM_SYNC=local`` mode, when an outer step is due,
its outer gradient weighted by the samples it served since the last one (the maths are
in ``local_sync.py``; between outer steps a step round exchanges nothing); in a
``params`` round its weights (repairs replicas that drifted apart, see the
coordinator's ``averaging.py``).

Plain logic, no aiohttp: ``averaging_routes.py`` is the HTTP edge and ``averager.py`` runs one
server's side of a round; they hand this module decoded values and a :class:`Transport`
that posts packed messages to peers (and fetches a peer's whole state, for a drift repair:
:class:`CopyOrder`).

A round as member ``i`` of ``k`` runs it (``T`` = the round's ``timeout_s``; times count
from the moment this member accepted ``/average/start``):

1. On the compute worker: snapshot the flat fp32 vector and its weight ``w_i``: a step
   round takes the accumulated gradient and its samples (0 for a replica that served
   none: it still steps with the others); a params round takes the parameters and the
   samples processed since this member's last completed round, or ``EPSILON_WEIGHT`` (``aggregation.py``) if
   none (an idle replica still counts, next to nothing beside a busy one).
2. Split the vector into ``k`` contiguous parts (sizes differ by at most 1); post part
   ``j`` to member ``j``; keep part ``i``.
3. As reducer of part ``i``: once all ``k`` parts are in, or at ``DEADLINES.reduce_at * T`` with what
   arrived, compute ``sum(w x) / sum(w)`` and serve it to whoever asks.
4. Fetch reduced part ``j`` from member ``j`` (by ``DEADLINES.fetch_by * T``). If member ``j`` cannot
   be reached or fails, re-send the ORIGINAL part ``j`` with its weight to a backup reducer
   (the first member after ``j`` in cyclic index order not seen failing) under round id
   ``"<round_id>/retry-<j>"`` and fetch its reduction (by ``DEADLINES.retry_fetch_by * T``). The
   backup reduces once every member whose part reached it in step 3 (but ``j``) re-sent
   part ``j``, or at ``DEADLINES.retry_reduce_at * T``. If that fails too, part ``j`` keeps the
   local values (``averaging.part.failed``).
5. On the compute worker: a params round loads the concatenated parts (bumps the
   weights' version and drops the backward cache); a step round applies the optimizer
   step with them only where ``stepping.step_verdict`` says so, else gives the gradient back
   and steps not (see "Step rounds" below).

Every member, the reducer included, loads a reduced part as it comes out of the round's
codec, so the members of a round end with identical values (a round of one member, a
stage of one replica, sends nothing and loses nothing: its codec is ``fp32``, whatever the
run's). Nothing waits past ``T``: at the deadline the round closes here and later messages
for it are refused.

A step round with ``error_feedback`` and a lossy codec compensates what the codec lost
(``error_feedback.py``): a member adds to its gradient what the codec lost of the parts it
sent last step (step 2), a reducer adds to its reduction what the codec lost of its part
last step (step 3). The residuals are each member's own: they change what it sends, never
what the members load, so the members still end with identical values.

Step rounds. Every member that steps must apply the same gradient, or the replicas drift
apart for good (the AdamW state remembers it). A member steps only on a gradient that
every other member that steps can hold too, and never on an empty one
(``stepping.StepVerdict``, which decides it, and ``stepping.settle_step``, which applies it):

- every part was reduced (else ``part_failed``);
- a part that came from a backup reducer holds every member of the round's contributors
  (the members whose parts the main reducers, this member's own included, took), else
  ``short_backup``. A backup of part ``j`` never holds ``j``'s own values, and ``j`` may
  have served its main reduction to the others: a member left with such a backup gives
  its gradient back; if the others stepped, the coordinator resyncs it as a replica
  behind its stage. (A backup for a member that sent nothing, dead from the start, holds
  the whole round and is a step.)
- the reduced weight is more than 0 samples (else ``empty``: nobody contributed, and an
  AdamW step with a zero gradient still moves the weights by momentum and decay).

Whatever ends a step round after this member took its gradient (a verdict, a failure, a
shutdown), the gradient is applied, given back, or, when the compute worker is gone,
counted as dropped; never lost. The round's compute jobs are the stage's own bookkeeping
and pass the compute queue's bound (``ComputeWorker.run(bounded=False)``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from services.stage_server.aggregation import AGGREGATORS, centered_clip, weighted_mean
from services.stage_server.stepping import StepVerdict
from shared.codec import FLOAT_CODECS, decode_tensor, encode_tensor, pack_message, unpack_message
from shared.errors import BadPayload, SwarmError, WrongStage

_MAX_MEMBERS = 256
_MAX_TIMEOUT_S = 3600.0
_MAX_WEIGHT = 1e15
OFF_LOOP_VALUES = 64 * 1024  # codec and reduction work on larger parts runs in a thread
RETRY_SEP = "/retry-"


@dataclass(frozen=True)
class Deadlines:
    """When each phase of a round ends, as fractions of its ``timeout_s`` (see above)."""

    reduce_at: float = 0.4
    fetch_by: float = 0.6
    retry_reduce_at: float = 0.8
    retry_fetch_by: float = 0.95


DEADLINES = Deadlines()
_ROUND_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class RoundConflict(SwarmError):
    """The message does not fit this server's round: busy, unknown, over, or not its part."""

    status = 409
    code = "round_conflict"


class SourceUnavailable(SwarmError):
    """A repair could not take its source replica's state (unreachable, refused, malformed)."""

    status = 502
    code = "source_unavailable"


class Transport(Protocol):
    async def post(self, url: str, body: bytes, *, timeout_s: float) -> dict:
        """POST a packed message, return the decoded reply; raise :class:`RemoteError` on any failure."""

    async def get_state(self, url: str, *, timeout_s: float) -> tuple[dict[str, torch.Tensor], dict]:
        """A peer replica's whole state (``GET /state``: tensors, metadata); :class:`RemoteError` on any failure."""

    async def refuses(self, url: str) -> bool:
        """Whether nothing listens at ``url``'s address now: a new connection is refused (the
        peer's process is gone). False when it connects, or cannot tell."""


# ------------------------------------------------------------------ pure pieces
def split_bounds(n: int, k: int) -> list[tuple[int, int]]:
    """``k`` contiguous ``[start, stop)`` ranges covering ``range(n)``; sizes differ by at most 1."""
    assert k >= 1 and n >= 0, f"cannot split {n} values into {k} parts"
    base, extra = divmod(n, k)
    bounds, start = [], 0
    for j in range(k):
        stop = start + base + (j < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def backup_reducer(part: int, k: int, dead: set[int]) -> int | None:
    """The member that reduces ``part`` when its reducer failed: the next one after it, cyclically, not in ``dead``."""
    return next((b for b in ((part + s) % k for s in range(1, k)) if b not in dead), None)


def values_sent(num_params: int, k: int, index: int) -> int:
    """Values member ``index`` sends in a round without failures: its k-1 other parts, then its
    reduced part to k-1 members; ``P + (k-2) * |part|``, about ``2 P (k-1) / k``."""
    start, stop = split_bounds(num_params, k)[index]
    return num_params + (k - 2) * (stop - start)


def retry_round_id(round_id: str, part: int) -> str:
    return f"{round_id}{RETRY_SEP}{part}"


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
        round_id, part = parse_part_request(msg)
        sender, weight = msg.get("from"), msg.get("weight")
        _require(type(sender) is int and 0 <= sender < _MAX_MEMBERS, f"'from' must be an int in [0, {_MAX_MEMBERS})")
        _require(
            _is_number(weight) and 0 <= weight <= _MAX_WEIGHT, f"'weight' must be a number in [0, {_MAX_WEIGHT:g}]"
        )
        return cls(round_id, sender, part, float(weight))


@dataclass(frozen=True)
class CopyOrder:
    """``/average/copy``: replace this replica's whole state with that of ``source`` (a live
    replica of its stage), the two being at global step ``step`` (a drift repair)."""

    stage: int
    source: str
    step: int
    timeout_s: float

    @classmethod
    def from_message(cls, msg: dict, stage: int) -> CopyOrder:
        source, step, timeout_s = msg.get("source"), msg.get("step"), msg.get("timeout_s")
        _require(type(msg.get("stage")) is int, "'stage' must be an int")
        _require(
            isinstance(source, str) and source.startswith(("http://", "https://")) and len(source) <= 2048,
            "'source' must be an http(s) URL",
        )
        _require(type(step) is int and 0 <= step < 2**53, "'step' must be an int >= 0")
        _require(
            _is_number(timeout_s) and 0 < timeout_s <= _MAX_TIMEOUT_S,
            f"'timeout_s' must be a number in (0, {_MAX_TIMEOUT_S}]",
        )
        if msg["stage"] != stage:
            raise WrongStage(f"this server holds stage {stage}, not {msg['stage']}")
        return cls(stage, source.rstrip("/"), step, float(timeout_s))


def parse_part_request(msg: dict) -> tuple[str, int]:
    """(round_id, part) of a ``/average/part`` or ``/average/result`` message."""
    round_id, part = msg.get("round_id"), msg.get("part")
    base, _, _ = round_id.partition(RETRY_SEP) if isinstance(round_id, str) else ("", "", "")
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


def parse_reduced(reply: dict, size: int) -> ReducedPart:
    values = decode_values(reply.get("data"), size)
    contributors, weight = reply.get("contributors"), reply.get("weight")
    _require(values.numel() == size, f"reduced part has {values.numel()} values, expected {size}")
    _require(
        isinstance(contributors, list) and all(type(c) is int for c in contributors),
        "'contributors' must be a list of ints",
    )
    _require(_is_number(weight), "'weight' must be a number")
    return ReducedPart(values, tuple(contributors), float(weight))


async def _off_loop(numel: int, fn: Callable, *args: Any) -> Any:
    return await asyncio.to_thread(fn, *args) if numel >= OFF_LOOP_VALUES else fn(*args)


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

    def add(self, member: int, weight: float, values: torch.Tensor) -> None:
        if self.closed or self._reduction is not None:
            raise RoundConflict(f"part {self.part} of round {self.round_id!r} is already reduced")
        if member in self.contributions:
            raise RoundConflict(f"member {member} already sent part {self.part} of round {self.round_id!r}")
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
                    _off_loop(self.size * len(contributions), self._reduce, contributions)
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
        self.bounds = split_bounds(num_params, spec.k)
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
        self.verdict: StepVerdict | None = None  # a step round's, once its parts are in
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

    def accept(self, msg: PartMessage, values: torch.Tensor) -> None:
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
            "ok": all(p is not None for p in parts) if self.verdict is None else self.verdict is StepVerdict.APPLY,
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
