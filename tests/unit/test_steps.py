"""The coordinator's step counting without HTTP: reservations fill each global step with
exactly the global batch, a step's round starts once its reservations are accumulated,
replicas behind their stage are told to resync, and each microbatch counts once per stage."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass

import pytest

from services.coordinator.steps import GlobalBatchMismatch, StepCounter, StepScheduler
from shared.errors import Draining
from shared.log import get_logger
from shared.step_protocol import DoneReport, ReserveAnswer, ReserveRequest, Verdict
from tests.conftest import VirtualClock as Clock

A, B = "http://a", "http://b"
G = 8  # global batch
_ids = itertools.count()


@dataclass(frozen=True)
class Ticket:
    """A reservation asked and its answer."""

    req: ReserveRequest
    answer: ReserveAnswer

    @property
    def bucket(self) -> int | None:
        return self.answer.bucket

    @property
    def closes(self) -> bool:
        return self.answer.verdict is Verdict.CLOSES

    @property
    def verdict(self) -> Verdict:
        return self.answer.verdict


class Counter(StepCounter):
    """The counter with the old positional call shape, each reservation of a new microbatch."""

    def ask(self, stage, url, step, samples, g, until_step=None, mb=None, **kw) -> Ticket:
        req = ReserveRequest(stage, url, step, samples, g, mb or f"mb{next(_ids)}", until_step)
        return Ticket(req, self.reserve(req, **kw))

    def tell(self, t: Ticket, samples: int, step: int | None = None) -> None:
        """The report of ``t``: ``samples`` of its reservation accumulated."""
        q = t.req
        self.done(
            DoneReport(
                q.stage,
                q.url,
                q.step if step is None else step,
                t.bucket,
                q.samples,
                samples,
                q.global_batch,
                q.microbatch_id,
            )
        )


def counter(timeout_s: float = 10.0, stages: int = 2, lease_s: float = 0.0) -> tuple[Counter, Clock]:
    clock = Clock()
    return Counter(stages, timeout_s=timeout_s, lease_s=lease_s, clock=clock), clock


def scheduler_without_replicas(timeout_s: float = 30.0) -> StepScheduler:
    """A scheduler of 2 stages with no live replica: no round can start, so what waits for one waits."""
    return StepScheduler(
        2, lambda: [], codec="fp32", timeout_s=timeout_s, aggregator="mean", log=get_logger(service="test")
    )


def ask(stage, url, step, samples, g, until_step=None, mb=None) -> ReserveRequest:
    return ReserveRequest(stage, url, step, samples, g, mb or f"mb{next(_ids)}", until_step)


def test_reservations_fill_a_step_with_exactly_the_global_batch_then_the_next():
    c, _ = counter()
    got = [c.ask(0, url, 0, 4, G) for url in (A, B, A)]
    assert [(t.bucket, t.closes) for t in got] == [(0, False), (0, True), (1, False)]
    assert [t.verdict for t in got] == [Verdict.RESERVED, Verdict.CLOSES, Verdict.RESERVED]
    assert not c.ready(0)  # reserved, not accumulated yet
    c.tell(got[0], 4)
    assert not c.ready(0)
    c.tell(got[1], 4)
    assert c.ready(0)  # step 0 holds its 8 samples, all accumulated
    assert not c.ready(1)  # stages count on their own


def test_the_round_running_takes_its_step_and_reservations_go_one_step_ahead_at_most():
    c, _ = counter()
    for url in (A, B):
        c.tell(c.ask(0, url, 0, 4, G), 4)
    c.round_started(0, "r0")
    assert c.ask(0, A, 0, 4, G).bucket == 1
    assert c.ask(0, B, 0, 4, G).closes
    held = c.ask(0, A, 0, 4, G)
    assert held.bucket is None and held.verdict is Verdict.WAIT  # step 1 is full and step 0 steps now: wait
    effective, dropped = c.round_ended(0, {A: 1, B: 1}, {A: 4, B: 4})
    assert (effective, dropped) == (8, 0) and c.stages[0].step == 1
    assert c.ask(0, A, 1, 4, G).bucket == 2


def test_the_stage_moves_with_its_rounds_first_member_and_counts_the_step_when_the_last_ended():
    """A weak replica applies a step round's gradient long after its strong peer (a fifteenth
    of a core: 0.6 s in the heterogeneous arena), and the swarm's next step waited for it. The
    stage now moves when the first member stepped; its next round waits until all ended."""
    c, _ = counter()
    for url in (A, B):
        c.tell(c.ask(0, url, 0, 4, G), 4)
    c.round_started(0, "r0")
    assert not c.member_stepped(0, "r0", B, 0, [A, B])  # B ended without stepping: nothing moves
    assert c.member_stepped(0, "r0", A, 1, [A, B])
    st = c.stages[0]
    assert st.step == 1 and st.round_id is None and st.finishing is not None
    assert not c.member_stepped(0, "r0", A, 1, [A, B])  # told twice: moved once
    # B, still applying at step 0, is not told to resync: its reservations go into step 1 (the stage's)
    t = c.ask(0, B, 0, 4, G)
    assert t.verdict is Verdict.RESERVED and t.bucket == 1
    c.tell(t, 4)
    c.tell(c.ask(0, A, 1, 4, G), 4)
    assert not c.ready(0)  # step 1 is full, but the round of step 0 has not ended on B
    assert c.round_ended(0, {A: 1, B: 1}, {A: 4, B: 4}) == (8, 0)
    assert st.finishing is None and st.step == 1 and st.last_effective_batch == 8
    assert c.ready(0) and c.members(0, [A, B]) == [A, B]


def test_a_member_that_failed_after_the_stage_moved_loses_its_samples_and_resyncs():
    c, _ = counter()
    for url in (A, B):
        c.tell(c.ask(0, url, 0, 4, G), 4)
    c.round_started(0, "r0")
    assert c.member_stepped(0, "r0", A, 1, [A, B])
    assert c.round_ended(0, {A: 1, B: 0}, {A: 4, B: 4}) == (4, 4)  # B missed a part: its 4 samples are dropped
    assert c.stages[0].samples_dropped == 4
    assert c.ask(0, B, 0, 4, G).verdict is Verdict.RESYNC  # no longer applying: behind, it takes A's state
    # and a replica that was not in the round is behind as before
    c2, _ = counter()
    c2.tell(c2.ask(0, A, 0, 8, G), 8)
    c2.round_started(0, "r0")
    assert c2.member_stepped(0, "r0", A, 1, [A])
    assert c2.ask(0, B, 0, 4, G).verdict is Verdict.RESYNC


def test_a_stale_round_id_moves_nothing():
    c, _ = counter()
    c.tell(c.ask(0, A, 0, 8, G), 8)
    c.round_started(0, "r1")
    assert not c.member_stepped(0, "r0", A, 1, [A])  # a status of an older round
    assert c.stages[0].step == 0 and c.stages[0].round_id == "r1"


def test_a_reservation_given_back_opens_its_step_again():
    c, _ = counter()
    first, second = c.ask(0, A, 0, 4, G), c.ask(0, B, 0, 4, G)
    assert second.closes
    c.tell(second, 0)  # B's backward failed: 0 accumulated
    again = c.ask(0, A, 0, 4, G)
    assert again.bucket == 0 and again.closes
    c.tell(first, 4)
    c.tell(again, 4)
    assert c.ready(0)


def test_a_reservation_out_past_the_timeout_is_given_up():
    c, clock = counter(timeout_s=5.0)
    a, b = c.ask(0, A, 0, 4, G), c.ask(0, B, 0, 4, G)
    c.tell(a, 4)  # B died with its reservation
    clock.now = 4.9
    assert not c.ready(0)
    clock.now = 5.0
    assert c.ready(0)
    c.round_started(0, "r0")
    effective, dropped = c.round_ended(0, {A: 1}, {A: 4})
    assert effective == 4 and c.stages[0].step == 1
    c.tell(b, 4)  # too late: its step was taken without it
    assert c.stages[0].samples_dropped == 4


def test_members_that_did_not_step_lose_their_samples_and_are_left_out_of_the_next_round():
    c, _ = counter()
    for url in (A, B):
        c.tell(c.ask(0, url, 0, 4, G), 4)
    c.round_started(0, "r0")
    effective, dropped = c.round_ended(0, {A: 1, B: 0}, {A: 4, B: 4})
    assert (effective, dropped) == (4, 4)
    assert c.members(0, [A, B]) == [A]
    assert c.ask(0, B, 0, 4, G).verdict is Verdict.RESYNC  # B is behind its stage: it takes A's state
    assert c.ask(0, B, 1, 4, G).bucket == 1  # ... and is in step again
    assert c.members(0, [A, B]) == [A, B]


def test_a_replica_behind_by_its_registration_or_silent_is_left_out_of_its_rounds():
    """A server that moved here took a peer's state at step s, and registered after the stage
    reached s + 1: named in that round, it would refuse, and the others would wait for its
    parts until the deadline (measured: 8 s of a stalled swarm)."""
    c, _ = counter()
    c.tell(c.ask(0, A, 0, 8, G), 8)
    assert c.members(0, [A, B]) == [A]  # B is live in the registry and has said nothing
    assert c.members(0, [A, B], reported={B: 0}) == [A, B]  # its registration said step 0: it takes part, with nothing
    c.round_started(0, "r0")
    c.round_ended(0, {A: 1}, {A: 8})
    assert c.members(0, [A, B], reported={B: 0}) == [A]  # registered at step 0, the stage is at 1
    assert c.ask(0, B, 0, 4, G).verdict is Verdict.RESYNC  # B's first reservation: it is behind, it resyncs
    assert c.members(0, [A, B]) == [A]
    assert c.ask(0, B, 1, 4, G).bucket == 1
    assert c.members(0, [A, B]) == [A, B]


def test_a_round_nobody_completed_is_tried_again_later_with_nothing_lost():
    c, clock = counter()
    for url in (A, B):
        c.tell(c.ask(0, url, 0, 4, G), 4)
    c.round_started(0, "r0")
    assert c.round_ended(0, {A: 0, B: 0}, {A: 4, B: 4}) == (0, 0)
    assert c.stages[0].step == 0 and not c.ready(0)
    clock.now += 1.0
    assert c.ready(0)


def test_the_last_step_of_a_run_and_the_replicas_after_a_coordinator_restart():
    c, _ = counter()
    closing = c.ask(0, A, 0, 8, G, until_step=1)
    assert closing.closes
    held = c.ask(0, A, 0, 8, G, until_step=1)
    assert held.verdict is Verdict.WAIT  # step 0's reservation is still out: wait
    c.tell(closing, 8)
    assert c.ask(0, A, 0, 8, G, until_step=1).verdict is Verdict.COMPLETE  # step 1 is past the run's end
    fresh, _ = counter()  # a restarted coordinator learns the step from the replicas
    assert fresh.ask(1, A, 7, 4, G).bucket == 7 and fresh.stages[1].step == 7


def test_a_run_s_last_step_given_back_is_filled_again_not_left_short():
    """Found in CI: the reservation that closed a run's last step was a duplicate backward (a
    re-run microbatch) and gave its samples back after another backward had been told the run
    was complete; the stage never took its last step. Now that backward waits and fills it."""
    c, _ = counter()
    first = c.ask(0, A, 0, 4, G, until_step=1)
    duplicate = c.ask(0, B, 0, 4, G, until_step=1)
    assert duplicate.closes
    c.tell(first, 4)
    waiting = c.ask(0, A, 0, 4, G, until_step=1)
    assert waiting.verdict is Verdict.WAIT
    c.tell(duplicate, 0)  # already accumulated: 0 samples, the reservation goes back
    assert not c.ready(0)
    again = c.ask(0, A, 0, 4, G, until_step=1)
    assert again.bucket == 0 and again.closes
    c.tell(again, 4)
    assert c.ready(0) and c.stages[0].done[0] == G


def test_replicas_must_agree_on_the_global_batch():
    c, _ = counter()
    c.ask(0, A, 0, 4, G)
    with pytest.raises(GlobalBatchMismatch, match="SWARM_GLOBAL_BATCH"):
        c.ask(0, B, 0, 4, G * 2)


def test_what_a_replica_gone_from_the_registry_held_is_given_up_at_once():
    c, _ = counter(timeout_s=60.0)
    a, _ = c.ask(0, A, 0, 4, G), c.ask(0, B, 0, 4, G)
    c.tell(a, 4)
    assert not c.ready(0, [A, B])  # B may still report
    assert c.ready(0, [A])  # B's lease ran out: no need to wait for the timeout


def test_a_step_whose_every_reservation_was_lost_is_filled_again_not_taken_empty():
    c, clock = counter(timeout_s=5.0)
    c.ask(0, A, 0, 8, G)  # A dies with the whole step reserved
    clock.now = 6.0
    assert not c.ready(0, [B])  # no round of zero samples: a step of zero gradient would still move AdamW
    again = c.ask(0, B, 0, 8, G)
    assert (again.bucket, again.closes) == (0, True)


async def test_a_reservation_given_back_wakes_the_held_ones_and_its_report_does_not_wait():
    """A backward that turns out a duplicate gives its reservation back. Backwards held
    because both open steps were full must get the freed place at once (not after the
    scheduler's timeout: the swarm stalled that long), and the duplicate's report, which
    had closed its step, no longer waits for a round that its step cannot start."""
    scheduler = scheduler_without_replicas()
    asked = [ask(0, A, 0, 4, G) for _ in range(4)]
    first = [await scheduler.reserve(req) for req in asked]  # steps 0 and 1, full
    assert [(r["bucket"], r["verdict"]) for r in first] == [
        (0, "reserved"),
        (0, "closes"),
        (1, "reserved"),
        (1, "closes"),
    ]
    held = asyncio.create_task(scheduler.reserve(ask(0, B, 0, 4, G)))
    await asyncio.sleep(0)  # let it reach its wait (a yield, not a timed wait)
    assert not held.done()
    closing = DoneReport(0, A, 0, 0, 4, 0, G, asked[1].microbatch_id, closes=True)
    report = await asyncio.wait_for(scheduler.done(closing), 5.0)  # the closing one: its backward failed
    assert report["step"] == 0
    woken = await asyncio.wait_for(held, 5.0)  # far below the scheduler's 30 s
    assert (woken["bucket"], woken["verdict"]) == (0, "closes")


async def test_a_stopping_coordinator_answers_the_waiting_reservations_and_reports_at_once():
    """Seen in the rebalancing e2e test's teardown: a coordinator sent SIGTERM mid-training
    logged nothing more and had not exited 10 s later, as aiohttp waits for the handlers in
    flight and a reservation held for a step waits up to the scheduler's timeout (20 s by
    default). ``close()`` (the coordinator's on_shutdown) answers a held reservation 503
    (draining) and lets a closing report return, at once."""
    scheduler = scheduler_without_replicas()
    asked = [ask(0, A, 0, 4, G) for _ in range(4)]
    first = [await scheduler.reserve(req) for req in asked]  # steps 0 and 1, full
    assert first[1]["verdict"] == "closes"
    held = asyncio.create_task(scheduler.reserve(ask(0, B, 0, 4, G)))
    await asyncio.sleep(0)  # let it reach its wait (a yield, not a timed wait)
    # the closing report of step 0 waits for a round no member can start (no live replica)
    report = asyncio.create_task(scheduler.done(DoneReport(0, A, 0, 0, 4, 4, G, asked[1].microbatch_id, closes=True)))
    await asyncio.sleep(0)
    assert not held.done() and not report.done()
    await scheduler.close()
    with pytest.raises(Draining) as err:
        await asyncio.wait_for(held, 5.0)  # far below the scheduler's 30 s
    assert err.value.status == 503
    assert (await asyncio.wait_for(report, 5.0))["step"] == 0


def test_a_replica_behind_a_step_nobody_holds_any_more_catches_up_and_the_count_stays():
    """Measured in the arena's churn: the only replicas of a stage at its step were killed, one
    came back from an older checkpoint and asked forever for a state that was gone (training
    stalled). Now it takes the stage's step number with its own weights (the updates in
    between are lost, and said so), and every stage keeps counting the run's steps."""
    c, clock = counter(lease_s=3.0)
    for k in range(2):  # A trains the stage to step 2
        c.tell(c.ask(0, A, k, 8, G), 8)
        c.round_started(0, f"r{k}")
        c.round_ended(0, {A: k + 1}, {A: 8})
    assert c.stages[0].step == 2
    # B rejoined from a checkpoint of step 1: A is alive, B takes its state
    assert c.ask(0, B, 1, 4, G, live=[A, B]).verdict is Verdict.RESYNC
    # A left the registry, but reported within the lease: maybe only slow
    assert c.ask(0, B, 1, 4, G, live=[B]).verdict is Verdict.RESYNC
    clock.now += 3.5
    r = c.ask(0, B, 1, 4, G, live=[B])  # A is gone: nobody holds step 2 any more
    assert r.verdict is Verdict.CATCH_UP and r.bucket is None and r.answer.as_json()["verdict"] == "catch_up"
    assert r.answer.step == 2
    assert c.stages[0].step == 2 and c.stages[0].steps_lost == [(1, 2)] and c.view()[0]["steps_lost"] == [(1, 2)]
    assert c.view()[0]["steps_lost_total"] == 1
    r = c.ask(0, B, 2, 8, G, live=[B])  # B took step 2's number: it fills step 2 and the stage steps on
    assert r.bucket == 2 and r.closes
    c.tell(r, 8)
    assert c.ready(0, [B])
    assert c.ask(1, A, 0, 4, G, live=[]).bucket == 0  # another stage is not touched
    c.ask(1, A, 1, 4, G, live=[A])  # A said it is at step 1 of stage 1 (the stage moves with it)
    # a report of A's sent before that step: A holds the step, no catch-up
    assert c.ask(1, A, 0, 4, G, live=[A]).verdict is Verdict.RESYNC
    c.registered(1, A, 0)  # A restarted (same URL) from a checkpoint of step 0: its old step is void
    # measured in the arena: both replicas of a stage back at step 2 of 15
    assert c.ask(1, A, 0, 4, G, live=[A]).verdict is Verdict.CATCH_UP


def test_a_step_whose_every_sample_died_with_its_replicas_fills_again():
    """Found by bench.recovery: a stage's only server accumulated a whole step and died; the
    server recovered in its place held none of it, so every step round found nothing ("empty"),
    nobody stepped, and the round was tried again every second forever (the trainer timed out).
    Now a round that no member stepped, whose step's samples were all accumulated by replicas
    that are not members any more, drops them and fills the step again."""
    c, clock = counter(lease_s=3.0)
    t = c.ask(0, A, 0, 8, G, live=[A])
    c.tell(t, 8)  # A accumulated the whole step 0 ...
    assert c.ready(0, live=[A])
    clock.now += 10  # ... and died; B is the stage's server now
    c.registered(0, B, 0)
    assert c.members(0, [B]) == [B]
    assert c.round_ended(0, {B: 0}, {}) == (0, 8)  # nothing stepped: A's 8 samples are gone
    st = c.stages[0]
    assert st.samples_dropped == 8 and st.reserved.get(0) == 0 and t.req.microbatch_id not in st.held
    again = c.ask(0, B, 0, 8, G, live=[B], mb=t.req.microbatch_id)  # the lost microbatch counts when run again
    assert again.verdict is Verdict.CLOSES and again.bucket == 0
    # a round some member of which accumulated the step is only tried again (it gave its gradient back)
    c.tell(again, 8)
    assert c.round_ended(0, {B: 0}, {}) == (0, 0) and c.stages[0].done[0] == 8
