"""Global steps, stage-server side, one owner: which step a backward's gradient goes to
(:class:`StepClient`), and the step's round on this replica (:class:`StepRound`: take the
gradient, have it all-reduced, decide, apply or give back).

Every global step of a stage holds the run's global batch (``SWARM_GLOBAL_BATCH`` samples,
all replicas and trainers together). The coordinator counts (see its ``steps.py``):
before a backward, :meth:`StepClient.reserve` asks which step the microbatch's gradient
goes to; the runtime accumulates it in that step's bucket; :meth:`StepClient.done` says
what was accumulated (0 samples for a duplicate or a failed backward, which gives the
reservation back). The messages and the verdict are in ``shared/step_protocol.py``. A
reservation names its microbatch: told ``duplicate`` (another backward of it, on this
replica or another, holds it at this stage), the backward returns its input gradient and
accumulates nothing. Once a step's reservations are all accumulated, the coordinator starts
a ``step`` round among the stage's live replicas (the all-reduce is ``allreduce.py``; this
replica's side of it is :class:`StepRound`): they all-reduce that step's buckets and apply
the same optimizer step. Meanwhile backwards may be reserved
for the next step, never one further: the coordinator holds such a reservation until the
stage steps. A backward always runs on its forward's weights (the runtime keeps them, see
``runtime.py``); a microbatch the trainer's admission bound to a step (``admitted_step``)
goes into no earlier step, so its gradient is at most ``SWARM_MAX_STALENESS`` steps older
than the step it goes into (0 with ``SWARM_SCHEDULE=sync``).

Most ``done`` reports go in the background. The one of the reservation that completed a
step's global batch goes in the foreground and, if it started the round, the backward of
stage 0 answers the trainer only once this replica stepped (the trainer learns the swarm's
step from it). A later stage answers at once with the gradient its upstream stage waits
for, and settles in the background (:meth:`StepClient.settle_soon`): a step round no longer
holds up the stages before it, one after the other. Every forward waits for such a settle
first (:meth:`StepClient.settled`), so a lone replica with one microbatch in flight still
steps exactly where one process would.

A replica the coordinator finds behind its stage (it missed a round, or joined from an
older state) takes the state of a live replica, the furthest (``resync``), before it runs
the backward that asked; its accumulated samples are dropped and counted.

While the coordinator does not answer, nobody can count for the stage: each replica
accumulates into its current step and steps alone on its share of the global batch
(``alone_share``: the global batch over the replicas of its stage it last heard of; one
replica per stage thus steps exactly as before). Its replicas may drift apart meanwhile;
when the coordinator is back, the stage goes on from the furthest replica's step, those
behind resync, and the coordinator's digest check repairs replicas that drifted.

Without a coordinator there is no one to count: the server steps on its own as soon as it
alone holds the global batch (``StageRuntime(solo=True)``), as one replica of one stage.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch
from aiohttp import web

from services.stage_server.aggregation import EPSILON_WEIGHT
from services.stage_server.allreduce import (
    AVERAGER,
    Averager,
    AveragingRound,
    ReducedPart,
    RoundConflict,
    RoundSpec,
    off_loop,
)
from services.stage_server.error_feedback import ErrorFeedback, Tag
from services.stage_server.routes import RUNTIME, WORKER
from services.stage_server.runtime import Accumulated
from services.stage_server.state import load_stage_state
from services.stage_server.state_routes import state_from_peers
from shared.config import StageServerSettings, advertised_url
from shared.errors import BadPayload, Overloaded, RemoteError
from shared.http import post_json
from shared.step_protocol import DoneReport, ReserveAnswer, ReserveRequest, Verdict

EARLY_BACKWARDS = 2  # backwards computed at once with their reservation's round trip (a gradient each)


@dataclass(frozen=True)
class Reservation:
    """The step a backward's gradient goes to, as the coordinator gave it (``reserved`` 0:
    the coordinator could not be asked; the runtime's current step)."""

    bucket: int
    reserved: int
    closes: bool = False  # this reservation completed the step's global batch
    alone: int = 0  # samples this replica gave the step itself (the coordinator away)
    microbatch_id: str | None = None  # the microbatch reserved (None: unreserved)


class StepClient:
    """One replica's side of global steps. ``post(path, body) -> dict`` posts to the
    coordinator; ``resync()`` loads a live replica's state; ``wait_round(round_id,
    timeout_s)`` waits for a step round here to end; ``in_round()``: one runs now;
    ``hold_for(admitted_step)``: waits for a step round whose weights a microbatch admitted
    for that step needs (``Averager.hold_for``)."""

    def __init__(
        self,
        runtime,
        *,
        post: Callable[[str, dict], Awaitable[dict]],
        resync: Callable[[], Awaitable[None]],
        wait_round: Callable[[str, float], Awaitable[None]],
        identity: dict,
        round_wait_s: float,
        log,
        in_round: Callable[[], bool] = lambda: False,
        hold_for: Callable[[int | None], Awaitable[None]] | None = None,
    ):
        self.runtime, self.post, self.resync, self.wait_round, self.in_round = (
            runtime,
            post,
            resync,
            wait_round,
            in_round,
        )
        self._hold_for = hold_for
        self.identity, self.round_wait_s, self.log = identity, round_wait_s, log
        self.global_batch = int(identity["global_batch"])
        self.replicas = 1  # live replicas of this stage, as the coordinator last said
        self.coordinator_away = False
        self._telling = asyncio.Lock()
        self._alone_out: dict[
            int, int
        ] = {}  # the coordinator away: step -> samples of backwards given it, not yet accumulated
        self._background: set[asyncio.Task] = set()
        self._resyncing: asyncio.Task | None = None
        self._settling: asyncio.Task | None = None  # a closing backward's settle, in the background
        # backwards computed while their reservation is asked for (routes.run_backward): each
        # holds its gradient until the answer comes; past this many, a backward reserves first
        self.early = asyncio.Semaphore(EARLY_BACKWARDS)
        self.failures = 0

    @classmethod
    def for_server(cls, app: web.Application, settings: StageServerSettings, session, log) -> StepClient:
        """The step client of a running server: it posts to ``settings.coordinator`` with
        ``session``, resyncs from the furthest live replica of its stage, waits for the rounds
        of ``app[AVERAGER]``, whose step rounds (:class:`StepRound`) resync the same way."""
        url = advertised_url(settings.host, settings.port, settings.advertise_url, tls=settings.tls)
        runtime, worker, averager = app[RUNTIME], app[WORKER], app[AVERAGER]

        async def resync() -> None:
            state = await state_from_peers(settings, log, exclude=url, furthest_first=True)
            if state is None:
                raise RemoteError(
                    settings.coordinator + "/swarm",
                    None,
                    "no_state",
                    "no other live replica of this stage gave its state",
                )
            await worker.run(load_stage_state, runtime, *state)
            log.info("step.resynced", step=runtime.step)

        async def post(path: str, body: dict) -> dict:
            # a reservation may be held while the stage is a whole step ahead (the coordinator's step_timeout_s)
            return await post_json(session, settings.coordinator + path, body, timeout_s=settings.join_timeout_s)

        averager.kinds["step"].resync = resync  # a local-mode replica that missed an outer step takes a peer's anchor
        identity = {
            "run_id": settings.run_id,
            "stage": settings.stage,
            "url": url,
            "global_batch": settings.global_batch,
        }
        return cls(
            runtime,
            post=post,
            resync=resync,
            wait_round=averager.wait_round,
            in_round=lambda: averager.running,
            hold_for=averager.hold_for,
            identity=identity,
            round_wait_s=settings.join_timeout_s,
            log=log,
        )

    async def hold_for(self, admitted_step: int | None) -> None:
        """Before a training forward here of a microbatch admitted for ``admitted_step``: a
        step round still applying the weights its admission counts on ends first."""
        if self._hold_for is not None:
            await self._hold_for(admitted_step)

    async def reserve(
        self, samples: int, until_step: int | None, microbatch_id: str, admitted_step: int | None = None
    ) -> Reservation | Verdict:
        """The step for the backward of ``microbatch_id`` (``samples``; ``admitted_step``: the
        step the coordinator admitted it for, if the trainer said), or the verdict of a
        backward that accumulates nothing: ``COMPLETE`` (the trainer's ``until_step`` steps
        are all reserved at this stage), ``DUPLICATE`` (the stage holds this microbatch
        already). A replica behind its stage first takes a live replica's state (the backward
        waits for it); :class:`Overloaded` if that fails or the stage is a whole step ahead
        (the trainer retries). Without an answer from the coordinator: the current step,
        unreserved."""
        if self.coordinator_away and self.runtime.pending():
            await self._tell_what_is_held()
        stage, url = self.identity["stage"], self.identity["url"]
        for _ in range(3):  # again after a resync, or if this replica stepped while it asked
            request = ReserveRequest(
                stage, url, self.runtime.step, samples, self.global_batch, microbatch_id, until_step, admitted_step
            )
            try:
                reply = await self.post("/step/reserve", {**self.identity, **request.as_json()})
                answer = ReserveAnswer.from_json(reply)
            except RemoteError as exc:
                if exc.status == 503:
                    raise Overloaded(
                        f"the coordinator holds this stage's backwards: {exc.message}",
                        retry_after_s=exc.retry_after_s or 1.0,
                    ) from None
                self._failed(exc)
                return self._reserve_alone(samples)
            except BadPayload as exc:
                self._failed(RemoteError("/step/reserve", 200, "bad_reply", f"{exc}: {reply!r}"))
                return self._reserve_alone(samples)
            self.coordinator_away = False
            if answer.replicas > 0:
                self.replicas = answer.replicas
            if answer.verdict is Verdict.CATCH_UP:
                if self.in_round():  # the round applying here ends with this replica at its step, or told again
                    raise Overloaded(
                        f"this replica is applying the step round of step {self.runtime.step}", retry_after_s=1.0
                    )
                self._catch_up(answer.step)
                continue
            if answer.verdict is not Verdict.RESYNC:
                break
            if self.runtime.step < answer.step:
                await self._resync_now(answer.step)
        else:
            raise Overloaded(
                f"this replica is at step {self.runtime.step}, behind its stage, "
                "and could not take a live replica's state yet",
                retry_after_s=1.0,
            )
        if answer.verdict is Verdict.WAIT:  # the coordinator holds these itself; never sent
            raise Overloaded("the coordinator said to wait for a step", retry_after_s=1.0)
        if not answer.verdict.accumulates:
            return answer.verdict
        return Reservation(answer.bucket, samples, answer.verdict is Verdict.CLOSES, microbatch_id=microbatch_id)

    def _reserve_alone(self, samples: int) -> Reservation:
        """Without the coordinator: this replica fills its own steps with its share of the
        global batch each (the next step's once the current one holds it), unreserved."""
        step = self.runtime.step
        self._alone_out = {k: n for k, n in self._alone_out.items() if k >= step and n > 0}
        claimed = self.runtime.pending(step) + self._alone_out.get(step, 0)  # accumulated, and on its way
        bucket = step if claimed < self.alone_share() else step + 1
        self._alone_out[bucket] = self._alone_out.get(bucket, 0) + samples
        return Reservation(bucket, 0, alone=samples)

    async def _tell_what_is_held(self) -> None:
        """Back from an absence of the coordinator: report the samples accumulated alone for
        the current step first, so that the coordinator counts them into it."""
        async with self._telling:  # one report of what is held, however many backwards come back at once
            if not self.coordinator_away:
                return
            step, held = self.runtime.step, self.runtime.pending()
            report = DoneReport(self.identity["stage"], self.identity["url"], step, step, 0, held, self.global_batch)
            try:
                await self.post("/step/done", {**self.identity, **report.as_json()})
            except RemoteError:
                return  # still away
            self.coordinator_away = False
            self.log.info("step.together", step=step, held=held)

    def alone_share(self) -> int:
        """While the coordinator is away: the samples after which this replica steps on its
        own (its share of the global batch among the replicas of its stage it last heard of)."""
        return max(1, -(-self.global_batch // self.replicas))

    async def settle(self, reservation: Reservation, samples: int, run_compute: Callable[..., Awaitable]) -> None:
        """After a backward: :meth:`done`, then, while the coordinator is away, a step alone
        once this replica holds its share of the global batch (on the compute worker)."""
        if reservation.alone:  # now accumulated (or not: a duplicate, a failure): no longer on its way
            self._alone_out[reservation.bucket] = self._alone_out.get(reservation.bucket, 0) - reservation.alone
        await self.done(reservation, samples)
        for _ in range(2):  # the current step, and the next one if it filled meanwhile
            if not (self.coordinator_away and not self.in_round() and self.runtime.pending() >= self.alone_share()):
                break
            step = await run_compute(self._step_alone)
            if step is not None:
                self.log.info(
                    "step.applied", step=step, alone=True, effective_batch=self.runtime.stats.last_effective_batch
                )

    def settle_soon(self, reservation: Reservation, samples: int, run_compute: Callable[..., Awaitable]) -> None:
        """:meth:`settle` in the background, for a backward whose gradient an upstream stage
        waits for: it answers at once, and this replica's step round (if its reservation
        closed the step) no longer holds up the stages before it. A forward that comes after
        it waits for it (:meth:`settled`), so it still runs on the weights of the step."""
        task = asyncio.create_task(self.settle(reservation, samples, run_compute), name="step.settle")
        self._background.add(task)
        task.add_done_callback(self._settled)
        self._settling = task

    def _settled(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.log.warning("step.settle.failed", error=repr(task.exception()))

    async def settled(self) -> None:
        """Wait (at most ``round_wait_s``) for a settle left in the background: the step its
        backward closed is taken here, or given up, before a later forward runs."""
        task = self._settling
        if task is not None and not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(task), self.round_wait_s)

    def _step_alone(self) -> int | None:
        if self.runtime.pending() < self.alone_share():
            return None  # another backward's step took it
        self.runtime.apply_step(self.runtime.take_gradients())
        return self.runtime.step

    async def done(self, reservation: Reservation, samples: int) -> None:
        """Say what the backward accumulated; in the foreground (waiting for the step round
        it starts) when its reservation completed the step, else in the background."""
        report = DoneReport(
            self.identity["stage"],
            self.identity["url"],
            self.runtime.step,
            reservation.bucket,
            reservation.reserved,
            samples,
            self.global_batch,
            reservation.microbatch_id if reservation.reserved else None,
            reservation.closes,
        )
        body = {**self.identity, **report.as_json()}
        if reservation.closes or not reservation.reserved:
            await self._done(body, wait=True)
            return
        task = asyncio.create_task(self._done(body, wait=False), name="step.done")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _done(self, body: dict, *, wait: bool) -> None:
        try:
            answer = await self.post("/step/done", body)
        except RemoteError as exc:
            self._failed(exc)
            return
        round_id = answer.get("round")
        if wait and isinstance(round_id, str):
            await self.wait_round(round_id, self.round_wait_s)

    def _failed(self, exc: RemoteError) -> None:
        if exc.status is None:  # unreachable or timed out: steps go on alone until it answers again
            if not self.coordinator_away:
                self.log.warning(
                    "step.alone",
                    share=self.alone_share(),
                    global_batch=self.global_batch,
                    replicas=self.replicas,
                    reason=f"the coordinator does not answer: {exc.code}",
                )
            self.coordinator_away = True
        self.failures += 1
        if self.failures == 1 or self.failures % 100 == 0:
            self.log.warning("step.report.failed", error=str(exc), failures=self.failures)

    def _catch_up(self, stage_step: int) -> None:
        """No live replica holds the stage's step: take its number with these weights."""
        lost = stage_step - self.runtime.step
        if lost > 0:
            self.log.warning(
                "step.caught_up",
                step=self.runtime.step,
                stage_step=stage_step,
                steps_lost=lost,
                dropping=self.runtime.pending_samples,
            )
            self.runtime.catch_up(stage_step)

    async def _resync_now(self, stage_step: int) -> None:
        """Take a live replica's state (one resync at a time; not while a round runs here,
        which ends with this replica in step or told again)."""
        if self.in_round():
            return
        if self._resyncing is None or self._resyncing.done():
            self.log.warning(
                "step.behind", step=self.runtime.step, stage_step=stage_step, dropping=self.runtime.pending_samples
            )
            self._resyncing = asyncio.create_task(self._resync(), name="step.resync")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._resyncing), self.round_wait_s)

    async def _resync(self) -> None:
        try:
            await self.resync()
        except Exception as exc:  # noqa: BLE001 - a failed resync is tried again on the next reservation
            self.log.warning("step.resync.failed", error=repr(exc))

    async def close(self) -> None:
        for task in [*self._background, *([self._resyncing] if self._resyncing else [])]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


# ------------------------------------------------------------------ the end of a step round
class StepVerdict(enum.Enum):
    """What a member does with a step round's reduced gradient. Every member that steps must
    apply the same gradient, or the replicas drift apart for good (the AdamW state remembers
    it): a member steps only on a gradient that every other member that steps can hold too,
    and never on an empty one."""

    APPLY = "apply"
    PART_FAILED = "part_failed"  # a part was reduced by neither its reducer nor a backup
    SHORT_BACKUP = "short_backup"  # a backup reduction from fewer contributors than the round's
    EMPTY = "empty"  # the reduced weight is 0 samples: nobody contributed


def step_verdict(parts: list[ReducedPart | None], backups: set[int]) -> StepVerdict:
    """Whether a member steps on ``parts`` (``backups``: the indices of those that came from a
    backup reducer). Only ``APPLY`` is a step; anything else gives the gradient back:

    - every part was reduced (else ``part_failed``);
    - a part that came from a backup reducer holds every member of the round's contributors
      (the members whose parts the main reducers, this member's own included, took), else
      ``short_backup``. A backup of part ``j`` never holds ``j``'s own values, and ``j`` may
      have served its main reduction to the others: a member left with such a backup gives
      its gradient back; if the others stepped, the coordinator resyncs it as a replica
      behind its stage. (A backup for a member that sent nothing, dead from the start, holds
      the whole round and is a step.)
    - the reduced weight is more than 0 samples (else ``empty``: nobody contributed, and an
      AdamW step with a zero gradient still moves the weights by momentum and decay)."""
    if not parts or any(p is None for p in parts):
        return StepVerdict.PART_FAILED
    contributors = set().union(*(p.contributors for j, p in enumerate(parts) if j not in backups))
    if any(not contributors <= set(parts[j].contributors) for j in backups):
        return StepVerdict.SHORT_BACKUP
    if min(p.weight for p in parts) <= 0:
        return StepVerdict.EMPTY
    return StepVerdict.APPLY


def settle_step(runtime, taken, gradient, step: int) -> bool:
    """On the compute worker, the end of a step round: apply ``gradient`` (the round's
    reduced ``Accumulated``; None: no step) as global step ``step``, or give ``taken``
    (what this member took for it) back to the step's bucket. True if it stepped. A
    replica that is no longer at ``step`` does not step (its bucket of ``step`` is then
    dropped, and counted, by its next step)."""
    if gradient is None or runtime.step != step:
        runtime.give_back(taken, step)
        return False
    try:
        runtime.apply_step(gradient)
    except BaseException:
        runtime.give_back(taken, step)
        raise
    return True


# ------------------------------------------------------------------ the step round
class StepRound:
    """The ``step`` kind of the stage's all-reduce rounds (``allreduce.py``): this replica's
    side of a global step's round. It takes the step's accumulated gradient, has it
    all-reduced (weighted by samples) and applies the same optimizer step as every other
    member where :func:`step_verdict` says so. A member that does not step gives its
    gradient back (if nobody stepped, nothing is lost; if the others stepped, the coordinator
    tells it to take their state, and its samples count as dropped). Whatever ends the round
    once the gradient is taken (a verdict, a failure, a shutdown), it is applied, given back,
    or, when the compute worker is gone, counted as dropped; never lost. The round's compute
    jobs are the stage's own bookkeeping and pass the compute queue's bound
    (``ComputeWorker.run(bounded=False)``).

    With ``error_feedback`` and a lossy codec, this replica adds to its gradient what the
    codec lost last step (``error_feedback.py``; per replica, reset when a state is loaded)."""

    def __init__(self, averager: Averager):
        self.averager, self.runtime = averager, averager.runtime
        self.feedback = ErrorFeedback(averager.num_params)  # this replica's residuals of compressed step rounds
        self.resync: Callable[[], Awaitable[None]] | None = None  # take a live replica's state (set by StepClient)

    def admit(self, spec: RoundSpec) -> None:
        if spec.step != self.runtime.step:
            raise RoundConflict(
                f"round {spec.round_id!r} takes step {spec.step}, this replica is at step {self.runtime.step}"
            )

    def status(self) -> dict:
        return {"error_feedback_resets": self.feedback.resets}

    async def run(self, rnd: AveragingRound, log) -> bool:
        """The step's round; True if this replica stepped."""
        if self.runtime.outer is not None:
            return await self._local_step(rnd, log)
        spec, averager = rnd.spec, self.averager
        taken, at = await self._take(spec.step, log)
        rnd.samples = taken.samples
        gradient, feedback = None, self._feedback(rnd)
        try:
            weight = float(taken.samples) or (
                1.0 if averager.byzantine else 0.0
            )  # an attacker claims a weight even when it served nothing
            contribution = taken.mean
            if feedback is not None:  # what the codec lost last step goes in again (error_feedback.py)
                contribution = await off_loop(averager.num_params, feedback.contribution, taken.mean, weight, at)
                rnd.sent_lost = torch.zeros(averager.num_params)
                rnd.main.feedback = feedback.for_part(*rnd.bounds[spec.index], at)
            mean = await averager.reduce(rnd, contribution, weight, log)
            rnd.verdict = step_verdict(rnd.parts, rnd.backups)
            if rnd.verdict is StepVerdict.APPLY:
                gradient = Accumulated(mean, int(min(p.weight for p in rnd.parts)), taken.microbatch_ids)
        finally:  # also on a failure or a cancel: the taken gradient is applied or goes back
            after = await self._settle(taken, spec.step, gradient, log)
        rnd.applied = stepped = after is not None
        if stepped and feedback is not None:
            own = rnd.parts[spec.index]
            reduced = (rnd.bounds[spec.index][0], own.lost) if own is not None and own.lost is not None else None
            feedback.commit(rnd.sent_lost if weight > 0 else None, reduced, after)
        if stepped:
            averager.stepped()
            log.info(
                "step.applied", step=self.runtime.step, effective_batch=gradient.samples, samples_here=taken.samples
            )
        else:
            log.warning(
                "step.missed",
                step=spec.step,
                verdict=rnd.verdict.value,
                samples_here=taken.samples,
                parts_failed=[j for j, p in enumerate(rnd.parts) if p is None],
                backups=sorted(rnd.backups),
            )
        return stepped

    async def _local_step(self, rnd: AveragingRound, log) -> bool:
        """A step round in ``local`` mode (``local_sync.py``): this member's own gradient of the
        step, alone; when an outer step is due, the members' outer gradients all-reduced
        (weighted by the samples each served since the last one) and the same outer step on
        every member. A member that missed a part, or holds one short of the round
        (:func:`step_verdict`), keeps its inner weights and its anchor (what it learned goes
        into its next outer gradient) and takes a live replica's state (``self.resync``), so
        that the anchors stay one."""
        taken = await self._unrefused(_take_and_inner_step, self.runtime, rnd.spec.step)
        rnd.samples = taken.samples
        self.averager.stepped()
        outer = self.runtime.outer
        if not outer.due(self.runtime.step):
            log.info("step.applied", step=self.runtime.step, local=True, samples_here=taken.samples)
            return True
        delta = await self._unrefused(self.runtime.outer_gradient)
        mean = await self.averager.reduce(rnd, delta, float(outer.samples) or EPSILON_WEIGHT, log)
        rnd.verdict = step_verdict(rnd.parts, rnd.backups)
        rnd.applied = rnd.verdict is StepVerdict.APPLY
        if rnd.applied:
            await self._unrefused(self.runtime.outer_step, mean)
            log.info(
                "step.applied",
                step=self.runtime.step,
                local=True,
                samples_here=taken.samples,
                outer_step=outer.steps,
                outer_norm=round(float(mean.norm()), 6),
            )
            return True
        log.warning(
            "outer.missed",
            step=self.runtime.step,
            verdict=rnd.verdict.value,
            parts_failed=[j for j, p in enumerate(rnd.parts) if p is None],
            resync=self.resync is not None,
        )
        if self.resync is not None:
            await self.resync()
        return False

    async def _unrefused(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A step round's job on the compute worker: never refused by the queue bound or a
        drain, and carried out even if the round is cancelled meanwhile."""
        return await asyncio.shield(asyncio.ensure_future(self.averager.run_compute(fn, *args, bounded=False)))

    def _feedback(self, rnd: AveragingRound) -> ErrorFeedback | None:
        """This replica's error feedback in a step round that asks for it with a lossy codec
        (never for a fault-injected attacker, whose values are not its gradient)."""
        lossy = rnd.codec != "fp32"
        return self.feedback if rnd.spec.error_feedback and lossy and self.averager.byzantine is None else None

    async def _take(self, step: int, log) -> tuple[Accumulated, Tag]:
        """The gradient accumulated for ``step`` and the runtime's (weights version, step) as it
        was taken; if the round is cancelled while it is being taken, it goes back to the
        bucket before the cancel goes on."""
        job = asyncio.ensure_future(self.averager.run_compute(_take_tagged, self.runtime, step, bounded=False))
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            if not job.cancelled():
                with contextlib.suppress(Exception):
                    await self._settle((await job)[0], step, None, log)
            raise

    async def _settle(self, taken: Accumulated, step: int, gradient: Accumulated | None, log) -> Tag | None:
        """Apply ``gradient`` as step ``step``, or give ``taken`` back (one job, see
        :func:`settle_step`); the runtime's (weights version, step) after it if this replica
        stepped, else None. A job that cannot be queued at all (the compute worker is shut
        down) leaves the gradient counted as dropped."""
        ran: list[bool] = []

        def settle() -> Tag | None:
            ran.append(True)
            stepped = settle_step(self.runtime, taken, gradient, step)
            return (self.runtime.version, self.runtime.step) if stepped else None

        try:
            return await self._unrefused(settle)
        except Exception as exc:
            if ran:
                raise
            self.runtime.drop(taken)
            log.warning("step.gradient.dropped", step=step, samples=taken.samples, reason=repr(exc))
            return None


def _take_tagged(runtime, step: int) -> tuple[Accumulated, Tag]:
    """On the compute worker: the gradient of ``step`` and the (weights version, step) it goes onto."""
    return runtime.take_gradients(step), (runtime.version, runtime.step)


def _take_and_inner_step(runtime, step: int) -> Accumulated:
    """``local`` mode, on the compute worker: take the step's gradient and apply it alone, in one job."""
    taken = runtime.take_gradients(step)
    runtime.inner_step(taken)
    return taken
