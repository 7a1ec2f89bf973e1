"""Admission (the coordinator's flow control and the sync schedule), as plain logic on a virtual clock."""

from __future__ import annotations

from services.coordinator.admission import Admission, Admit
from tests.conftest import VirtualClock as Clock


def admission(*, global_batch=32, lookahead=0, lease_s=60.0, clock=None) -> Admission:
    return Admission(global_batch=global_batch, lookahead=lookahead, lease_s=lease_s, clock=clock or Clock())


def test_sync_admits_one_global_batch_then_waits_until_every_stage_stepped():
    a = admission(lookahead=0)
    assert [a.admit(f"mb{i}", 8) for i in range(4)] == [(Admit.ADMITTED, 0)] * 4
    assert a.admit("mb4", 8) == (Admit.WAIT, None)
    assert not a.stepped(0)
    assert a.admit("mb4", 8) == (Admit.WAIT, None)
    assert a.stepped(1)  # the slowest stage took step 0
    assert a.admit("mb4", 8) == (Admit.ADMITTED, 1)
    assert a.history[-1] == (0, ["mb0", "mb1", "mb2", "mb3"])


def test_async_admits_lookahead_steps_ahead_of_the_slowest_stage():
    a = admission(lookahead=1)
    steps = [a.admit(f"mb{i}", 8)[1] for i in range(8)]
    assert steps == [0, 0, 0, 0, 1, 1, 1, 1]
    assert a.admit("mb8", 8) == (Admit.WAIT, None) and a.in_flight() == 64
    a.stepped(1)
    assert a.admit("mb8", 8) == (Admit.ADMITTED, 2)


def test_a_rerun_keeps_its_step_and_takes_no_second_place():
    a = admission()
    assert a.admit("mb", 8) == (Admit.ADMITTED, 0)
    assert a.admit("mb", 8) == (Admit.ADMITTED, 0)
    assert a.admitted == {0: 8}


def test_a_released_or_expired_admission_gives_its_place_to_another():
    clock = Clock()
    a = admission(global_batch=16, lease_s=10.0, clock=clock)
    a.admit("a", 8)
    a.admit("b", 8)
    assert a.admit("c", 8) == (Admit.WAIT, None)
    assert a.release("a") and not a.release("a")
    assert a.admit("c", 8) == (Admit.ADMITTED, 0)
    clock.now = 5.0
    a.admit("c", 8)  # a re-run renews "c"; "b" is not heard of again
    clock.now = 12.0
    assert a.admit("d", 8) == (Admit.ADMITTED, 0) and a.expired == 1
    a.stepped(1)
    assert a.history[-1] == (0, ["c", "d"]) and a.released == 1


def test_the_trainers_last_step_completes_it_once_every_stage_took_it():
    a = admission(global_batch=8, lookahead=5)
    assert a.admit("a", 8, until_step=2) == (Admit.ADMITTED, 0)
    assert a.admit("b", 8, until_step=2) == (Admit.ADMITTED, 1)
    assert a.admit("c", 8, until_step=2) == (Admit.WAIT, None)  # its final evaluation would miss step 1
    a.stepped(1)
    assert a.admit("c", 8, until_step=2) == (Admit.WAIT, None)
    a.stepped(2)
    assert a.admit("c", 8, until_step=2) == (Admit.COMPLETE, None)


def test_a_microbatch_of_a_step_taken_without_it_is_admitted_again_into_an_open_step():
    a = admission(global_batch=8, lookahead=1)
    a.admit("late", 8)
    a.stepped(2)  # the stages went on (its reservations were given up)
    assert a.admit("late", 8) == (Admit.ADMITTED, 2)


def test_a_step_never_admits_more_than_the_global_batch_plus_one_microbatch_short_of_it():
    a = admission(global_batch=30, lookahead=2)
    for i in range(20):
        a.admit(f"mb{i}", 8)
    assert all(n < 30 + 8 for n in a.admitted.values()) and sorted(a.admitted) == [0, 1, 2]


def test_a_step_left_short_by_a_dead_trainer_takes_microbatches_admitted_further():
    """The floor of a stage's reservation: a later admission may fill a step whose admissions
    expired (without this, microbatches admitted for later steps waited at a stage for a step
    that nobody filled any more: a trainer killed under the async schedule stalled the swarm)."""
    clock = Clock()
    a = admission(global_batch=16, lookahead=2, lease_s=10.0, clock=clock)
    a.admit("dead-0", 8)
    a.admit("dead-1", 8)
    assert [a.admit(f"live-{i}", 8)[1] for i in range(4)] == [1, 1, 2, 2]
    assert a.floor(2) == 2  # every step before 2 is full: its own step
    clock.now = 5.0
    for i in range(4):
        a.admit(f"live-{i}", 8)  # the live trainer's re-runs renew its admissions
    clock.now = 12.0
    assert a.floor(2) == 0 and a.expired == 2  # the dead trainer's step 0 has room again
    assert a.floor(0) == 0


def test_a_renewal_keeps_the_named_admissions_and_only_those():
    clock = Clock()
    a = admission(global_batch=16, lease_s=10.0, clock=clock)
    for mb in ("run:t0:0", "run:t0:2", "run:t1:1"):
        assert a.admit(mb, 4)[0] is Admit.ADMITTED
    clock.now = 8.0
    assert a.renew(["run:t0:0", "run:t0:2", "run:t0:9"]) == 2  # an id not held is skipped
    clock.now = 15.0  # t1's admission is 15 s old, t0's 7 s
    assert a.admit("run:t2:3", 4) == (Admit.ADMITTED, 0) and a.expired == 1
    assert a.batch(0) == ["run:t0:0", "run:t0:2", "run:t2:3"]
