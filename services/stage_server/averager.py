"""Averager: one stage server's side of the averaging rounds (see ``averaging.py``).

Holds the round in progress and the parts that arrive for it, sends this member's parts,
serves the reductions it owns, fetches the others and loads the average, all bounded by
the round's deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from services.stage_server.averaging import (
    EPSILON_WEIGHT,
    FETCH_BY,
    REDUCE_AT,
    RETRY_FETCH_BY,
    RETRY_REDUCE_AT,
    RETRY_SEP,
    START_WAIT_S,
    AveragingRound,
    PartMessage,
    ReducedPart,
    RoundConflict,
    RoundSpec,
    Transport,
    _off_loop,
    apply_average,
    backup_reducer,
    byzantine_values,
    parse_reduced,
    retry_round_id,
    sample_weight,
    snapshot,
)
from services.stage_server.runtime import Accumulated
from shared.codec import encode_tensor, pack_message
from shared.errors import BadPayload, RemoteError, SwarmError


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
                await asyncio.wait_for(self._started.wait(), START_WAIT_S)
            rnd = self.round
        if rnd is None or not _of_round(round_id, rnd.spec.round_id):
            raise RoundConflict(f"round {round_id.partition(RETRY_SEP)[0]!r} is unknown here")
        reducer, reduce_at = rnd.reducer(round_id, part)
        reduced = await reducer.reduced(reduce_at)
        rnd.bytes_sent += len(reduced.body)
        return reduced

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
        except SwarmError as exc:  # e.g. the compute queue is full or the server is draining
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
        every member. A member that missed a part keeps its inner weights and its anchor
        (what it learned goes into its next outer gradient) and takes a live replica's state
        (``self.resync``), so that the anchors stay one."""
        taken = await self.run_compute(self.runtime.take_gradients, rnd.spec.step)
        await self.run_compute(self.runtime.inner_step, taken)
        rnd.samples = taken.samples
        self._stepped.set()
        self._stepped = asyncio.Event()
        outer = self.runtime.outer
        if not outer.due(self.runtime.step):
            self.rounds_completed += 1
            log.info("step.applied", step=self.runtime.step, local=True, samples_here=taken.samples)
            return
        delta = await self.run_compute(self.runtime.outer_gradient)
        mean = await self._reduce(rnd, self._as_sent(delta, log), float(outer.samples) or EPSILON_WEIGHT, log)
        if all(p is not None for p in rnd.parts):
            await self.run_compute(self.runtime.outer_step, mean)
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
            parts_failed=[j for j, p in enumerate(rnd.parts) if p is None],
            resync=self.resync is not None,
        )
        if self.resync is not None:
            await self.resync()

    async def _step(self, rnd: AveragingRound, log) -> None:
        """A step round: the accumulated gradients all-reduced (weighted by samples), then the
        same optimizer step on every member. A member that missed a part does not step; it
        gives its gradient back (if nobody stepped, nothing is lost; if the others stepped,
        the coordinator tells it to take their state, and its samples count as dropped)."""
        if self.runtime.outer is not None:
            return await self._local_step(rnd, log)
        taken = await self.run_compute(self.runtime.take_gradients, rnd.spec.step)
        weight = float(taken.samples) or (
            1.0 if self.byzantine else 0.0
        )  # an attacker claims a weight even when it served nothing
        mean = await self._reduce(rnd, self._as_sent(taken.mean, log), weight, log)
        if all(p is not None for p in rnd.parts):
            effective = int(min(p.weight for p in rnd.parts))
            await self.run_compute(self.runtime.apply_step, Accumulated(mean, effective, taken.microbatch_ids))
            self.rounds_completed += 1
            self._stepped.set()
            self._stepped = asyncio.Event()
            log.info("step.applied", step=self.runtime.step, effective_batch=effective, samples_here=taken.samples)
        else:
            await self.run_compute(self.runtime.give_back, taken, rnd.spec.step)
            log.warning(
                "step.missed",
                step=rnd.spec.step,
                samples_here=taken.samples,
                parts_failed=[j for j, p in enumerate(rnd.parts) if p is None],
            )

    async def _obtain(self, rnd: AveragingRound, flat: torch.Tensor, j: int, log) -> ReducedPart | None:
        """Reduced part ``j``: reduced here, fetched from member ``j``, or from a backup reducer; None: keep ours."""
        spec = rnd.spec
        try:
            if j == spec.index:
                reduced = await rnd.main.reduced(rnd.at(REDUCE_AT))
                rnd.set_main_contributors(reduced.contributors)
                return reduced
            reduced = await self._exchange(
                rnd, flat, spec.members[j], spec.round_id, j, rnd.at(REDUCE_AT), rnd.at(FETCH_BY), log
            )
            if reduced is not None:
                return reduced
            rnd.dead.add(j)
            backup = backup_reducer(j, spec.k, rnd.dead)
            log.info("averaging.part.retry", part=j, backup=backup)
            if backup == spec.index:
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
                    rnd.at(RETRY_REDUCE_AT),
                    rnd.at(RETRY_FETCH_BY),
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
        body = await _off_loop(stop - start, _pack_part, msg, flat[start:stop], spec.codec, self.int8_block)
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
            if exc.refused and url in spec.members:
                rnd.gone(spec.members.index(url))
            log.info(
                "averaging.member.failed",
                url=url,
                round_id=round_id,
                part=part,
                status=exc.status,
                code=exc.code,
                reason=exc.message,
                gone=exc.refused,
            )
        except BadPayload as exc:
            log.warning(
                "averaging.member.failed", url=url, round_id=round_id, part=part, code="bad_reply", reason=exc.message
            )
        return None


def _of_round(round_id: str, base: str) -> bool:
    return round_id == base or round_id.startswith(base + RETRY_SEP)


def _pack_part(msg: dict, values: torch.Tensor, codec: str, int8_block: int) -> bytes:
    return pack_message({**msg, "data": encode_tensor(values, codec, int8_block=int8_block)})


def _left(until: float) -> float:
    """Seconds left until loop time ``until``; never 0, which aiohttp reads as 'no timeout'."""
    return max(until - asyncio.get_running_loop().time(), 0.01)
