"""The trainer's side of admission: ask the coordinator which global step a microbatch is
for before starting it (``POST /step/admit``; the rules are the coordinator's
``admission.py``), and give the admission back when the microbatch failed for good.
While the trainer runs, :meth:`AdmissionClient.keep_alive` renews the admissions of its
microbatches in flight every quarter of the coordinator's lease (``POST /step/renew``), so
that a microbatch slower than the lease keeps its place in its step; one that completed
(:meth:`AdmissionClient.finished`) or failed is renewed no more, and a trainer that died
renews nothing: their places go to others after the lease.

While the window is full the coordinator holds the ask and answers 503 with Retry-After at
its step timeout; the ask is repeated until ``wait_s`` has passed without an answer, then
the microbatch starts unadmitted (its step is whatever the stages reserve for it), so that a
stuck coordinator cannot stall training forever. A coordinator that does not answer at all
(killed, restarting: asked again after ``AWAY_S``), or does not know admission (an older
one), at once: training goes on, as without a coordinator.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from shared.errors import RemoteError
from shared.http import post_json

ASK_TIMEOUT_MARGIN_S = 10.0  # beyond the coordinator's own hold of an ask
MIN_RETRY_S = 0.05
AWAY_S = 1.0  # after the coordinator did not answer, microbatches start unadmitted this long without asking
RENEWALS_PER_LEASE = 4  # keep_alive renews this many times within the coordinator's lease
DEFAULT_LEASE_S = 20.0  # the coordinator's lease until it said its own (its SWARM_STEP_TIMEOUT_S default)


@dataclass(frozen=True)
class Admitted:
    step: int | None  # the global step the microbatch is for; None: unadmitted (the coordinator away)
    complete: bool = False  # every step this trainer trains for is admitted: start no more microbatches


class AdmissionClient:
    def __init__(self, session, coordinator: str, *, run_id: str, until_step: int, wait_s: float, log=None):
        self.session, self.url, self.run_id = session, coordinator.rstrip("/"), run_id
        self.until_step, self.wait_s, self.log = until_step, wait_s, log
        self.supported = True  # False once the coordinator said it has no admission (404)
        self.unadmitted = 0  # microbatches started without an admission
        self._away_until = 0.0  # the coordinator did not answer: until then, microbatches start unadmitted
        self.lease_s = DEFAULT_LEASE_S  # how long the coordinator keeps an admission that is not renewed
        self.renewing = True  # False once the coordinator said it has no renewals (404: an older one)
        self.renewals = 0  # renewals the coordinator answered
        self.in_flight: set[str] = set()  # admitted microbatches not finished yet: renewed

    async def admit(self, microbatch_id: str, samples: int) -> Admitted:
        body = {
            "run_id": self.run_id,
            "microbatch_id": microbatch_id,
            "samples": samples,
            "until_step": self.until_step,
        }
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        while self.supported and loop.time() >= self._away_until:
            try:
                answer = await post_json(
                    self.session, self.url + "/step/admit", body, timeout_s=self.wait_s + ASK_TIMEOUT_MARGIN_S
                )
            except RemoteError as exc:
                if exc.status == 404:
                    self.supported = False
                    break
                if exc.status is None:  # unreachable: not asked again for a while
                    self._away_until = loop.time() + AWAY_S
                if exc.status != 503 or loop.time() >= deadline:
                    self._unadmitted(microbatch_id, exc)
                    return Admitted(None)
                await asyncio.sleep(max(MIN_RETRY_S, min(exc.retry_after_s or 1.0, deadline - loop.time())))
                continue
            if answer.get("verdict") == "complete":
                return Admitted(None, complete=True)
            self._note_lease(answer)
            step = answer.get("step")
            if answer.get("verdict") == "admitted" and (step is None or type(step) is int):
                if step is not None:
                    self.in_flight.add(microbatch_id)
                return Admitted(step)
            self._unadmitted(microbatch_id, RemoteError(self.url, 200, "bad_reply", f"no step in {answer!r}"))
            return Admitted(None)
        self.unadmitted += 1
        return Admitted(None)

    def finished(self, microbatch_id: str) -> None:
        """The microbatch completed: its admission is renewed no more."""
        self.in_flight.discard(microbatch_id)

    async def renew(self) -> int | None:
        """Renew the admissions of the microbatches in flight: how many the coordinator renewed,
        or None without an answer (or with nothing in flight)."""
        if not (self.supported and self.renewing and self.in_flight):
            return None
        try:
            answer = await post_json(
                self.session,
                self.url + "/step/renew",
                {"run_id": self.run_id, "microbatch_ids": sorted(self.in_flight)},
                timeout_s=ASK_TIMEOUT_MARGIN_S,
            )
        except RemoteError as exc:  # the next renewal may get through within the lease
            if exc.status == 404:  # an older coordinator: admissions without renewals
                self.renewing = False
            if self.log:
                self.log.warning("admission.renew.failed", microbatches=len(self.in_flight), error=str(exc))
            return None
        self._note_lease(answer)
        self.renewals += 1
        renewed = answer.get("renewed")
        return renewed if type(renewed) is int else None

    async def keep_alive(self) -> None:
        """Renew the admissions in flight every quarter of the lease, until cancelled."""
        while self.supported and self.renewing:
            await asyncio.sleep(self.lease_s / RENEWALS_PER_LEASE)
            await self.renew()

    def _note_lease(self, answer: dict) -> None:
        lease = answer.get("lease_s")
        if type(lease) in (int, float) and 0 < lease < 10**6:
            self.lease_s = float(lease)

    async def release(self, microbatch_id: str) -> None:
        """The microbatch failed for good: its place in its step goes to another."""
        self.in_flight.discard(microbatch_id)
        if not self.supported:
            return
        try:
            await post_json(
                self.session,
                self.url + "/step/release",
                {"run_id": self.run_id, "microbatch_id": microbatch_id},
                timeout_s=ASK_TIMEOUT_MARGIN_S,
            )
        except RemoteError as exc:  # the admission then expires at the coordinator (its lease)
            if self.log:
                self.log.warning("admission.release.failed", microbatch=microbatch_id, error=str(exc))

    def _unadmitted(self, microbatch_id: str, exc: RemoteError) -> None:
        self.unadmitted += 1
        if self.log and (self.unadmitted == 1 or self.unadmitted % 100 == 0):
            self.log.warning("admission.failed", microbatch=microbatch_id, error=str(exc), unadmitted=self.unadmitted)
