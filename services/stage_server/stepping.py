"""Global steps, stage-server side: which step a backward's gradient goes to, and when
this replica steps.

Every global step of a stage holds the run's global batch (``SWARM_GLOBAL_BATCH`` samples,
all replicas and trainers together). The coordinator counts (see its ``steps.py``):
before a backward, :meth:`StepClient.reserve` asks which step the microbatch's gradient
goes to; the runtime accumulates it in that step's bucket; :meth:`StepClient.done` says
what was accumulated (0 samples for a duplicate or a failed backward, which gives the
reservation back). Once a step's reservations are all accumulated, the coordinator starts
a ``step`` round among the stage's live replicas (``averaging.py``): they all-reduce that
step's buckets and apply the same optimizer step. Meanwhile backwards may fill the next
step's bucket, never one further: the coordinator holds such a reservation until the
stage steps.

Most ``done`` reports go in the background. The one of the reservation that completed a
step's global batch goes in the foreground and, if it started the round, the backward
answers the trainer only once this replica stepped: so a lone replica with one
microbatch in flight steps exactly where one process would.

A replica the coordinator finds behind its stage (it missed a round, or joined from an
older state) takes the state of a live replica (``resync``) and sends its backwards away
meanwhile (503); its accumulated samples are dropped and counted. A replica that cannot
reach the coordinator accumulates into its current step and reports it afterwards.

Without a coordinator there is no one to count: the server steps on its own as soon as it
alone holds the global batch (``StageRuntime(solo=True)``), as one replica of one stage.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from shared.errors import Overloaded, RemoteError


@dataclass(frozen=True)
class Reservation:
    """The step a backward's gradient goes to, as the coordinator gave it (``reserved`` 0:
    the coordinator could not be asked; the runtime's current step)."""

    bucket: int
    reserved: int
    closes: bool = False  # this reservation completed the step's global batch


class StepClient:
    """One replica's side of global steps. ``post(path, body) -> dict`` posts to the
    coordinator; ``resync()`` loads a live replica's state; ``wait_round(round_id,
    timeout_s)`` waits for a step round here to end; ``in_round()``: one runs now."""

    def __init__(self, runtime, *, post: Callable[[str, dict], Awaitable[dict]], resync: Callable[[], Awaitable[None]],
                 wait_round: Callable[[str, float], Awaitable[None]], identity: dict, round_wait_s: float, log, in_round: Callable[[], bool] = lambda: False):
        self.runtime, self.post, self.resync, self.wait_round, self.in_round = runtime, post, resync, wait_round, in_round
        self.identity, self.round_wait_s, self.log = identity, round_wait_s, log
        self._background: set[asyncio.Task] = set()
        self._resyncing: asyncio.Task | None = None
        self.failures = 0
        self.resyncs = 0

    async def reserve(self, samples: int, until_step: int | None = None) -> Reservation | None:
        """The step for a backward of ``samples``, or None when the trainer's ``until_step``
        steps are all reserved at this stage (the backward accumulates nothing);
        :class:`Overloaded` while this replica is behind its stage (it resyncs) or the stage
        is a whole step ahead (the trainer retries)."""
        if self._resyncing is not None and not self._resyncing.done():
            raise Overloaded("this replica is taking a live replica's state (it was behind its stage)", retry_after_s=1.0)
        for _ in range(2):  # again if this replica stepped while its reservation was on its way
            sent_at = self.runtime.step
            try:
                body = {**self.identity, "step": sent_at, "samples": samples, **({"until_step": until_step} if until_step is not None else {})}
                answer = await self.post("/step/reserve", body)
            except RemoteError as exc:
                if exc.status == 503:
                    raise Overloaded(f"the coordinator holds this stage's backwards: {exc.message}", retry_after_s=exc.retry_after_s or 1.0) from None
                self._failed(exc)
                return Reservation(self.runtime.step, 0)
            if not answer.get("resync") or self.runtime.step == sent_at:
                break
        if answer.get("resync") and isinstance(answer.get("step"), int) and self.runtime.step < answer["step"]:
            self._start_resync(answer["step"])
            raise Overloaded(f"this replica is at step {self.runtime.step}, its stage at {answer.get('step')}: it takes a live replica's state", retry_after_s=1.0)
        bucket = answer.get("bucket")
        if answer.get("complete"):
            return None
        if answer.get("resync"):  # it was behind when it asked, and has stepped since: ask again next time
            raise Overloaded("this replica stepped while it asked for a reservation", retry_after_s=0.1)
        if type(bucket) is not int:
            self._failed(RemoteError("/step/reserve", 200, "bad_reply", f"no bucket in {answer!r}"))
            return Reservation(self.runtime.step, 0)
        return Reservation(bucket, samples, bool(answer.get("closes")))

    async def done(self, reservation: Reservation, samples: int) -> None:
        """Say what the backward accumulated; in the foreground (waiting for the step round
        it starts) when its reservation completed the step, else in the background."""
        body = {**self.identity, "step": self.runtime.step, "bucket": reservation.bucket, "reserved": reservation.reserved, "samples": samples, "closes": reservation.closes}
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
        self.failures += 1
        if self.failures == 1 or self.failures % 100 == 0:
            self.log.warning("step.report.failed", error=str(exc), failures=self.failures)

    def _start_resync(self, stage_step) -> None:
        if (self._resyncing is not None and not self._resyncing.done()) or self.in_round():
            return  # a round running here ends with this replica in step, or told again
        self.log.warning("step.behind", step=self.runtime.step, stage_step=stage_step, dropping=self.runtime.pending_samples)
        self._resyncing = asyncio.create_task(self._resync(), name="step.resync")

    async def _resync(self) -> None:
        try:
            await self.resync()
            self.resyncs += 1
        except Exception as exc:  # noqa: BLE001 - a failed resync is tried again on the next reservation
            self.log.warning("step.resync.failed", error=repr(exc))

    async def close(self) -> None:
        for task in [*self._background, *([self._resyncing] if self._resyncing else [])]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
