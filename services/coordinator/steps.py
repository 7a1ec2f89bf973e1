"""Global steps, coordinator side: which step each microbatch's gradient belongs to, and
when a stage's replicas all-reduce and step.

Every global step of a stage holds the run's global batch (``SWARM_GLOBAL_BATCH``
samples), whatever the replicas and trainers. Before a replica runs a backward it asks
which step the microbatch's gradient goes to (``POST /step/reserve``; the messages and the
verdict are in ``shared/step_protocol.py``): the stage's step until its reservations reach
the global batch (the reservation that gets there ``closes`` it), then the next one. Only
one step ahead of the stage's is handed out: a reservation past that waits until the stage
steps, bounded by ``step_timeout_s``. After the backward the replica says what it
accumulated (``POST /step/done``; 0 samples for a failed backward, which gives the
reservation back). Once every sample reserved for the stage's step is accumulated, the
coordinator starts a ``step`` round among the stage's live replicas (the butterfly
all-reduce of the stage server's ``allreduce.py``; the coordinator moves no tensor), waits
until the members report it ended, and moves the stage to the step they reached. Given the
admission's lookahead (the coordinator's app gives it), the stage moves as soon as the first
member reports it stepped: every member applies the same reduced gradient (or resyncs), so a
weak replica that applies last no longer holds up the swarm's next step; it holds the
microbatches that need the round's weights until it applied (``Averager.hold_for``), its
reservations meanwhile go into the stage's new step, and the stage's next round starts only
once every member of this one ended (``finishing``).
Reservations still out ``step_timeout_s`` after the step closed (a replica died with them)
are given up: the round starts with what was accumulated, and the step holds fewer samples.
A round that nobody stepped in gave its gradients back: the step then counts, for each
member, what it says it put in (never more) and nothing for a replica gone past its lease,
and opens again if that is below the global batch; so a step never waits on samples that no
live process holds (a replica that dropped its buckets on a resync, or one killed and
started again at its URL).

A microbatch the coordinator admitted for a step (``admitted_step``, see ``admission.py``)
goes into that step, or into the next open one if the stage took it meanwhile or it is full;
never into an earlier one: a reservation for a step the stage has not opened yet is held
until it opens. So a gradient goes into a step at most the admission's lookahead
(``SWARM_MAX_STALENESS``, 0 with ``SWARM_SCHEDULE=sync``) after the step of the weights its
forward ran on, on every stage.

A reservation is for one microbatch, and lives until its replica reports it or it is given
up. Only a live reservation's report changes what the step has reserved. A report of a
reservation given up (its replica was slow, not dead), or made with a predecessor of this
coordinator's that could not save it (see below), comes after the fact: its samples count in
their step like a reservation would (while the step is below its global batch), else in
``samples_dropped``. So a step counts at most the global batch plus one microbatch (the
reservation that closes it may overshoot).

Each microbatch counts at most once per stage, whichever replica runs its backward: a trainer
retries a backward that timed out on another replica, or a chain sends a hop on to an
alternate, while the first one still computes. The coordinator holds the id of every
microbatch reserved at a stage, while its reservation is out and then for ``WINDOW_STEPS``
steps after the one it went into, and answers another reservation of it ``duplicate``
(counted in ``duplicates_refused``): that backward returns its input gradient and
accumulates nothing. A reservation given back (0 samples), or given up when its replica is
gone, releases its id, so that the microbatch run again counts; one given up while its
replica is still alive (slow) keeps it: that replica may have accumulated it already. The
window is kept in the run's state file (the registry's SQLite), so a restarted coordinator
still refuses the duplicates of its predecessor's reservations. So are each stage's step and
the counts of its open steps (reserved, accumulated, the live reservations): a restarted
coordinator goes on filling a step where its predecessor stopped, not from 0 (which let a
step hold its global batch twice), and the reports of its predecessor's reservations find
them live.

A replica at an older step than its stage's is told to take a live replica's state
(``resync``); a newer one (this coordinator restarted) moves the stage's count forward.
When no live replica of the stage holds its step any more (every one that did was killed,
and a server rejoined from an older checkpoint, or the survivor of a round its peer
completed alone), nobody can give that state: the replica is told to catch up
(``catch_up``): it takes the stage's step number with its own weights, the updates of the
steps in between are lost (``step.caught_up``, counted in ``steps_lost``), and every
stage's step count stays the run's, rather than waiting forever for a state that is gone.
A replica that could not reach the coordinator accumulates into its current step and
reports it afterwards (``reserved: 0``, no microbatch named): such samples count on top of
the reserved ones, at most one global batch of them per step (the replicas' shares of a
step they fill alone add up to it); the rest count in ``samples_dropped``. A step thus
counts at most two global batches and one microbatch.

:class:`StepCounter` is the plain logic; :class:`StepScheduler` runs it with HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Protocol

import aiohttp
from aiohttp import web

from services.coordinator.averaging import round_shares
from shared.codec import FLOAT_CODECS
from shared.errors import Draining, Overloaded, RemoteError, SwarmError
from shared.http import check_run, get_json, post_message, read_json
from shared.log import get_logger
from shared.step_protocol import DoneReport, ReserveAnswer, ReserveRequest, Verdict

STARTING = "<starting>"  # round_id while a round's start messages are on their way
CHECK_EVERY_S = 0.5  # how often stalled steps are looked for
RETRY_FAILED_ROUND_S = 1.0  # a step round that nobody completed is tried again after this
WINDOW_STEPS = 16  # a microbatch accumulated into a step is refused again for this many steps after it


class GlobalBatchMismatch(SwarmError):
    """Replicas of one stage disagree on SWARM_GLOBAL_BATCH."""

    status = 409
    code = "global_batch_mismatch"


@dataclass(frozen=True)
class Claim:
    """A live reservation: its replica and samples."""

    url: str
    samples: int


@dataclass(frozen=True)
class Finishing:
    """A step round that moved its stage when its first member stepped, while the others
    still apply (a weak replica takes a while): its members, the step it took, and the
    samples accumulated for that step then (its effective batch and drops are counted when
    the last member ended)."""

    round_id: str
    step: int
    members: frozenset[str]
    done: int


@dataclass
class StageCount:
    """A stage's step and the samples reserved and accumulated for its next steps.

    Invariants, for every step k: ``reserved[k] == done[k] + sum of claims[k]``; the samples
    counted through reservations (``done[k] - unreserved[k]`` once reported) stay below the
    global batch plus one microbatch, and ``unreserved[k] <= global_batch``; a microbatch id
    is counted in at most one step (``held``)."""

    step: int = 0  # global steps the stage has taken (as its replicas reported them)
    global_batch: int = 0  # from the first report (0: none yet)
    reserved: dict[int, int] = field(default_factory=dict)  # step -> samples reserved (accumulated ones included)
    done: dict[int, int] = field(default_factory=dict)  # step -> samples accumulated
    done_by: dict[int, dict[str, int]] = field(default_factory=dict)  # step -> replica URL -> of those, its own
    unreserved: dict[int, int] = field(default_factory=dict)  # step -> of those, reported without a reservation
    closed_at: dict[int, float] = field(default_factory=dict)  # step -> when its reservations reached the global batch
    round_id: str | None = None  # the step round running, if any
    finishing: Finishing | None = None  # the last round, which moved the stage, while its other members apply
    replica_steps: dict[str, int] = field(default_factory=dict)  # replica URL -> the step it last reported
    last_seen: dict[str, float] = field(
        default_factory=dict
    )  # replica URL -> when it last reported (alive, registered or not)
    claims: dict[int, dict[str, Claim]] = field(
        default_factory=dict
    )  # step -> microbatch id -> live reservation, not reported yet
    held: dict[str, tuple[int, str]] = field(
        default_factory=dict
    )  # microbatch id -> (step, replica URL) it is reserved or accumulated in: the duplicate window
    not_before: float = 0.0  # a failed round is not retried before this time
    samples_dropped: int = 0  # accumulated samples not counted in their step (late, past its room, not in its round)
    duplicates_refused: int = 0  # reservations refused: the stage held their microbatch already
    steps_lost: list[tuple[int, int]] = field(
        default_factory=list
    )  # (from, to) of each catch-up: the updates of those steps were lost with the replicas that held them
    last_effective_batch: int = 0

    def closed(self, step: int) -> bool:
        return step in self.closed_at

    def outstanding(self, step: int) -> dict[str, int]:
        """Replica URL -> samples it reserved for ``step`` and has not reported yet."""
        by_url: dict[str, int] = {}
        for claim in self.claims.get(step, {}).values():
            by_url[claim.url] = by_url.get(claim.url, 0) + claim.samples
        return by_url


class StepCounter:
    """Per-stage reservations and the decision to step; ``clock`` is monotonic seconds.

    Changes to the duplicate window are appended to ``journal`` (``("hold", stage, id,
    step, url)``, ``("release", stage, id)``, ``("prune", stage, below_step)``, in order) for
    the caller to persist, and :meth:`take_journal` adds ``("counts", stage, snapshot)`` for
    each stage whose counts changed since (:meth:`snapshot`); :meth:`restore_held` and
    :meth:`restore_counts` put them back."""

    def __init__(
        self, num_stages: int, *, timeout_s: float, lease_s: float = 0.0, clock: Callable[[], float] = time.monotonic
    ):
        """``lease_s``: a replica that reported this recently counts as alive, registered or not
        (a restarted coordinator's registry fills again as the servers heartbeat)."""
        self.stages = [StageCount() for _ in range(num_stages)]
        self.timeout_s, self.lease_s, self.clock = timeout_s, lease_s, clock
        self.journal: list[tuple] = []
        self._saved: list[dict] = [self.snapshot(i) for i in range(num_stages)]  # as last journaled

    def _check(self, stage: int, url: str, replica_step: int, global_batch: int) -> StageCount:
        st = self.stages[stage]
        # a report sent before a step may arrive after it
        st.replica_steps[url] = max(replica_step, st.replica_steps.get(url, 0))
        st.last_seen[url] = self.clock()
        if st.global_batch and global_batch != st.global_batch:
            raise GlobalBatchMismatch(
                f"stage {stage} steps every {st.global_batch} samples, this replica every {global_batch}: "
                "set the same SWARM_GLOBAL_BATCH on every server of the run"
            )
        st.global_batch = global_batch
        if (
            replica_step > st.step and st.round_id is None
        ):  # its replicas are further than we know (e.g. after a restart)
            self._advance(stage, replica_step, {url})
        return st

    def reserve(
        self, req: ReserveRequest, live: Iterable[str] | None = None, reported: Mapping[str, int] | None = None
    ) -> ReserveAnswer:
        """The verdict on a microbatch's backward: the step its gradient goes to (``reserved``,
        ``closes``), or: the replica must ``resync``; the stage holds the microbatch already
        (``duplicate``); the trainer's run ends before that step (``complete``: its
        ``until_step`` steps are all reserved and accumulated); or ``wait``: the stage is a
        whole step ahead already, or the run's last step still has reservations out (one
        given back opens that step again, and a backward told ``complete`` meanwhile would
        leave it short for good). ``live`` (the stage's registered replicas) and ``reported``
        (URL -> the step of their registration or heartbeat): a replica behind its stage when
        none of them, nor any that reported within the lease, holds the stage's step is told
        to ``catch_up`` instead."""
        st = self._check(req.stage, req.url, req.step, req.global_batch)
        if req.step < st.step and not self._applying(st, req.url, req.step):
            if live is None or st.round_id is not None or self._holds_the_step(st, req.url, live, reported or {}):
                return ReserveAnswer(Verdict.RESYNC, None, st.step)
            st.steps_lost.append((req.step, st.step))
            st.replica_steps[req.url] = st.step
            return ReserveAnswer(Verdict.CATCH_UP, None, st.step)
        if req.microbatch_id in st.held:
            st.duplicates_refused += 1
            return ReserveAnswer(Verdict.DUPLICATE, None, st.step)
        open_steps = ([] if st.round_id is not None else [st.step]) + [
            st.step + 1
        ]  # the round running took its step's buckets
        floor = req.admitted_step if req.admitted_step is not None else st.step  # never before its admitted step
        k = next((k for k in open_steps if k >= floor and st.reserved.get(k, 0) < st.global_batch), None)
        if k is None:
            return ReserveAnswer(Verdict.WAIT, None, st.step)  # a whole step ahead already, or not at its step yet
        if req.until_step is not None and k >= req.until_step:
            if any(st.reserved.get(j, 0) > st.done.get(j, 0) for j in open_steps if j < req.until_step):
                return ReserveAnswer(Verdict.WAIT, None, st.step)  # the run's last steps have reservations out
            return ReserveAnswer(Verdict.COMPLETE, None, st.step)
        st.reserved[k] = st.reserved.get(k, 0) + req.samples
        st.claims.setdefault(k, {})[req.microbatch_id] = Claim(req.url, req.samples)
        self._hold(req.stage, req.microbatch_id, k, req.url)
        closes = st.reserved[k] >= st.global_batch
        if closes:
            st.closed_at[k] = self.clock()
        return ReserveAnswer(Verdict.CLOSES if closes else Verdict.RESERVED, k, st.step)

    def done(self, report: DoneReport) -> None:
        """A replica accumulated ``samples`` of the ``reserved`` it asked for ``bucket``: see
        the module's docstring for reports of live reservations, of reservations given up,
        and of none."""
        st = self._check(report.stage, report.url, report.step, report.global_batch)
        k = report.bucket
        if k < st.step:  # its step was taken without it
            st.samples_dropped += report.samples
            return
        if report.reserved == 0:  # accumulated without a reservation (the coordinator was away)
            counted = min(report.samples, max(0, st.global_batch - st.unreserved.get(k, 0)))
            st.unreserved[k] = st.unreserved.get(k, 0) + counted
            st.samples_dropped += report.samples - counted
            self._count(st, k, counted, report.url)
            return
        claim = st.claims.get(k, {}).get(report.microbatch_id)
        if claim is None or claim.url != report.url:
            self._after_the_fact(report)
            return
        del st.claims[k][report.microbatch_id]
        samples = min(report.samples, claim.samples)
        st.reserved[k] -= claim.samples - samples  # given back
        self._accumulated(st, k, samples, report.url)
        if samples == 0:
            self._release(report.stage, report.microbatch_id)
        if st.reserved[k] < st.global_batch:  # open again: the next reservation completes it
            st.closed_at.pop(k, None)

    def _after_the_fact(self, report: DoneReport) -> None:
        """A report whose reservation is not live (given up, or this coordinator's
        predecessor's): it gives nothing back; its samples count while the step has room,
        unless another reservation holds the microbatch (then it was accumulated twice)."""
        st, k, mb = self.stages[report.stage], report.bucket, report.microbatch_id
        holder = st.held.get(mb)
        ours = holder is None or holder == (k, report.url)
        if report.samples == 0:
            if holder is not None and ours:
                self._release(report.stage, mb)
            return
        if ours:  # accumulated here: a run of it again must not count
            self._hold(report.stage, mb, k, report.url)
        room = st.reserved.get(k, 0) < st.global_batch and not (k == st.step and st.round_id is not None)
        if ours and room:
            self._count(st, k, report.samples, report.url)
        else:
            st.samples_dropped += report.samples

    def _count(self, st: StageCount, k: int, samples: int, url: str) -> None:
        """``samples`` accumulated in step ``k`` by ``url`` without a live reservation."""
        st.reserved[k] = st.reserved.get(k, 0) + samples
        self._accumulated(st, k, samples, url)
        if st.reserved[k] >= st.global_batch and not st.closed(k):
            st.closed_at[k] = self.clock()

    @staticmethod
    def _accumulated(st: StageCount, k: int, samples: int, url: str) -> None:
        st.done[k] = st.done.get(k, 0) + samples
        if samples:
            by = st.done_by.setdefault(k, {})
            by[url] = by.get(url, 0) + samples

    def ready(self, stage: int, live: Iterable[str] | None = None) -> bool:
        """Start the stage's step round now? Its step is closed and everything reserved for
        it accumulated, but what replicas no longer ``live`` (gone from the registry) held,
        or its reservations have been out ``timeout_s``. A step nothing was accumulated for is
        not taken: its reservations are given up, and it fills again."""
        st = self.stages[stage]
        k = st.step
        if st.round_id is not None or st.finishing is not None or not st.closed(k) or self.clock() < st.not_before:
            return False
        now = self.clock()
        alive = (
            None if live is None else set(live) | {url for url, at in st.last_seen.items() if now - at < self.lease_s}
        )
        lost = sum(n for url, n in st.outstanding(k).items() if alive is not None and url not in alive)
        complete = st.done.get(k, 0) >= st.reserved.get(k, 0) - lost or now - st.closed_at[k] >= self.timeout_s
        if complete and st.done.get(k, 0) == 0:  # everything reserved for it was lost: no empty step, fill it again
            self._give_up(stage, st.claims.pop(k, {}), alive)
            st.reserved[k] = 0
            st.closed_at.pop(k, None)
            return False
        return complete

    def members(self, stage: int, live: list[str], reported: Mapping[str, int] | None = None) -> list[str]:
        """Who takes part in the stage's step round: its live replicas that have said they are
        at its step, in a reservation or report, or in their registration or heartbeat
        (``reported``: URL -> step). Not those behind (they would refuse, and their peers
        would wait for their parts until the round's deadline; they resync on their next
        reservation), nor those that said nothing yet."""
        st, reported = self.stages[stage], reported or {}
        return [url for url in live if max(st.replica_steps.get(url, -1), reported.get(url, -1)) >= st.step]

    def registered(self, stage: int, url: str, step: int | None) -> None:
        """A server (re)registered at ``url``: a new process, maybe restarted from an older
        checkpoint, so the step the URL reported before is no longer its step."""
        for st in self.stages:
            st.replica_steps.pop(url, None)
        if step is not None and 0 <= stage < len(self.stages):
            self.stages[stage].replica_steps[url] = step

    def round_started(self, stage: int, round_id: str) -> None:
        self.stages[stage].round_id = round_id

    def member_stepped(self, stage: int, round_id: str, url: str, reached: int, members: Iterable[str]) -> bool:
        """A member of the stage's running round ``round_id`` ended it at step ``reached``
        while the others may still apply: if that is a step, the stage moves to it now (the
        round becomes ``finishing``) and reservations and admissions of the next step go on
        without waiting for the slowest member. The others reach the step too (every member
        applies the same reduced gradient) or resync, as after any round; the next round of
        the stage waits until they all ended (:meth:`round_ended`). True if the stage moved."""
        st = self.stages[stage]
        st.replica_steps[url] = max(reached, st.replica_steps.get(url, 0))
        if st.round_id != round_id or reached <= st.step:
            return False
        st.finishing = Finishing(round_id, st.step, frozenset(members), st.done.get(st.step, 0))
        st.round_id = None
        self._advance(stage, reached, st.finishing.members | {url})
        return True

    @staticmethod
    def _applying(st: StageCount, url: str, step: int) -> bool:
        """Is ``url`` (at ``step``) a member of the round that moved the stage, still applying it?"""
        return st.finishing is not None and url in st.finishing.members and step == st.finishing.step

    def round_ended(
        self,
        stage: int,
        member_steps: dict[str, int],
        member_samples: dict[str, int],
        live: Iterable[str] | None = None,
    ) -> tuple[int, int]:
        """The round's members reached ``member_steps`` (URL -> step, members that answered);
        the stage moves to the furthest. ``member_samples``: URL -> the samples each member
        that took part put in, as it says. Returns (effective batch, samples dropped).

        A round that nobody stepped in gave its gradients back, so what each member that
        took part says it put in is what it holds for the step: the step counts that for it
        (never more), and nothing for a replica neither ``live`` nor seen within the lease
        (its buckets died with it). If the step is then below its global batch it opens
        again, so that new reservations fill it; else it is tried again a little later. So a
        step never waits on samples that no live process holds (a replica that dropped its
        buckets on a resync, a process killed, or killed and started again at its URL)."""
        st = self.stages[stage]
        st.round_id = None
        finishing, st.finishing = st.finishing, None
        for url, step in member_steps.items():
            st.replica_steps[url] = max(step, st.replica_steps.get(url, 0))
        if finishing is not None:  # the stage moved when its first member stepped (member_stepped)
            effective = sum(member_samples.get(url, 0) for url, s in member_steps.items() if s > finishing.step)
            dropped = max(0, finishing.done - effective)
            st.samples_dropped += dropped
            st.last_effective_batch = effective
            return effective, dropped
        before = st.step
        reached = max(member_steps.values(), default=before)
        if reached <= before:  # nobody stepped
            dropped = self._recount(stage, before, member_samples, live)
            if st.closed(before):
                st.not_before = self.clock() + RETRY_FAILED_ROUND_S
            return 0, dropped
        stepped = [url for url, s in member_steps.items() if s >= reached]
        effective = sum(member_samples.get(url, 0) for url in stepped)
        dropped = max(
            0, st.done.get(before, 0) - effective
        )  # accumulated, yet not in the step: members that failed or vanished
        st.samples_dropped += dropped
        st.last_effective_batch = effective
        self._advance(stage, reached, {*member_steps, *member_samples, *(live or ())})
        return effective, dropped

    def _recount(self, stage: int, k: int, holding: dict[str, int], live: Iterable[str] | None) -> int:
        """Step ``k``'s counts after a round nobody stepped in (see :meth:`round_ended`):
        each replica's count is at most what it holds; the samples no longer held are
        dropped, and the ids of a replica that holds none of the step any more are released
        (its buckets are gone: runs of them again count). Returns the samples dropped."""
        st, now = self.stages[stage], self.clock()
        alive = set(live or ()) | {url for url, at in st.last_seen.items() if now - at < self.lease_s}
        by = st.done_by.get(k, {})
        dropped = 0
        for url, counted in list(by.items()):
            held = min(counted, holding[url]) if url in holding else (counted if url in alive else 0)
            if held == counted:
                continue
            dropped += counted - held
            by[url] = held
            if held == 0:
                del by[url]
                for mb, at in list(st.held.items()):
                    if at == (k, url):
                        self._release(stage, mb)
        if not by:
            st.done_by.pop(k, None)
        if dropped:
            st.samples_dropped += dropped
            st.done[k] -= dropped
            st.reserved[k] -= dropped
            st.unreserved[k] = min(st.unreserved.get(k, 0), st.done[k])
            if not st.unreserved[k]:
                st.unreserved.pop(k)
            if st.reserved[k] < st.global_batch:
                st.closed_at.pop(k, None)
        return dropped

    def restore_held(self, stage: int, microbatch_id: str, step: int, url: str) -> None:
        """Put back an id of a persisted duplicate window (a restarted coordinator's)."""
        if 0 <= stage < len(self.stages):
            self.stages[stage].held[microbatch_id] = (step, url)

    def take_journal(self) -> list[tuple]:
        """The window's changes since the last call, in order, then the counts of every stage
        whose counts changed (see the class docstring)."""
        for i in range(len(self.stages)):
            counts = self.snapshot(i)
            if counts != self._saved[i]:
                self.journal.append(("counts", i, counts))
                self._saved[i] = counts
        journal, self.journal = self.journal, []
        return journal

    def snapshot(self, stage: int) -> dict:
        """What a restarted coordinator needs to go on counting ``stage`` (JSON): its step, its
        global batch and, for each open step, the samples reserved, accumulated and reported
        without a reservation, and the live reservations (microbatch id -> [url, samples])."""
        st = self.stages[stage]
        steps = sorted(k for k in {*st.reserved, *st.done, *st.done_by, *st.unreserved, *st.claims} if k >= st.step)
        return {
            "step": st.step,
            "global_batch": st.global_batch,
            "open": {
                str(k): {
                    "reserved": st.reserved.get(k, 0),
                    "done": st.done.get(k, 0),
                    "unreserved": st.unreserved.get(k, 0),
                    "claims": {mb: [c.url, c.samples] for mb, c in st.claims.get(k, {}).items()},
                    "done_by": dict(st.done_by.get(k, {})),
                }
                for k in steps
            },
        }

    def restore_counts(self, stage: int, counts: dict) -> None:
        """Put back a :meth:`snapshot` of a predecessor's (a closed step's timeout starts now)."""
        if not 0 <= stage < len(self.stages):
            return
        st = self.stages[stage]
        st.step, st.global_batch = int(counts["step"]), int(counts["global_batch"])
        for key, c in counts["open"].items():
            k = int(key)
            if k < st.step:
                continue
            st.reserved[k], st.done[k] = int(c["reserved"]), int(c["done"])
            if c["unreserved"]:
                st.unreserved[k] = int(c["unreserved"])
            if c["claims"]:
                st.claims[k] = {mb: Claim(str(url), int(n)) for mb, (url, n) in c["claims"].items()}
            if c.get("done_by"):
                st.done_by[k] = {str(url): int(n) for url, n in c["done_by"].items()}
            if st.global_batch and st.reserved[k] >= st.global_batch:
                st.closed_at[k] = self.clock()
        self._saved[stage] = self.snapshot(stage)

    def _hold(self, stage: int, microbatch_id: str, step: int, url: str) -> None:
        if self.stages[stage].held.get(microbatch_id) != (step, url):
            self.stages[stage].held[microbatch_id] = (step, url)
            self.journal.append(("hold", stage, microbatch_id, step, url))

    def _give_up(self, stage: int, claims: Mapping[str, Claim], alive: set[str] | None) -> None:
        """Reservations given up: the ids of replicas gone are released (their buckets went
        with them: the microbatches run again count); those of replicas still alive stay held,
        as a slow replica may have accumulated its microbatch already (its step round would
        apply it, and a run of it again elsewhere would too: applied twice)."""
        for mb, claim in claims.items():
            if alive is None or claim.url not in alive:
                self._release(stage, mb)

    def _release(self, stage: int, microbatch_id: str) -> None:
        if self.stages[stage].held.pop(microbatch_id, None) is not None:
            self.journal.append(("release", stage, microbatch_id))

    def _holds_the_step(self, st: StageCount, url: str, live: Iterable[str], reported: Mapping[str, int]) -> bool:
        """Is a replica alive and at the stage's step (it can give its state)? ``url`` itself
        counts when it said so before: its report was sent before a step and came after it."""
        now = self.clock()
        alive = set(live) | {u for u, at in st.last_seen.items() if now - at < self.lease_s} | {url}
        return any(max(st.replica_steps.get(u, -1), reported.get(u, -1)) >= st.step for u in alive)

    def _advance(self, stage: int, step: int, alive: Iterable[str]) -> None:
        """The stage is at ``step``: reservations of earlier steps missed theirs (given up, see
        :meth:`_give_up`) and the window slides. ``alive``: the replicas known to be alive
        besides those seen within the lease: the round's members (their buckets were in the
        round, so their microbatches may be in the step) and the registry's live ones."""
        st = self.stages[stage]
        now = self.clock()
        alive = set(alive) | {url for url, at in st.last_seen.items() if now - at < self.lease_s}
        for k in [k for k in st.claims if k < step]:
            self._give_up(stage, st.claims.pop(k), alive)
        for table in (st.reserved, st.done, st.done_by, st.unreserved, st.closed_at):
            for k in [k for k in table if k < step]:
                table.pop(k)
        below = step - WINDOW_STEPS
        aged = [mb for mb, (k, _) in st.held.items() if k < below]
        for mb in aged:
            del st.held[mb]
        if aged:
            self.journal.append(("prune", stage, below))
        st.step = step

    def view(self) -> list[dict]:
        """Per stage: step, samples reserved and accumulated for it, dropped samples, refused duplicates."""
        return [
            {
                "stage": i,
                "step": st.step,
                "reserved": st.reserved.get(st.step, 0),
                "accumulated": st.done.get(st.step, 0),
                "global_batch": st.global_batch,
                "round": st.round_id,
                "samples_dropped": st.samples_dropped,
                "duplicates_refused": st.duplicates_refused,
                "last_effective_batch": st.last_effective_batch,
                "steps_lost": st.steps_lost[-4:],
                "steps_lost_total": sum(to - since for since, to in st.steps_lost),
            }
            for i, st in enumerate(self.stages)
        ]


class WindowStore(Protocol):
    """Where the duplicate window and the step counts persist (the registry's SQLite file)."""

    def save_step_window(self, journal: list[tuple]) -> bool: ...

    def step_window(self) -> list[tuple[int, str, int, str]]: ...

    def step_counts(self) -> list[tuple[int, dict]]: ...


# ------------------------------------------------------------------ the round's HTTP
START_TIMEOUT_S = 5.0  # cap on each /average/start call (a member answers it at once)


async def start_round(
    session: aiohttp.ClientSession,
    stage: int,
    member_urls: list[str],
    *,
    codec: str,
    timeout_s: float,
    log=None,
    with_accepted: bool = False,
    aggregator: str = "mean",
    kind: str = "params",
    step: int = 0,
    error_feedback: bool = False,
    lookahead: int | None = None,
    shares: list[float] | None = None,
):
    """Start one averaging round of ``stage`` among ``member_urls`` (index = position); return its
    id (``with_accepted``: the id and how many members accepted). ``error_feedback``: a step
    round's members compensate what the codec lost last step (stage server's ``error_feedback.py``).
    ``lookahead`` (a step round): the admission's; a member still applying the round holds a
    microbatch admitted for a step more than ``lookahead`` past the round's until it applied.
    ``shares``: each member's part of the vector to reduce, in member order (None: equal parts;
    see ``averaging.round_shares``).

    Posts ``/average/start`` to every member at once; members that refuse (e.g. 409: busy
    with a round, or another stage now) or cannot be reached are logged
    (``averaging.start.refused``) and left out of the round.
    """
    if not member_urls:
        raise ValueError("an averaging round needs at least one member")
    if codec not in FLOAT_CODECS:
        raise ValueError(f"averaging codec must be one of {FLOAT_CODECS}, got {codec!r}")
    if not timeout_s > 0:
        raise ValueError(f"averaging timeout_s must be > 0, got {timeout_s}")
    log = log or get_logger(service="coordinator")
    members = [url.rstrip("/") for url in member_urls]
    round_id = f"{'step' if kind == 'step' else 'avg'}-s{stage}-{uuid.uuid4().hex[:12]}"

    async def tell(index: int, url: str) -> bool:
        msg = {
            "round_id": round_id,
            "stage": stage,
            "members": members,
            "index": index,
            "codec": codec,
            "timeout_s": timeout_s,
            "aggregator": aggregator,
            "kind": kind,
            "step": step,
            **({"error_feedback": True} if error_feedback else {}),
            **({"lookahead": lookahead} if lookahead is not None else {}),
            **({"shares": shares} if shares is not None else {}),
        }
        try:
            await post_message(session, url + "/average/start", msg, timeout_s=min(START_TIMEOUT_S, timeout_s))
            return True
        except RemoteError as exc:
            log.warning(
                "averaging.start.refused",
                round_id=round_id,
                stage=stage,
                member=url,
                index=index,
                status=exc.status,
                code=exc.code,
                reason=exc.message,
            )
            return False

    accepted = await asyncio.gather(*(tell(i, url) for i, url in enumerate(members)))
    if kind != "step":  # a step round is logged by its scheduler, with its step (step.round.started)
        log.info(
            "averaging.round.started",
            round_id=round_id,
            kind=kind,
            stage=stage,
            members=len(members),
            accepted=sum(accepted),
            codec=codec,
            aggregator=aggregator,
            timeout_s=timeout_s,
        )
    return (round_id, sum(accepted)) if with_accepted else round_id


STATUS_POLL_S = 0.05  # how often a pass asks members whether their round ended (first wait; doubles to 0.5)


@dataclass
class StageRound:
    """One stage's round in a pass, as the coordinator saw it."""

    stage: int
    round_id: str
    members: list[str]
    accepted: int
    ended: int = 0  # members seen done with the round (or gone) before the pass gave up

    def as_json(self) -> dict:
        return asdict(self)


async def wait_round_ended(
    session: aiohttp.ClientSession,
    rnd: StageRound,
    timeout_s: float,
    on_ended: Callable[[str, dict], Awaitable[None]] | None = None,
) -> dict[str, dict]:
    """Until every member's round ``rnd`` ended (its status no longer runs it) or it cannot
    be asked, bounded by the round's timeout plus a grace period; sets ``rnd.ended`` and
    returns the last status of each member that answered (URL -> ``/average/status``).
    ``on_ended(url, status)`` is awaited as each member is seen done with it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s + START_TIMEOUT_S
    pending, delay, statuses = set(rnd.members), STATUS_POLL_S, {}

    async def ask(url: str) -> None:  # a member answers once the round ended there (or its wait ran out)
        left = max(0.1, deadline - loop.time())
        try:
            status = await get_json(
                session,
                f"{url}/average/status?wait={rnd.round_id}&wait_s={min(left, 10.0):.3f}",
                timeout_s=min(left, 10.0) + START_TIMEOUT_S,
            )
        except RemoteError:
            pending.discard(url)  # gone: its peers leave it out
            return
        statuses[url] = status
        if status.get("running") != rnd.round_id:
            pending.discard(url)
            if on_ended is not None:
                await on_ended(url, status)

    while pending and loop.time() < deadline:
        await asyncio.gather(*(ask(url) for url in list(pending)))
        if pending:  # an older member that does not wait: poll
            await asyncio.sleep(min(delay, max(0.0, deadline - loop.time())))
            delay = min(0.5, delay * 2)
    rnd.ended = len(rnd.members) - len(pending)
    return statuses


class StepScheduler:
    """Runs :class:`StepCounter` with real rounds among the live replicas of each stage."""

    def __init__(
        self,
        num_stages: int,
        live_servers: Callable[[], Iterable],
        *,
        codec: str,
        timeout_s: float,
        aggregator: str,
        log,
        lease_s: float = 0.0,
        reported_step: Callable[[object], int | None] = lambda server: None,
        store: WindowStore | None = None,
        error_feedback: bool = False,
        lookahead: int | None = None,
    ):
        """``reported_step(server)``: the step a live server said in its registration or last
        heartbeat. ``store``: where the duplicate window and the step counts persist; what it
        holds is put back now (None: kept in memory only). ``lookahead``: the admission's (0
        with the ``sync`` schedule); given, a stage moves when the first member of its round
        stepped (:meth:`StepCounter.member_stepped`), its members told to hold the microbatches
        that need the round's weights until they applied it; None: when every member ended."""
        self.live_servers, self.codec, self.timeout_s, self.aggregator, self.log = (
            live_servers,
            codec,
            timeout_s,
            aggregator,
            log,
        )
        self.reported_step = reported_step
        self.error_feedback = error_feedback  # the rounds' members compensate what the codec lost
        self.lookahead = lookahead
        self.counter = StepCounter(num_stages, timeout_s=timeout_s, lease_s=lease_s)
        self.store = store
        for row in store.step_window() if store is not None else ():
            self.counter.restore_held(*row)
        for stage, counts in store.step_counts() if store is not None else ():
            try:
                self.counter.restore_counts(stage, counts)
            except (KeyError, TypeError, ValueError) as exc:  # a file of another version: count from 0
                self.log.warning("step.counts.unreadable", stage=stage, error=repr(exc))
        self.session: aiohttp.ClientSession | None = None
        self._changed = (
            asyncio.Condition()
        )  # a round started or ended: held reservations and closing reports look again
        self._tasks: set[asyncio.Task] = set()
        self.closing = False  # the coordinator is stopping: nothing waits for a step any more

    async def close(self) -> None:
        """The coordinator is stopping: the reservations held for a step answer 503 now and
        the closing reports return, instead of holding the shutdown for up to ``timeout_s``."""
        self.closing = True
        await self._notify()

    def _live(self, stage: int) -> list[str]:
        return sorted(s.url for s in self.live_servers() if s.stage == stage)

    def _persist(self) -> None:
        """Write the duplicate window's and the counts' changes to the store (a failed write is logged: the
        window then holds in memory only until the next one that succeeds)."""
        journal = self.counter.take_journal()
        if journal and self.store is not None and not self.store.save_step_window(journal):
            self.log.warning("step.window.save_failed", changes=len(journal))

    async def reserve(self, req: ReserveRequest) -> dict:
        """A reservation (see :meth:`StepCounter.reserve`); while no step is open to it,
        wait (at most ``timeout_s``) for the stage to step."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        async with self._changed:
            while True:
                reported = {
                    s.url: step
                    for s in self.live_servers()
                    if s.stage == req.stage and (step := self.reported_step(s)) is not None
                }
                r = self.counter.reserve(req, live=self._live(req.stage), reported=reported)
                self._persist()
                st = self.counter.stages[req.stage]
                if r.verdict is Verdict.CATCH_UP:
                    self.log.warning(
                        "step.caught_up",
                        stage=req.stage,
                        replica=req.url,
                        replica_step=req.step,
                        step=st.step,
                        reason=(
                            "no live replica of the stage holds its step: the updates of the steps in between are lost"
                        ),
                    )
                if r.verdict is Verdict.DUPLICATE:
                    self.log.info(
                        "step.duplicate",
                        stage=req.stage,
                        replica=req.url,
                        microbatch=req.microbatch_id,
                        held_in=st.held[req.microbatch_id][0],
                        held_by=st.held[req.microbatch_id][1],
                    )
                self.log.debug(
                    "step.reserve",
                    stage=req.stage,
                    replica=req.url,
                    replica_step=req.step,
                    samples=req.samples,
                    microbatch=req.microbatch_id,
                    verdict=r.verdict.value,
                    bucket=r.bucket,
                    stage_step=st.step,
                    reserved=dict(st.reserved),
                    done=dict(st.done),
                )
                if r.verdict is not Verdict.WAIT:
                    return dataclasses.replace(r, replicas=len(self._live(req.stage))).as_json()
                if self.closing:
                    raise Draining("the coordinator is stopping: reserve again once it is back")
                if loop.time() >= deadline:
                    raise Overloaded(
                        f"stage {req.stage} is a whole global step ahead of its step {st.step}", retry_after_s=1.0
                    )
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), deadline - loop.time())

    async def done(self, report: DoneReport) -> dict:
        """Record what a replica accumulated; start the stage's round if that completed its
        step. The report of the reservation that closed a step is answered once that step's
        round started (other reports of the step may still be on their way; at most
        ``timeout_s``), so that its replica can wait for the step. A report that gives its
        reservation back (a failed backward) opens its step again: the reservations held
        meanwhile look again at once, and a closing one that gave back no longer closes
        anything, so it does not wait."""
        stage, bucket = report.stage, report.bucket
        self.counter.done(report)
        self._persist()
        st = self.counter.stages[stage]
        self.log.debug(
            "step.reported",
            stage=stage,
            replica=report.url,
            replica_step=report.step,
            bucket=bucket,
            microbatch=report.microbatch_id,
            reserved_here=report.reserved,
            samples=report.samples,
            closes=report.closes,
            stage_step=st.step,
            reserved=dict(st.reserved),
            done=dict(st.done),
        )
        if report.gives_back:
            await self._notify()
        await self.maybe_start(stage)
        if report.closes and not report.gives_back:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.timeout_s
            async with self._changed:
                while (
                    st.step <= bucket
                    and not (st.step == bucket and st.round_id not in (None, STARTING))
                    and loop.time() < deadline
                    and not self.closing
                ):
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), deadline - loop.time())
        return {"round": st.round_id if st.round_id != STARTING else None, "step": st.step}

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def maybe_start(self, stage: int) -> None:
        ready = self.counter.ready(stage, self._live(stage))
        self._persist()  # a step that lost every reservation gave them up
        if not ready or self.session is None:
            return
        st = self.counter.stages[stage]
        reported = {
            s.url: step for s in self.live_servers() if s.stage == stage and (step := self.reported_step(s)) is not None
        }
        step, members = st.step, self.counter.members(stage, self._live(stage), reported)
        if not members:
            return
        by = st.done_by.get(step, {})
        shares = round_shares([by.get(url, 0) for url in members])
        st.round_id = STARTING  # no second round while this one is being started
        try:
            round_id, accepted = await start_round(
                self.session,
                stage,
                members,
                codec=self.codec,
                timeout_s=self.timeout_s,
                log=self.log,
                with_accepted=True,
                aggregator=self.aggregator,
                kind="step",
                step=step,
                error_feedback=self.error_feedback,
                lookahead=self.lookahead,
                shares=shares,
            )
        except BaseException:
            st.round_id = None
            raise
        self.counter.round_started(stage, round_id)
        await self._notify()
        self.log.info(
            "step.round.started",
            stage=stage,
            step=step,
            round_id=round_id,
            members=len(members),
            shares=shares,
            accepted=accepted,
            reserved=st.reserved.get(step, 0),
            accumulated=st.done.get(step, 0),
        )
        task = asyncio.create_task(
            self._finish(StageRound(stage, round_id, members, accepted), step), name=f"step-{round_id}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _finish(self, rnd: StageRound, step: int) -> None:
        moved_at: list[float] = []

        async def ended(url: str, status: dict) -> None:  # the stage moves with its first member's step
            reached = status.get("step")
            if self.lookahead is None or type(reached) is not int:
                return
            if self.counter.member_stepped(rnd.stage, rnd.round_id, url, reached, rnd.members):
                moved_at.append(time.monotonic())
                self._persist()
                self.log.info("step.advanced", stage=rnd.stage, step=reached, round_id=rnd.round_id, first=url)
                await self._notify()

        started = time.monotonic()
        statuses = await wait_round_ended(self.session, rnd, self.timeout_s, on_ended=ended)
        member_steps = {url: s["step"] for url, s in statuses.items() if type(s.get("step")) is int}
        samples = {}
        for url, s in statuses.items():  # what each member put in, as it says
            last = s.get("last_round") or {}
            said = last.get("samples", last.get("weight"))  # a local-mode outer step's weight is not the step's samples
            if last.get("round_id") == rnd.round_id and isinstance(said, (int, float)):
                samples[url] = int(said)
        effective, dropped = self.counter.round_ended(rnd.stage, member_steps, samples, self._live(rnd.stage))
        self._persist()
        st = self.counter.stages[rnd.stage]
        if st.step > step:
            self.log.info(
                "step.done",
                stage=rnd.stage,
                step=st.step,
                round_id=rnd.round_id,
                effective_batch=effective,
                samples_dropped=dropped,
                members=len(rnd.members),
                stepped=sum(1 for s in member_steps.values() if s >= st.step),
                moved_after_s=round(moved_at[0] - started, 4) if moved_at else None,
                ended_after_s=round(time.monotonic() - started, 4),
            )
        else:
            self.log.warning(
                "step.failed",
                stage=rnd.stage,
                step=step,
                round_id=rnd.round_id,
                members=len(rnd.members),
                reason="no member stepped; trying again",
            )
        await self._notify()
        await self.maybe_start(rnd.stage)  # the next step may be complete already

    async def settled(self) -> None:
        """Until the rounds running now have ended here (their members polled, the stages moved)."""
        await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def wait_changed(self, timeout_s: float) -> None:
        """Until a round starts or ends (a stage may have stepped), at most ``timeout_s``."""
        async with self._changed:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), max(0.0, timeout_s))

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Hold the session; start the rounds of steps whose reservations stalled."""
        self.session = session
        try:
            while True:
                await asyncio.sleep(CHECK_EVERY_S)
                for stage in range(len(self.counter.stages)):
                    try:
                        await self.maybe_start(stage)
                    except Exception as exc:  # noqa: BLE001 - the loop must go on
                        self.log.exception("step.round.start_failed", stage=stage, error=repr(exc))
        finally:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)


# ------------------------------------------------------------------ the HTTP edge
STEPS = web.AppKey("steps", StepScheduler)
_MAX_BODY_BYTES = 64 * 1024  # a reservation or a report is a few hundred bytes of JSON


def add_step_routes(
    app: web.Application, *, run_id: str, num_stages: int, admitted_floor: Callable[[int], int] | None = None
) -> None:
    """``POST /step/reserve`` and ``POST /step/done`` (bodies and answers in
    ``shared/step_protocol.py``), answered by ``app[STEPS]``. ``admitted_floor``: the step a
    trainer's admission is for, as the admission counts it now (``admission.py``)."""

    async def message(request: web.Request) -> dict:
        msg = await read_json(request, _MAX_BODY_BYTES, setting="the coordinator's fixed limit")
        check_run(msg, run_id)
        return msg

    async def reserve(request: web.Request) -> web.Response:
        req = ReserveRequest.from_json(await message(request), num_stages)
        if req.admitted_step is not None and admitted_floor is not None:
            req = dataclasses.replace(req, admitted_step=admitted_floor(req.admitted_step))
        return web.json_response(await request.app[STEPS].reserve(req))

    async def done(request: web.Request) -> web.Response:
        report = DoneReport.from_json(await message(request), num_stages)
        return web.json_response(await request.app[STEPS].done(report))

    app.router.add_post("/step/reserve", reserve)
    app.router.add_post("/step/done", done)
