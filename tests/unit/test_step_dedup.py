"""Holes in the global steps' counting, each a rule of the counter now: late reports of
reservations given up do not overfill their step; samples reported without a reservation
are bounded; each microbatch counts once per stage, across replicas and a coordinator
restart. Also the protocol's messages (``shared/step_protocol.py``) and the replica's side
of the ``duplicate`` verdict."""

from __future__ import annotations

import itertools

import pytest

from services.coordinator.registry import Registry
from services.coordinator.steps import WINDOW_STEPS, StepCounter, StepScheduler
from services.stage_server.stepping import Reservation, StepClient
from shared.errors import BadPayload, Overloaded
from shared.log import get_logger
from shared.step_protocol import DoneReport, ReserveAnswer, ReserveRequest, Verdict
from tests.conftest import VirtualClock as Clock

A, B = "http://a", "http://b"
_ids = itertools.count()


def counter(timeout_s: float = 5.0) -> tuple[StepCounter, Clock]:
    clock = Clock()
    return StepCounter(1, timeout_s=timeout_s, clock=clock), clock


def reserve(c: StepCounter, url: str, samples: int, g: int, mb: str | None = None, step: int = 0):
    """(request, answer) of a reservation at stage 0, of a new microbatch unless ``mb`` names one."""
    req = ReserveRequest(0, url, step, samples, g, mb or f"mb{next(_ids)}")
    return req, c.reserve(req)


def report(c: StepCounter, req: ReserveRequest, bucket: int, samples: int, step: int | None = None) -> None:
    c.done(
        DoneReport(0, req.url, req.step if step is None else step, bucket, req.samples, samples, req.global_batch,
                   req.microbatch_id)
    )  # fmt: skip


def fill_and_step(c: StepCounter, url: str, g: int) -> None:
    """One whole step of ``g`` samples from ``url``, and the round that takes it."""
    st = c.stages[0]
    req, answer = reserve(c, url, g, g, step=st.step)
    report(c, req, answer.bucket, g)
    assert c.ready(0)
    c.round_started(0, f"r{st.step}")
    c.round_ended(0, {url: st.step + 1}, {url: g})


# ---------------------------------------------------------------- hole 1: late reports of reservations given up


def test_late_reports_of_given_up_reservations_do_not_overfill_their_step():
    """Found by review: replica A reserves 4 x 8 samples and is not seen for a while; the
    step's reservations are given up (nothing was accumulated, so the step fills again); A
    then reports 0, 0, 8, 8 late. Those reports gave back reservations that were no longer
    counted (reserved -16, done 16), and B needed 6 more reservations: the step held 64
    samples of a global batch of 32. Now a late report gives nothing back, and its samples
    count as a reservation would have: B needs 2 more, and the step holds 32."""
    g = 32
    c, clock = counter(timeout_s=5.0)
    late = [reserve(c, A, 8, g) for _ in range(4)]
    assert late[-1][1].verdict is Verdict.CLOSES
    clock.now = 6.0
    assert not c.ready(0, [B])  # A is gone and nothing was accumulated: the reservations are given up
    for (req, answer), samples in zip(late, (0, 0, 8, 8)):
        report(c, req, answer.bucket, samples)
    st = c.stages[0]
    assert st.reserved[0] == 16 and st.done[0] == 16
    more = 0
    while True:
        req, answer = reserve(c, B, 8, g)
        more += 1
        report(c, req, answer.bucket, 8)
        if answer.verdict is Verdict.CLOSES:
            break
    assert more == 2 and st.done[0] == g and st.reserved[0] == g
    assert c.ready(0, [A, B])


def test_a_late_report_past_its_step_s_room_counts_as_dropped_not_in_the_step():
    g = 16
    c, clock = counter(timeout_s=5.0)
    req, answer = reserve(c, A, 16, g)
    clock.now = 6.0
    assert not c.ready(0, [B])  # given up
    for _ in range(2):  # B fills the step again
        b_req, b_answer = reserve(c, B, 8, g)
        report(c, b_req, b_answer.bucket, 8)
    report(c, req, answer.bucket, 16)  # A was only slow: the step has no room left for it
    st = c.stages[0]
    assert st.done[0] == g and st.reserved[0] == g and st.samples_dropped == 16


def test_samples_reported_without_a_reservation_count_at_most_one_global_batch_per_step():
    """The coordinator away, replicas fill a step alone and report it afterwards (reserved
    0); a report of more than their shares (reported twice, or a bogus count) is bounded."""
    g = 8
    c, _ = counter()
    unreserved = DoneReport(0, A, 0, 0, 0, 6, g)
    c.done(unreserved)
    c.done(unreserved)
    c.done(DoneReport(0, B, 0, 0, 0, 10**9, g))
    st = c.stages[0]
    assert st.unreserved[0] == g and st.done[0] == g and st.samples_dropped == 4 + 10**9
    assert reserve(c, A, 4, g)[1].verdict is Verdict.RESERVED  # step 0 is full: the next one
    assert c.stages[0].reserved.get(1) == 4


# ---------------------------------------------------------------- hole 5: one microbatch, counted once per stage


def test_a_microbatch_reserved_on_one_replica_is_refused_on_another_and_counted():
    """Found by review: a relay backward that timed out at the trainer was retried on
    another replica (aiohttp does not cancel the first handler), or a chain hop went on to an
    alternate while the first replica still computed: both accumulated it, and each
    replica's own dedup history could not tell."""
    g = 8
    c, _ = counter()
    first, answer = reserve(c, A, 4, g, mb="m1")
    assert answer.verdict is Verdict.RESERVED
    retried = reserve(c, B, 4, g, mb="m1")[1]  # the trainer's retry, while A still computes
    assert retried.verdict is Verdict.DUPLICATE and retried.bucket is None
    report(c, first, answer.bucket, 4)
    assert reserve(c, B, 4, g, mb="m1")[1].verdict is Verdict.DUPLICATE  # and once A accumulated it
    assert reserve(c, A, 4, g, mb="m1")[1].verdict is Verdict.DUPLICATE  # on the same replica too
    st = c.stages[0]
    assert st.reserved[0] == 4 and st.done[0] == 4
    assert c.view()[0]["duplicates_refused"] == 3


def test_the_window_holds_a_microbatch_for_its_steps_then_lets_it_go():
    g = 8
    c, _ = counter()
    req, answer = reserve(c, A, 4, g, mb="m1")
    report(c, req, answer.bucket, 4)
    req, answer = reserve(c, B, 4, g)
    report(c, req, answer.bucket, 4)
    c.round_started(0, "r0")
    c.round_ended(0, {A: 1, B: 1}, {A: 4, B: 4})
    for _ in range(WINDOW_STEPS):
        assert reserve(c, B, 4, g, mb="m1", step=c.stages[0].step)[1].verdict is Verdict.DUPLICATE
        fill_and_step(c, A, g)
    assert reserve(c, B, 4, g, mb="m1", step=c.stages[0].step)[1].verdict is Verdict.RESERVED  # out of the window


def test_a_microbatch_given_back_or_given_up_can_be_reserved_again():
    """A replica whose backward failed (0 samples) or that died with its reservation (given
    up) releases the microbatch: run again elsewhere, it counts."""
    g = 8
    c, clock = counter(timeout_s=5.0)
    req, answer = reserve(c, A, 4, g, mb="failed")
    report(c, req, answer.bucket, 0)
    assert reserve(c, B, 4, g, mb="failed")[1].verdict is Verdict.RESERVED
    assert c.stages[0].reserved[0] == 4
    c2, clock = counter(timeout_s=5.0)
    reserve(c2, A, 8, g, mb="died")
    clock.now = 6.0
    assert not c2.ready(0, [B])  # A is gone: its reservation is given up
    assert reserve(c2, B, 8, g, mb="died")[1].verdict is Verdict.CLOSES


def test_a_reservation_that_missed_its_step_releases_its_microbatch():
    g = 8
    c, clock = counter(timeout_s=5.0)
    slow_req, slow = reserve(c, A, 4, g, mb="slow")
    done_req, done = reserve(c, B, 4, g)
    report(c, done_req, done.bucket, 4)
    clock.now = 6.0
    assert c.ready(0, [A, B])  # A's reservation timed out: the step goes with B's 4
    c.round_started(0, "r0")
    c.round_ended(0, {B: 1}, {B: 4})
    assert reserve(c, B, 4, g, mb="slow", step=1)[1].verdict is Verdict.RESERVED  # the re-run counts
    report(c, slow_req, slow.bucket, 4)  # A's late report: its step was taken without it
    assert c.stages[0].samples_dropped == 4


def test_a_late_report_of_a_microbatch_run_again_elsewhere_is_not_counted_twice():
    g = 8
    c, clock = counter(timeout_s=5.0)
    slow_req, slow = reserve(c, A, 8, g, mb="m1")
    clock.now = 6.0
    assert not c.ready(0, [B])  # A given up: m1 is free
    again_req, again = reserve(c, B, 8, g, mb="m1")
    assert again.verdict is Verdict.CLOSES
    report(c, slow_req, slow.bucket, 8)  # A was only slow: B holds m1 now
    report(c, again_req, again.bucket, 8)
    st = c.stages[0]
    assert st.done[0] == g and st.samples_dropped == 8 and st.held["m1"] == (0, B)


async def test_the_window_survives_a_coordinator_restart(tmp_path):
    db = str(tmp_path / "state.sqlite")
    g = 8

    def scheduler(registry: Registry) -> StepScheduler:
        return StepScheduler(
            1, lambda: [], codec="fp32", timeout_s=1.0, aggregator="mean", log=get_logger(service="test"),
            store=registry,
        )  # fmt: skip

    registry = Registry(db, num_stages=1, heartbeat_s=1.0)
    before = scheduler(registry)
    for step in range(WINDOW_STEPS + 3):  # an old microbatch falls out of the window on the way
        req = ReserveRequest(0, A, step, g, g, f"s{step}")
        answer = await before.reserve(req)
        before.counter.done(DoneReport(0, A, step, answer["bucket"], g, g, g, req.microbatch_id))
        before.counter.round_started(0, "r")
        before.counter.round_ended(0, {A: step + 1}, {A: g})
        before._persist()
    out = ReserveRequest(0, A, WINDOW_STEPS + 3, 4, g, "out")
    assert (await before.reserve(out))["verdict"] == "reserved"  # out when the coordinator stops
    given_back = ReserveRequest(0, A, WINDOW_STEPS + 3, 4, g, "given-back")
    answer = await before.reserve(given_back)
    await before.done(DoneReport(0, A, WINDOW_STEPS + 3, answer["bucket"], 4, 0, g, "given-back"))
    registry.close()

    registry = Registry(db, num_stages=1, heartbeat_s=1.0)  # the coordinator restarted
    after = scheduler(registry)
    step = WINDOW_STEPS + 3
    verdicts = {
        mb: (await after.reserve(ReserveRequest(0, B, step, 2, g, mb)))["verdict"]
        for mb in ("out", "s18", "s3", "s2", "given-back")
    }
    assert verdicts == {
        "out": "duplicate",  # its replica may still accumulate it
        "s18": "duplicate",
        "s3": "duplicate",
        "s2": "reserved",  # 17 steps old: out of the window
        # the open step's count came back too: "out" (4) + s2 (2) + this (2) fill its 8
        "given-back": "closes",
    }
    assert after.counter.stages[0].reserved[step] == 8
    assert after.counter.view()[0]["duplicates_refused"] == 3
    registry.close()


# ---------------------------------------------------------------- the protocol's messages


def test_reserve_requests_are_validated_and_round_trip():
    req = ReserveRequest(1, "http://a:1", 3, 4, 32, "run:c:7", until_step=9)
    assert ReserveRequest.from_json({**req.as_json(), "extra": 1}, num_stages=2) == req
    assert ReserveRequest.from_json({**req.as_json(), "url": "http://a:1/"}, 2).url == "http://a:1"
    good = req.as_json()
    for field, bad in [
        ("microbatch_id", None),
        ("microbatch_id", ""),
        ("microbatch_id", "x" * 513),
        ("stage", 2),
        ("url", "ftp://a"),
        ("samples", -1),
        ("global_batch", 0),
        ("step", True),
        ("until_step", 0),
    ]:
        with pytest.raises(BadPayload, match=field):
            ReserveRequest.from_json({**good, field: bad}, num_stages=2)


def test_done_reports_are_validated():
    report = DoneReport(0, "http://a", 1, 1, 4, 4, 32, "m", closes=True)
    assert DoneReport.from_json(report.as_json(), 1) == report
    unreserved = DoneReport(0, "http://a", 1, 1, 0, 12, 32)
    assert DoneReport.from_json(unreserved.as_json(), 1) == unreserved  # names no microbatch
    with pytest.raises(BadPayload, match="microbatch_id"):
        DoneReport.from_json({**report.as_json(), "microbatch_id": None}, 1)
    with pytest.raises(BadPayload, match="samples"):
        DoneReport.from_json({**report.as_json(), "samples": 5}, 1)
    with pytest.raises(BadPayload, match="closes"):
        DoneReport.from_json({**report.as_json(), "closes": "yes"}, 1)


def test_answers_carry_one_verdict():
    for verdict, bucket in [(Verdict.CLOSES, 3), (Verdict.DUPLICATE, None), (Verdict.RESYNC, None)]:
        answer = ReserveAnswer(verdict, bucket, 2, replicas=3)
        assert ReserveAnswer.from_json(answer.as_json()) == answer
    with pytest.raises(BadPayload, match="verdict"):
        ReserveAnswer.from_json({"bucket": 1, "step": 0, "closes": True})  # the old flags
    with pytest.raises(BadPayload, match="bucket"):
        ReserveAnswer.from_json({"verdict": "reserved", "bucket": None, "step": 0})
    assert [v for v in Verdict if v.accumulates] == [Verdict.RESERVED, Verdict.CLOSES]


# ---------------------------------------------------------------- the replica's side


class FakeRuntime:
    step = 0

    def pending(self, step=None) -> int:
        return 0


def answering(answers: list[dict], sent: list[tuple[str, dict]]):
    """A coordinator's ``post`` that records each message in ``sent`` and gives ``answers`` in turn."""

    async def post(path: str, body: dict) -> dict:
        sent.append((path, body))
        return answers.pop(0)

    return post


def client(answers: list[dict], sent: list[tuple[str, dict]]) -> StepClient:
    async def nothing(*args) -> None:
        return None

    return StepClient(
        FakeRuntime(), post=answering(answers, sent), resync=nothing, wait_round=nothing, round_wait_s=1.0,
        log=get_logger(service="test"),
        identity={"run_id": "r", "stage": 0, "url": "http://a", "global_batch": 8},
    )  # fmt: skip


async def test_a_replica_told_duplicate_accumulates_nothing_and_reports_nothing():
    sent: list[tuple[str, dict]] = []
    stepper = client([{"verdict": "duplicate", "bucket": None, "step": 0, "replicas": 2}], sent)
    assert await stepper.reserve(4, None, "m1") is Verdict.DUPLICATE
    assert sent == [
        (
            "/step/reserve",
            {"run_id": "r", "stage": 0, "url": "http://a", "global_batch": 8, "step": 0, "samples": 4,
             "microbatch_id": "m1"},
        )
    ]  # fmt: skip
    assert stepper.replicas == 2


async def test_a_replica_s_report_names_its_reservation_s_microbatch():
    sent: list[tuple[str, dict]] = []
    stepper = client([{"verdict": "closes", "bucket": 0, "step": 0}, {"round": None, "step": 0}], sent)
    reservation = await stepper.reserve(4, 5, "m2")
    assert reservation == Reservation(0, 4, closes=True, microbatch_id="m2")
    await stepper.done(reservation, 4)
    path, body = sent[1]
    assert path == "/step/done" and DoneReport.from_json(body, 1) == DoneReport(
        0, "http://a", 0, 0, 4, 4, 8, "m2", True
    )


async def test_a_replica_applying_a_round_takes_no_catch_up():
    """A restarted coordinator knows nothing of a step round still applying here and may say
    ``catch_up``; the replica takes no step number while its round applies (the round ends
    with it at the round's step): Overloaded, the trainer retries (the global step model's
    ``test_a_replica_applying_a_round_is_not_caught_up_by_a_restarted_coordinator``)."""
    caught: list[int] = []

    class Runtime(FakeRuntime):
        pending_samples = 0

        def catch_up(self, step: int) -> None:
            caught.append(step)
            self.step = step

    sent: list[tuple[str, dict]] = []
    stepper = client([{"verdict": "catch_up", "bucket": None, "step": 1, "replicas": 2}], sent)
    stepper.runtime, stepper.in_round = Runtime(), lambda: True
    with pytest.raises(Overloaded, match="applying the step round of step 0"):
        await stepper.reserve(4, None, "m1")
    assert caught == [] and len(sent) == 1
    stepper.in_round = lambda: False  # its round ended, still behind and nobody holds the step: it catches up
    sent.clear()
    stepper.post = answering(
        [{"verdict": "catch_up", "bucket": None, "step": 1, "replicas": 2},
         {"verdict": "reserved", "bucket": 1, "step": 1, "replicas": 2}], sent
    )  # fmt: skip
    await stepper.reserve(4, None, "m1")
    assert caught == [1]
