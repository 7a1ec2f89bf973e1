"""The coordinator's step counting without HTTP: reservations fill each global step with
exactly the global batch, a step's round starts once its reservations are accumulated,
and replicas behind their stage are told to resync."""

from __future__ import annotations

import asyncio

import pytest

from services.coordinator.steps import GlobalBatchMismatch, StepCounter, StepScheduler
from shared.errors import Draining
from shared.log import get_logger

A, B = "http://a", "http://b"
G = 8  # global batch


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def counter(timeout_s: float = 10.0) -> tuple[StepCounter, Clock]:
    clock = Clock()
    return StepCounter(2, timeout_s=timeout_s, clock=clock), clock


def scheduler_without_replicas(timeout_s: float = 30.0) -> StepScheduler:
    """A scheduler of 2 stages with no live replica: no round can start, so what waits for one waits."""
    return StepScheduler(
        2, lambda: [], codec="fp32", timeout_s=timeout_s, aggregator="mean", log=get_logger(service="test")
    )


def test_reservations_fill_a_step_with_exactly_the_global_batch_then_the_next():
    c, _ = counter()
    got = [c.reserve(0, url, 0, 4, G) for url in (A, B, A)]
    assert [(r.bucket, r.closes) for r in got] == [(0, False), (0, True), (1, False)]
    assert not c.ready(0)  # reserved, not accumulated yet
    c.done(0, A, 0, 0, 4, 4, G)
    assert not c.ready(0)
    c.done(0, B, 0, 0, 4, 4, G)
    assert c.ready(0)  # step 0 holds its 8 samples, all accumulated
    assert not c.ready(1)  # stages count on their own


def test_the_round_running_takes_its_step_and_reservations_go_one_step_ahead_at_most():
    c, _ = counter()
    for url in (A, B):
        c.done(0, url, 0, c.reserve(0, url, 0, 4, G).bucket, 4, 4, G)
    c.round_started(0, "r0")
    assert c.reserve(0, A, 0, 4, G).bucket == 1
    assert c.reserve(0, B, 0, 4, G).closes
    held = c.reserve(0, A, 0, 4, G)
    assert held.bucket is None and not held.resync  # step 1 is full and step 0 steps now: wait
    effective, dropped = c.round_ended(0, {A: 1, B: 1}, {A: 4, B: 4})
    assert (effective, dropped) == (8, 0) and c.stages[0].step == 1
    assert c.reserve(0, A, 1, 4, G).bucket == 2


def test_a_reservation_given_back_opens_its_step_again():
    c, _ = counter()
    first, second = c.reserve(0, A, 0, 4, G), c.reserve(0, B, 0, 4, G)
    assert second.closes
    c.done(0, B, 0, second.bucket, 4, 0, G)  # B's backward failed: 0 accumulated
    again = c.reserve(0, A, 0, 4, G)
    assert again.bucket == 0 and again.closes
    c.done(0, A, 0, first.bucket, 4, 4, G)
    c.done(0, A, 0, again.bucket, 4, 4, G)
    assert c.ready(0)


def test_a_reservation_out_past_the_timeout_is_given_up():
    c, clock = counter(timeout_s=5.0)
    a, b = c.reserve(0, A, 0, 4, G), c.reserve(0, B, 0, 4, G)
    c.done(0, A, 0, a.bucket, 4, 4, G)  # B died with its reservation
    clock.now = 4.9
    assert not c.ready(0)
    clock.now = 5.0
    assert c.ready(0)
    c.round_started(0, "r0")
    effective, dropped = c.round_ended(0, {A: 1}, {A: 4})
    assert effective == 4 and c.stages[0].step == 1
    c.done(0, B, 0, b.bucket, 4, 4, G)  # too late: its step was taken without it
    assert c.stages[0].samples_dropped == 4


def test_members_that_did_not_step_lose_their_samples_and_are_left_out_of_the_next_round():
    c, _ = counter()
    for url in (A, B):
        c.done(0, url, 0, c.reserve(0, url, 0, 4, G).bucket, 4, 4, G)
    c.round_started(0, "r0")
    effective, dropped = c.round_ended(0, {A: 1, B: 0}, {A: 4, B: 4})
    assert (effective, dropped) == (4, 4)
    assert c.members(0, [A, B]) == [A]
    assert c.reserve(0, B, 0, 4, G).resync  # B is behind its stage: it takes A's state
    assert c.reserve(0, B, 1, 4, G).bucket == 1  # ... and is in step again
    assert c.members(0, [A, B]) == [A, B]


def test_a_replica_behind_by_its_registration_or_silent_is_left_out_of_its_rounds():
    """A server that moved here took a peer's state at step s, and registered after the stage
    reached s + 1: named in that round, it would refuse, and the others would wait for its
    parts until the deadline (measured: 8 s of a stalled swarm)."""
    c, _ = counter()
    c.done(0, A, 0, c.reserve(0, A, 0, 8, G).bucket, 8, 8, G)
    assert c.members(0, [A, B]) == [A]  # B is live in the registry and has said nothing
    assert c.members(0, [A, B], reported={B: 0}) == [A, B]  # its registration said step 0: it takes part, with nothing
    c.round_started(0, "r0")
    c.round_ended(0, {A: 1}, {A: 8})
    assert c.members(0, [A, B], reported={B: 0}) == [A]  # registered at step 0, the stage is at 1
    assert c.reserve(0, B, 0, 4, G).resync  # B's first reservation: it is behind, it resyncs
    assert c.members(0, [A, B]) == [A]
    assert c.reserve(0, B, 1, 4, G).bucket == 1
    assert c.members(0, [A, B]) == [A, B]


def test_a_round_nobody_completed_is_tried_again_later_with_nothing_lost():
    c, clock = counter()
    for url in (A, B):
        c.done(0, url, 0, c.reserve(0, url, 0, 4, G).bucket, 4, 4, G)
    c.round_started(0, "r0")
    assert c.round_ended(0, {A: 0, B: 0}, {A: 4, B: 4}) == (0, 0)
    assert c.stages[0].step == 0 and not c.ready(0)
    clock.now += 1.0
    assert c.ready(0)


def test_the_last_step_of_a_run_and_the_replicas_after_a_coordinator_restart():
    c, _ = counter()
    closing = c.reserve(0, A, 0, 8, G, until_step=1)
    assert closing.closes
    held = c.reserve(0, A, 0, 8, G, until_step=1)
    assert held.bucket is None and not held.complete  # step 0's reservation is still out: wait
    c.done(0, A, 0, closing.bucket, 8, 8, G)
    assert c.reserve(0, A, 0, 8, G, until_step=1).complete  # step 1 is past the run's end
    fresh, _ = counter()  # a restarted coordinator learns the step from the replicas
    assert fresh.reserve(1, A, 7, 4, G).bucket == 7 and fresh.stages[1].step == 7


def test_a_run_s_last_step_given_back_is_filled_again_not_left_short():
    """Found in CI: the reservation that closed a run's last step was a duplicate backward (a
    re-run microbatch) and gave its samples back after another backward had been told the run
    was complete; the stage never took its last step. Now that backward waits and fills it."""
    c, _ = counter()
    first = c.reserve(0, A, 0, 4, G, until_step=1)
    duplicate = c.reserve(0, B, 0, 4, G, until_step=1)
    assert duplicate.closes
    c.done(0, A, 0, first.bucket, 4, 4, G)
    waiting = c.reserve(0, A, 0, 4, G, until_step=1)
    assert waiting.bucket is None and not waiting.complete
    c.done(0, B, 0, duplicate.bucket, 4, 0, G)  # already accumulated: 0 samples, the reservation goes back
    assert not c.ready(0)
    again = c.reserve(0, A, 0, 4, G, until_step=1)
    assert again.bucket == 0 and again.closes
    c.done(0, A, 0, again.bucket, 4, 4, G)
    assert c.ready(0) and c.stages[0].done[0] == G


def test_replicas_must_agree_on_the_global_batch():
    c, _ = counter()
    c.reserve(0, A, 0, 4, G)
    with pytest.raises(GlobalBatchMismatch, match="SWARM_GLOBAL_BATCH"):
        c.reserve(0, B, 0, 4, G * 2)


def test_what_a_replica_gone_from_the_registry_held_is_given_up_at_once():
    c, _ = counter(timeout_s=60.0)
    a, _ = c.reserve(0, A, 0, 4, G), c.reserve(0, B, 0, 4, G)
    c.done(0, A, 0, a.bucket, 4, 4, G)
    assert not c.ready(0, [A, B])  # B may still report
    assert c.ready(0, [A])  # B's lease ran out: no need to wait for the timeout


def test_a_step_whose_every_reservation_was_lost_is_filled_again_not_taken_empty():
    c, clock = counter(timeout_s=5.0)
    c.reserve(0, A, 0, 8, G)  # A dies with the whole step reserved
    clock.now = 6.0
    assert not c.ready(0, [B])  # no round of zero samples: a step of zero gradient would still move AdamW
    again = c.reserve(0, B, 0, 8, G)
    assert (again.bucket, again.closes) == (0, True)


async def test_a_reservation_given_back_wakes_the_held_ones_and_its_report_does_not_wait():
    """A backward that turns out a duplicate gives its reservation back. Backwards held
    because both open steps were full must get the freed place at once (not after the
    scheduler's timeout: the swarm stalled that long), and the duplicate's report, which
    had closed its step, no longer waits for a round that its step cannot start."""
    scheduler = scheduler_without_replicas()
    first = [await scheduler.reserve(0, A, 0, 4, G) for _ in range(4)]  # steps 0 and 1, full
    assert [(r["bucket"], r["closes"]) for r in first] == [(0, False), (0, True), (1, False), (1, True)]
    held = asyncio.create_task(scheduler.reserve(0, B, 0, 4, G))
    await asyncio.sleep(0)  # let it reach its wait (a yield, not a timed wait)
    assert not held.done()
    report = await asyncio.wait_for(
        scheduler.done(0, A, 0, 0, 4, 0, G, closes=True), 5.0
    )  # the closing one: a duplicate
    assert report["step"] == 0
    woken = await asyncio.wait_for(held, 5.0)  # far below the scheduler's 30 s
    assert (woken["bucket"], woken["closes"]) == (0, True)


async def test_a_stopping_coordinator_answers_the_waiting_reservations_and_reports_at_once():
    """Seen in the rebalancing e2e test's teardown: a coordinator sent SIGTERM mid-training
    logged nothing more and had not exited 10 s later, as aiohttp waits for the handlers in
    flight and a reservation held for a step waits up to the scheduler's timeout (20 s by
    default). ``close()`` (the coordinator's on_shutdown) answers a held reservation 503
    (draining) and lets a closing report return, at once."""
    scheduler = scheduler_without_replicas()
    first = [await scheduler.reserve(0, A, 0, 4, G) for _ in range(4)]  # steps 0 and 1, full
    assert first[1]["closes"]
    held = asyncio.create_task(scheduler.reserve(0, B, 0, 4, G))
    await asyncio.sleep(0)  # let it reach its wait (a yield, not a timed wait)
    # the closing report of step 0 waits for a round no member can start (no live replica)
    report = asyncio.create_task(scheduler.done(0, A, 0, 0, 4, 4, G, closes=True))
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
    c = StepCounter(2, timeout_s=10.0, lease_s=3.0, clock=(clock := Clock()))
    for k in range(2):  # A trains the stage to step 2
        c.done(0, A, k, c.reserve(0, A, k, 8, G).bucket, 8, 8, G)
        c.round_started(0, f"r{k}")
        c.round_ended(0, {A: k + 1}, {A: 8})
    assert c.stages[0].step == 2
    assert c.reserve(
        0, B, 1, 4, G, live=[A, B]
    ).resync  # B rejoined from a checkpoint of step 1: A is alive, B takes its state
    assert c.reserve(
        0, B, 1, 4, G, live=[B]
    ).resync  # A left the registry, but reported within the lease: maybe only slow
    clock.now += 3.5
    r = c.reserve(0, B, 1, 4, G, live=[B])  # A is gone: nobody holds step 2 any more
    assert r.catch_up and r.bucket is None and not r.resync and r.as_json(2)["catch_up"]
    assert c.stages[0].step == 2 and c.stages[0].steps_lost == [(1, 2)] and c.view()[0]["steps_lost"] == [(1, 2)]
    r = c.reserve(0, B, 2, 8, G, live=[B])  # B took step 2's number: it fills step 2 and the stage steps on
    assert r.bucket == 2 and r.closes
    c.done(0, B, 2, 2, 8, 8, G)
    assert c.ready(0, [B])
    assert c.reserve(1, A, 0, 4, G, live=[]).bucket == 0  # another stage is not touched
    c.reserve(1, A, 1, 4, G, live=[A])  # A said it is at step 1 of stage 1 (the stage moves with it)
    assert c.reserve(
        1, A, 0, 4, G, live=[A]
    ).resync  # a report of A's sent before that step: A holds the step, no catch-up
    c.registered(1, A, 0)  # A restarted (same URL) from a checkpoint of step 0: its old step is void
    assert c.reserve(
        1, A, 0, 4, G, live=[A]
    ).catch_up  # measured in the arena: both replicas of a stage back at step 2 of 15
