"""Averager: one stage server's side of the averaging rounds (see ``averaging.py``).

Holds the round in progress and the parts that arrive for it, sends this member's parts,
serves the reductions it owns, fetches the others and loads the average, all bounded by
the round's deadline. Also takes a peer's whole state when the coordinator repairs drift
(:meth:`Averager.copy_state`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from services.stage_server.aggregation import EPSILON_WEIGHT, byzantine_values, sample_weight
from services.stage_server.averaging import (
    DEADLINES,
    RETRY_SEP,
    AveragingRound,
    CopyOrder,
    PartMessage,
    ReducedPart,
    RoundConflict,
    RoundSpec,
    SourceUnavailable,
    Transport,
    _off_loop,
    backup_reducer,
    decode_values,
    parse_reduced,
    retry_round_id,
)
from services.stage_server.error_feedback import ErrorFeedback, Tag
from services.stage_server.runtime import Accumulated, apply_average, snapshot
from services.stage_server.state import load_stage_state
from services.stage_server.stepping import StepVerdict, settle_step, step_verdict
from shared.codec import encode_tensor, pack_message, unpack_message
from shared.errors import BadPayload, RemoteError, SwarmError

_START_WAIT_S = 5.0  # how long a result request waits for a round whose parts came before its start


class Averager:
    """A stage server's part in averaging: runs at most one round at a time and serves the
    reductions it owes. ``run_compute`` is the compute worker's ``run``; ``transport`` is set
    once the server has a client session."""

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
        self.round: AveragingRound | None = None  # the latest round started here
        self.last_round: AveragingRound | None = None  # the latest round that ended here
        self.rounds_completed = 0
        self.rounds_started = 0  # started - completed - running = failed (metrics)
        self.samples_at_last_round = 0
        self.bytes_sent = 0  # by the rounds that ended here, all kinds: parts posted and reductions served
        self.feedback = ErrorFeedback(self.num_params)  # this replica's residuals of compressed step rounds
        self._task: asyncio.Task | None = None
        self._close_handle: asyncio.TimerHandle | None = None
        self._early: tuple[str, dict[int, tuple[PartMessage, torch.Tensor]]] = (
            "",
            {},
        )  # parts that beat their round's start
        self._refused = ""  # the last round whose start this server refused (another stage)
        self._started = asyncio.Event()
        self._stepped = asyncio.Event()  # set and replaced after every step applied here
        self._closing = False
        self.resync: Callable[[], Awaitable[None]] | None = (
            None  # take a live replica's state (set once the server has a coordinator)
        )

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def status(self) -> dict:
        return {
            "step": self.runtime.step,
            "rounds_completed": self.rounds_completed,
            "bytes_sent": self.bytes_sent,
            "error_feedback_resets": self.feedback.resets,
            "running": self.round.spec.round_id if self.running else None,
            "last_round": self.last_round.summary() if self.last_round else None,
        }

    def start(self, spec: RoundSpec) -> None:
        """Start ``spec`` in the background; refused while a round runs (one at a time)."""
        if self._closing or self.transport is None:
            raise RoundConflict("this server is not taking averaging rounds (starting up or shutting down)")
        if self.running:
            raise RoundConflict(f"round {self.round.spec.round_id!r} is still running here; one round at a time")
        if spec.kind == "step" and spec.step != self.runtime.step:
            raise RoundConflict(
                f"round {spec.round_id!r} takes step {spec.step}, this replica is at step {self.runtime.step}"
            )
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
        self._task = asyncio.create_task(self._run(rnd), name=f"averaging-{spec.round_id}")
        self._wake_result_waiters()

    async def wait_step(self, step: int, timeout_s: float) -> None:
        """Until this replica has taken global step ``step`` (at most ``timeout_s``)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.runtime.step < step:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stepped.wait(), left)

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

    def accept_part(self, msg: PartMessage, values: torch.Tensor) -> None:
        rnd = self.round
        if rnd is not None and _of_round(msg.round_id, rnd.spec.round_id):
            rnd.accept(msg, values)
        elif self.running or self._closing:
            raise RoundConflict(
                f"busy with round {rnd.spec.round_id!r}, not {msg.round_id!r}" if self.running else "shutting down"
            )
        elif RETRY_SEP in msg.round_id or msg.round_id == self._refused:
            raise RoundConflict(f"round {msg.round_id.partition(RETRY_SEP)[0]!r} is unknown here")
        else:  # the part beat its round's start here: keep it (one round's worth) until the start comes
            early_id, early = self._early
            if early_id != msg.round_id:
                early_id, early = msg.round_id, {}
            if msg.sender in early:
                raise RoundConflict(f"member {msg.sender} already sent its part of round {msg.round_id!r}")
            if values.numel() + sum(v.numel() for _, v in early.values()) > self.num_params:
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
            raise RoundConflict(f"round {round_id.partition(RETRY_SEP)[0]!r} is unknown here")
        reducer, reduce_at = rnd.reducer(round_id, part)
        reduced = await reducer.reduced(reduce_at)
        rnd.bytes_sent += len(reduced.body)
        return reduced

    async def copy_state(self, order: CopyOrder, log) -> tuple[int, str]:
        """A drift repair: replace this replica's whole state (weights and optimizer) with
        that of ``order.source``, both at step ``order.step``; returns (step, digest) after.
        The gradients accumulated here stay (see :func:`load_copied_state`).
        :class:`RoundConflict` if this replica is not at that step (it moved on: the next
        check repairs it) or a params round runs here; :class:`SourceUnavailable` if the
        source's state could not be had."""
        if self._closing or self.transport is None:
            raise RoundConflict("this server is not taking repairs (starting up or shutting down)")
        if self.running and self.round.spec.kind != "step":
            raise RoundConflict(f"params round {self.round.spec.round_id!r} is running here")
        if self.runtime.step != order.step:
            raise RoundConflict(f"the repair is of step {order.step}, this replica is at step {self.runtime.step}")
        try:
            tensors, metadata = await self.transport.get_state(order.source, timeout_s=order.timeout_s)
        except RemoteError as exc:
            raise SourceUnavailable(f"no state from {order.source}: {exc}") from None
        step, digest = await self.run_compute(load_copied_state, self.runtime, tensors, metadata)
        log.warning("averaging.repair.loaded", source=order.source, step=step)
        return step, digest

    async def close(self) -> None:
        """Stop the running round (others leave this member out) and refuse new ones."""
        self._closing = True
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

    # -------------------------------------------------------------- the round itself
    async def _run(self, rnd: AveragingRound) -> None:
        spec, started = rnd.spec, time.perf_counter()
        log = self.log.bind(round_id=spec.round_id, index=spec.index, members=spec.k, kind=spec.kind)
        try:
            if spec.kind == "step":
                await self._step(rnd, log)
            else:
                await self._average(rnd, log)
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

    async def _reduce(self, rnd: AveragingRound, sent: torch.Tensor, weight: float, log) -> torch.Tensor:
        """This member's side of the butterfly: ``sent`` in, the reduced parts out (``rnd.parts``:
        None where a part failed, whose values stay ``sent``'s)."""
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

    def _as_sent(self, flat: torch.Tensor, log) -> torch.Tensor:
        if self.byzantine is None:
            return flat
        log.warning("averaging.byzantine", mode=self.byzantine[0], factor=self.byzantine[1])
        return byzantine_values(flat, *self.byzantine, seed=self.rounds_completed)

    async def _average(self, rnd: AveragingRound, log) -> None:
        """A params round: the members' weights averaged, what each learned meanwhile kept."""
        flat, samples = await self.run_compute(snapshot, self.runtime)
        averaged = await self._reduce(
            rnd, self._as_sent(flat, log), sample_weight(samples, self.samples_at_last_round), log
        )
        await self.run_compute(apply_average, self.runtime, flat, averaged)
        self.samples_at_last_round = samples
        self.rounds_completed += 1

    async def _local_step(self, rnd: AveragingRound, log) -> None:
        """A step round in ``local`` mode (``local_sync.py``): this member's own gradient of the
        step, alone; when an outer step is due, the members' outer gradients all-reduced
        (weighted by the samples each served since the last one) and the same outer step on
        every member. A member that missed a part, or holds one short of the round
        (:func:`step_verdict`), keeps its inner weights and its anchor (what it learned goes
        into its next outer gradient) and takes a live replica's state (``self.resync``), so
        that the anchors stay one."""
        taken = await self._unrefused(_take_and_inner_step, self.runtime, rnd.spec.step)
        rnd.samples = taken.samples
        self._stepped.set()
        self._stepped = asyncio.Event()
        outer = self.runtime.outer
        if not outer.due(self.runtime.step):
            self.rounds_completed += 1
            log.info("step.applied", step=self.runtime.step, local=True, samples_here=taken.samples)
            return
        delta = await self._unrefused(self.runtime.outer_gradient)
        mean = await self._reduce(rnd, self._as_sent(delta, log), float(outer.samples) or EPSILON_WEIGHT, log)
        rnd.verdict = step_verdict(rnd.parts, rnd.backups)
        if rnd.verdict is StepVerdict.APPLY:
            await self._unrefused(self.runtime.outer_step, mean)
            self.rounds_completed += 1
            log.info(
                "step.applied",
                step=self.runtime.step,
                local=True,
                samples_here=taken.samples,
                outer_step=outer.steps,
                outer_norm=round(float(mean.norm()), 6),
            )
            return
        log.warning(
            "outer.missed",
            step=self.runtime.step,
            verdict=rnd.verdict.value,
            parts_failed=[j for j, p in enumerate(rnd.parts) if p is None],
            resync=self.resync is not None,
        )
        if self.resync is not None:
            await self.resync()

    async def _step(self, rnd: AveragingRound, log) -> None:
        """A step round: the accumulated gradients all-reduced (weighted by samples), then the
        same optimizer step on every member where :func:`step_verdict` says so. A member that
        does not step gives its gradient back (if nobody stepped, nothing is lost; if the
        others stepped, the coordinator tells it to take their state, and its samples count
        as dropped). Whatever ends the round once the gradient is taken, it is applied or
        given back (see ``_settle``)."""
        if self.runtime.outer is not None:
            return await self._local_step(rnd, log)
        spec = rnd.spec
        taken, at = await self._take(spec.step, log)
        rnd.samples = taken.samples
        gradient, feedback = None, self._feedback(rnd)
        try:
            weight = float(taken.samples) or (
                1.0 if self.byzantine else 0.0
            )  # an attacker claims a weight even when it served nothing
            contribution = taken.mean
            if feedback is not None:  # what the codec lost last step goes in again (error_feedback.py)
                contribution = await _off_loop(self.num_params, feedback.contribution, taken.mean, weight, at)
                rnd.sent_lost = torch.zeros(self.num_params)
                rnd.main.feedback = feedback.for_part(*rnd.bounds[spec.index], at)
            mean = await self._reduce(rnd, self._as_sent(contribution, log), weight, log)
            rnd.verdict = step_verdict(rnd.parts, rnd.backups)
            if rnd.verdict is StepVerdict.APPLY:
                gradient = Accumulated(mean, int(min(p.weight for p in rnd.parts)), taken.microbatch_ids)
        finally:  # also on a failure or a cancel: the taken gradient is applied or goes back
            after = await self._settle(taken, spec.step, gradient, log)
        stepped = after is not None
        if stepped and feedback is not None:
            own = rnd.parts[spec.index]
            reduced = (rnd.bounds[spec.index][0], own.lost) if own is not None and own.lost is not None else None
            feedback.commit(rnd.sent_lost if weight > 0 else None, reduced, after)
        if stepped:
            self.rounds_completed += 1
            self._stepped.set()
            self._stepped = asyncio.Event()
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

    async def _unrefused(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A step round's job on the compute worker: never refused by the queue bound or a
        drain, and carried out even if the round is cancelled meanwhile."""
        return await asyncio.shield(asyncio.ensure_future(self.run_compute(fn, *args, bounded=False)))

    def _feedback(self, rnd: AveragingRound) -> ErrorFeedback | None:
        """This replica's error feedback in a step round that asks for it with a lossy codec
        (never for a fault-injected attacker, whose values are not its gradient)."""
        lossy = rnd.codec != "fp32"
        return self.feedback if rnd.spec.error_feedback and lossy and self.byzantine is None else None

    async def _take(self, step: int, log) -> tuple[Accumulated, Tag]:
        """The gradient accumulated for ``step`` and the runtime's (weights version, step) as it
        was taken; if the round is cancelled while it is being taken, it goes back to the
        bucket before the cancel goes on."""
        job = asyncio.ensure_future(self.run_compute(_take_tagged, self.runtime, step, bounded=False))
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
        body = await _off_loop(stop - start, _pack_part, msg, flat[start:stop], rnd.codec, self.int8_block, lost)
        try:
            try:
                await self.transport.post(url + "/average/part", body, timeout_s=_left(send_by))
            except RemoteError as exc:
                rnd.bytes_sent += 0 if exc.code == "unreachable" else len(body)  # unreachable: nothing went out
                raise
            rnd.bytes_sent += len(body)
            request = pack_message({"round_id": round_id, "part": part})
            reply = await self.transport.post(url + "/average/result", request, timeout_s=_left(fetch_by))
            return await _off_loop(stop - start, parse_reduced, reply, stop - start)
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


def load_copied_state(runtime, tensors: dict[str, torch.Tensor], metadata: dict) -> tuple[int, str]:
    """On the compute worker: load a peer's whole state (``load_stage_state``) at this
    replica's step, keeping the gradients accumulated here for this step and the next
    (the backwards that made them were reserved and counted; the state replaces what was
    learned, not what is being learned). Returns (step, digest) after.
    :class:`RoundConflict` if the state is of another step (nothing changed then)."""
    theirs = metadata.get("optimizer_steps")
    if theirs != runtime.step:
        raise RoundConflict(f"the source's state is of step {theirs}, this replica is at step {runtime.step}")
    held = [(k, runtime.take_gradients(k)) for k in (runtime.step, runtime.step + 1) if runtime.pending(k)]
    try:
        load_stage_state(runtime, tensors, metadata)
    finally:  # loaded or refused, what was taken goes back
        for k, taken in held:
            runtime.give_back(taken, k)
    return runtime.step, runtime.digest()


def _take_tagged(runtime, step: int) -> tuple[Accumulated, Tag]:
    """On the compute worker: the gradient of ``step`` and the (weights version, step) it goes onto."""
    return runtime.take_gradients(step), (runtime.version, runtime.step)


def _take_and_inner_step(runtime, step: int) -> Accumulated:
    """``local`` mode, on the compute worker: take the step's gradient and apply it alone, in one job."""
    taken = runtime.take_gradients(step)
    runtime.inner_step(taken)
    return taken


def _of_round(round_id: str, base: str) -> bool:
    return round_id == base or round_id.startswith(base + RETRY_SEP)


def _pack_part(msg: dict, values: torch.Tensor, codec: str, int8_block: int, lost: torch.Tensor | None) -> bytes:
    """The ``/average/part`` body of ``values``; ``lost`` (error feedback): set to what the codec lost of them."""
    body = pack_message({**msg, "data": encode_tensor(values, codec, int8_block=int8_block)})
    if lost is not None:
        lost.copy_(values - decode_values(unpack_message(body)["data"], values.numel()))
    return body


def _left(until: float) -> float:
    """Seconds left until loop time ``until``; never 0, which aiohttp reads as 'no timeout'."""
    return max(until - asyncio.get_running_loop().time(), 0.01)
