"""Global steps, coordinator side: which step each microbatch's gradient belongs to, and
when a stage's replicas all-reduce and step.

Every global step of a stage holds the run's global batch (``SWARM_GLOBAL_BATCH``
samples), whatever the replicas and trainers. Before a replica runs a backward it asks
which step the microbatch's gradient goes to (``POST /step/reserve``): the stage's step
until its reservations reach the global batch (the reservation that gets there ``closes``
it), then the next one. Only one step ahead of the stage's is handed out: a reservation
past that waits until the stage steps, bounded by ``step_timeout_s``. After
the backward the replica says what it accumulated (``POST /step/done``; 0 samples for a
duplicate or a failed backward, which gives the reservation back). Once every sample
reserved for the stage's step is accumulated, the coordinator starts a ``step`` round
among the stage's live replicas (the butterfly all-reduce of the stage server's
``averaging.py``; the coordinator moves no tensor), waits until the members report it
ended, and moves the stage to the step they reached. Reservations still out
``step_timeout_s`` after the step closed (a replica died with them) are given up: the
round starts with what was accumulated, and the step holds fewer samples. A given-up
reservation counts in ``samples_dropped`` if its replica reports it later; one whose
replica died does not (its backward failed there, and the trainer runs it again).

A replica at an older step than its stage's is told to take a live replica's state
(``resync``); a newer one (this coordinator restarted) moves the stage's count forward.
When no live replica of the stage holds its step any more (every one that did was killed,
and a server rejoined from an older checkpoint, or the survivor of a round its peer
completed alone), nobody can give that state: the replica is told to catch up
(``catch_up``): it takes the stage's step number with its own weights, the updates of the
steps in between are lost (``step.caught_up``, counted in ``steps_lost``), and every
stage's step count stays the run's, rather than waiting forever for a state that is gone.
A replica that could not reach the coordinator accumulates into its current step and
reports it afterwards (``reserved: 0``): that step may then hold more than the global batch.

:class:`StepCounter` is the plain logic; :class:`StepScheduler` runs it with HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import aiohttp

from services.coordinator.averaging import StageRound, start_round, wait_round_ended
from shared.errors import BadPayload, Draining, Overloaded, SwarmError

STARTING = "<starting>"  # round_id while a round's start messages are on their way
CHECK_EVERY_S = 0.5  # how often stalled steps are looked for
RETRY_FAILED_ROUND_S = 1.0  # a step round that nobody completed is tried again after this


class GlobalBatchMismatch(SwarmError):
    """Replicas of one stage disagree on SWARM_GLOBAL_BATCH."""

    status = 409
    code = "global_batch_mismatch"


@dataclass
class StageCount:
    """A stage's step and the samples reserved and accumulated for its next steps."""

    step: int = 0  # global steps the stage has taken (as its replicas reported them)
    global_batch: int = 0  # from the first report (0: none yet)
    reserved: dict[int, int] = field(default_factory=dict)  # step -> samples reserved (accumulated ones included)
    done: dict[int, int] = field(default_factory=dict)  # step -> samples accumulated
    closed_at: dict[int, float] = field(default_factory=dict)  # step -> when its reservations reached the global batch
    round_id: str | None = None  # the step round running, if any
    replica_steps: dict[str, int] = field(default_factory=dict)  # replica URL -> the step it last reported
    last_seen: dict[str, float] = field(
        default_factory=dict
    )  # replica URL -> when it last reported (alive, registered or not)
    outstanding: dict[int, dict[str, int]] = field(
        default_factory=dict
    )  # step -> replica URL -> samples reserved, not reported yet
    not_before: float = 0.0  # a failed round is not retried before this time
    samples_dropped: int = 0  # accumulated samples that missed their step (replicas that did not step, late reports)
    steps_lost: list[tuple[int, int]] = field(
        default_factory=list
    )  # (from, to) of each catch-up: the updates of those steps were lost with the replicas that held them
    last_effective_batch: int = 0

    def closed(self, step: int) -> bool:
        return step in self.closed_at


@dataclass(frozen=True)
class ReserveAnswer:
    bucket: int | None  # the step the microbatch's gradient goes to; None: resync, catch up, or wait
    closes: bool = False
    resync: bool = False
    complete: bool = False
    catch_up: bool = False  # behind, and no live replica holds the stage's step: take its number, lose its updates

    def as_json(self, stage_step: int) -> dict:
        return {
            "bucket": self.bucket,
            "closes": self.closes,
            "resync": self.resync,
            "complete": self.complete,
            "catch_up": self.catch_up,
            "step": stage_step,
        }


class StepCounter:
    """Per-stage reservations and the decision to step; ``clock`` is monotonic seconds."""

    def __init__(
        self, num_stages: int, *, timeout_s: float, lease_s: float = 0.0, clock: Callable[[], float] = time.monotonic
    ):
        """``lease_s``: a replica that reported this recently counts as alive, registered or not
        (a restarted coordinator's registry fills again as the servers heartbeat)."""
        self.stages = [StageCount() for _ in range(num_stages)]
        self.timeout_s, self.lease_s, self.clock = timeout_s, lease_s, clock

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
            self._advance(st, replica_step)
        return st

    def reserve(
        self,
        stage: int,
        url: str,
        replica_step: int,
        samples: int,
        global_batch: int,
        until_step: int | None = None,
        live: Iterable[str] | None = None,
        reported: Mapping[str, int] | None = None,
    ) -> ReserveAnswer:
        """The step a microbatch of ``samples`` gets, or None: the replica must resync
        (``resync``), the trainer's run ends before that step (``complete``: its ``until_step``
        steps are all reserved and accumulated), or the stage is a whole step ahead already, or
        the run's last step still has reservations out (wait: one given back opens that step
        again, and a backward told ``complete`` meanwhile would leave it short for good).
        ``live`` (the stage's registered replicas) and ``reported`` (URL -> the step of their
        registration or heartbeat): a replica behind its stage when none of them, nor any that
        reported within the lease, holds the stage's step is told to catch up instead."""
        st = self._check(stage, url, replica_step, global_batch)
        if replica_step < st.step:
            if live is None or st.round_id is not None or self._holds_the_step(st, url, live, reported or {}):
                return ReserveAnswer(None, resync=True)
            st.steps_lost.append((replica_step, st.step))
            st.replica_steps[url] = st.step
            return ReserveAnswer(None, catch_up=True)
        open_steps = ([] if st.round_id is not None else [st.step]) + [
            st.step + 1
        ]  # the round running took its step's buckets
        k = next((k for k in open_steps if st.reserved.get(k, 0) < st.global_batch), None)
        if k is None:
            return ReserveAnswer(None)  # a whole step ahead already: wait
        if until_step is not None and k >= until_step:
            if any(st.reserved.get(j, 0) > st.done.get(j, 0) for j in open_steps if j < until_step):
                return ReserveAnswer(None)  # the run's last steps have reservations out, which may come back: wait
            return ReserveAnswer(None, complete=True)
        st.reserved[k] = st.reserved.get(k, 0) + samples
        by_url = st.outstanding.setdefault(k, {})
        by_url[url] = by_url.get(url, 0) + samples
        closes = st.reserved[k] >= st.global_batch
        if closes:
            st.closed_at[k] = self.clock()
        return ReserveAnswer(k, closes)

    def done(
        self, stage: int, url: str, replica_step: int, bucket: int, reserved: int, samples: int, global_batch: int
    ) -> None:
        """A replica accumulated ``samples`` of the ``reserved`` it asked for ``bucket``."""
        st = self._check(stage, url, replica_step, global_batch)
        if bucket < st.step:  # its step was taken without it
            st.samples_dropped += samples
            return
        if reserved == 0:  # accumulated without a reservation (the coordinator was away)
            st.reserved[bucket] = st.reserved.get(bucket, 0) + samples
            if st.reserved[bucket] >= st.global_batch and not st.closed(bucket):
                st.closed_at[bucket] = self.clock()
        else:
            st.reserved[bucket] = st.reserved.get(bucket, 0) - (reserved - samples)  # given back
            by_url = st.outstanding.get(bucket, {})
            by_url[url] = by_url.get(url, 0) - reserved
            if st.reserved[bucket] < st.global_batch:  # open again: the next reservation completes it
                st.closed_at.pop(bucket, None)
        st.done[bucket] = st.done.get(bucket, 0) + samples

    def ready(self, stage: int, live: Iterable[str] | None = None) -> bool:
        """Start the stage's step round now? Its step is closed and everything reserved for
        it accumulated, but what replicas no longer ``live`` (gone from the registry) held,
        or its reservations have been out ``timeout_s``."""
        st = self.stages[stage]
        k = st.step
        if st.round_id is not None or not st.closed(k) or self.clock() < st.not_before:
            return False
        now = self.clock()
        alive = (
            None if live is None else set(live) | {url for url, at in st.last_seen.items() if now - at < self.lease_s}
        )
        lost = sum(
            n for url, n in st.outstanding.get(k, {}).items() if n > 0 and alive is not None and url not in alive
        )
        complete = st.done.get(k, 0) >= st.reserved.get(k, 0) - lost or now - st.closed_at[k] >= self.timeout_s
        if complete and st.done.get(k, 0) == 0:  # everything reserved for it was lost: no empty step, fill it again
            st.reserved[k], st.outstanding[k] = 0, {}
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

    def round_ended(self, stage: int, member_steps: dict[str, int], member_samples: dict[str, int]) -> tuple[int, int]:
        """The round's members reached ``member_steps`` (URL -> step, members that answered);
        the stage moves to the furthest. Returns (effective batch, samples dropped)."""
        st = self.stages[stage]
        st.round_id = None
        for url, step in member_steps.items():
            st.replica_steps[url] = max(step, st.replica_steps.get(url, 0))
        before = st.step
        reached = max(member_steps.values(), default=before)
        if reached <= before:  # nobody stepped: they gave their gradients back; try again a little later
            st.not_before = self.clock() + RETRY_FAILED_ROUND_S
            return 0, 0
        stepped = [url for url, s in member_steps.items() if s >= reached]
        effective = sum(member_samples.get(url, 0) for url in stepped)
        dropped = max(
            0, st.done.get(before, 0) - effective
        )  # accumulated, yet not in the step: members that failed or vanished
        st.samples_dropped += dropped
        st.last_effective_batch = effective
        self._advance(st, reached)
        return effective, dropped

    def _holds_the_step(self, st: StageCount, url: str, live: Iterable[str], reported: Mapping[str, int]) -> bool:
        """Is a replica alive and at the stage's step (it can give its state)? ``url`` itself
        counts when it said so before: its report was sent before a step and came after it."""
        now = self.clock()
        alive = set(live) | {u for u, at in st.last_seen.items() if now - at < self.lease_s} | {url}
        return any(max(st.replica_steps.get(u, -1), reported.get(u, -1)) >= st.step for u in alive)

    def _advance(self, st: StageCount, step: int) -> None:
        for k in [k for k in st.reserved if k < step]:
            st.reserved.pop(k, None)
        for table in (st.done, st.closed_at, st.outstanding):
            for k in [k for k in table if k < step]:
                table.pop(k)
        st.step = step

    def view(self) -> list[dict]:
        """Per stage: step, samples reserved and accumulated for it, dropped samples."""
        return [
            {
                "stage": i,
                "step": st.step,
                "reserved": st.reserved.get(st.step, 0),
                "accumulated": st.done.get(st.step, 0),
                "global_batch": st.global_batch,
                "round": st.round_id,
                "samples_dropped": st.samples_dropped,
                "last_effective_batch": st.last_effective_batch,
                "steps_lost": st.steps_lost[-4:],
            }
            for i, st in enumerate(self.stages)
        ]


def check_step_report(msg: dict, num_stages: int, fields: tuple[str, ...]) -> tuple:
    """(stage, url, *fields) of a ``/step/reserve`` or ``/step/done`` body, validated."""
    stage, url = msg.get("stage"), msg.get("url")
    if type(stage) is not int or not 0 <= stage < num_stages:
        raise BadPayload(f"'stage' must be an int in [0, {num_stages})")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")) or len(url) > 512:
        raise BadPayload("'url' must be the replica's http(s) URL")
    values = []
    for name in fields:
        value, low = msg.get(name), 1 if name == "global_batch" else 0
        if type(value) is not int or not low <= value < 2**53:
            raise BadPayload(f"'{name}' must be an int >= {low}")
        values.append(value)
    return (stage, url.rstrip("/"), *values)


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
    ):
        """``reported_step(server)``: the step a live server said in its registration or last heartbeat."""
        self.live_servers, self.codec, self.timeout_s, self.aggregator, self.log = (
            live_servers,
            codec,
            timeout_s,
            aggregator,
            log,
        )
        self.reported_step = reported_step
        self.counter = StepCounter(num_stages, timeout_s=timeout_s, lease_s=lease_s)
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

    async def reserve(
        self, stage: int, url: str, replica_step: int, samples: int, global_batch: int, until_step: int | None = None
    ) -> dict:
        """A reservation; while the stage is a whole step ahead, wait (at most ``timeout_s``) for it to step."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        async with self._changed:
            while True:
                reported = {
                    s.url: step
                    for s in self.live_servers()
                    if s.stage == stage and (step := self.reported_step(s)) is not None
                }
                r = self.counter.reserve(
                    stage,
                    url,
                    replica_step,
                    samples,
                    global_batch,
                    until_step,
                    live=self._live(stage),
                    reported=reported,
                )
                if r.catch_up:
                    self.log.warning(
                        "step.caught_up",
                        stage=stage,
                        replica=url,
                        replica_step=replica_step,
                        step=self.counter.stages[stage].step,
                        reason=(
                            "no live replica of the stage holds its step: the updates of the steps in between are lost"
                        ),
                    )
                self.log.debug(
                    "step.reserve",
                    stage=stage,
                    replica=url,
                    replica_step=replica_step,
                    samples=samples,
                    bucket=r.bucket,
                    closes=r.closes,
                    resync=r.resync,
                    complete=r.complete,
                    stage_step=self.counter.stages[stage].step,
                    reserved=dict(self.counter.stages[stage].reserved),
                    done=dict(self.counter.stages[stage].done),
                )
                if r.bucket is not None or r.resync or r.complete or r.catch_up:
                    return {**r.as_json(self.counter.stages[stage].step), "replicas": len(self._live(stage))}
                if self.closing:
                    raise Draining("the coordinator is stopping: reserve again once it is back")
                if loop.time() >= deadline:
                    raise Overloaded(
                        f"stage {stage} is a whole global step ahead of its step {self.counter.stages[stage].step}",
                        retry_after_s=1.0,
                    )
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), deadline - loop.time())

    async def done(
        self,
        stage: int,
        url: str,
        replica_step: int,
        bucket: int,
        reserved: int,
        samples: int,
        global_batch: int,
        closes: bool = False,
    ) -> dict:
        """Record what a replica accumulated; start the stage's round if that completed its
        step. The report of the reservation that closed a step is answered once that step's
        round started (other reports of the step may still be on their way; at most
        ``timeout_s``), so that its replica can wait for the step. A report that gives its
        reservation back (a duplicate, a failed backward) opens its step again: the
        reservations held meanwhile look again at once, and a closing one that gave back no
        longer closes anything, so it does not wait."""
        gave_back = 0 < reserved and samples < reserved
        self.counter.done(stage, url, replica_step, bucket, reserved, samples, global_batch)
        self.log.debug(
            "step.reported",
            stage=stage,
            replica=url,
            replica_step=replica_step,
            bucket=bucket,
            reserved_here=reserved,
            samples=samples,
            closes=closes,
            stage_step=self.counter.stages[stage].step,
            reserved=dict(self.counter.stages[stage].reserved),
            done=dict(self.counter.stages[stage].done),
        )
        if gave_back:
            await self._notify()
        await self.maybe_start(stage)
        st = self.counter.stages[stage]
        if closes and not gave_back:
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
        if not self.counter.ready(stage, self._live(stage)) or self.session is None:
            return
        st = self.counter.stages[stage]
        reported = {
            s.url: step for s in self.live_servers() if s.stage == stage and (step := self.reported_step(s)) is not None
        }
        step, members = st.step, self.counter.members(stage, self._live(stage), reported)
        if not members:
            return
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
        statuses = await wait_round_ended(self.session, rnd, self.timeout_s)
        member_steps = {url: s["step"] for url, s in statuses.items() if type(s.get("step")) is int}
        samples = {}
        for url, s in statuses.items():  # what each member put in, as it says
            last = s.get("last_round") or {}
            said = last.get("samples", last.get("weight"))  # a local-mode outer step's weight is not the step's samples
            if last.get("round_id") == rnd.round_id and isinstance(said, (int, float)):
                samples[url] = int(said)
        effective, dropped = self.counter.round_ended(rnd.stage, member_steps, samples)
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
