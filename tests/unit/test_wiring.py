"""Unit tests of the trainer's stochastic wiring (shared/wiring.py), without HTTP.

Time is a fake clock set by hand, randomness a seeded ``random.Random``: nothing sleeps.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from shared.wiring import NoReplica, ReplicaBalancer, ThroughputEMA

FAST, SLOW = "http://fast", "http://slow"


class FakeClock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_balancer(urls=(FAST, SLOW), seed: int = 0, **kwargs) -> tuple[ReplicaBalancer, FakeClock]:
    clock = FakeClock()
    balancer = ReplicaBalancer(1, rng=random.Random(seed), clock=clock, **kwargs)
    balancer.set_replicas(0, list(urls))
    return balancer, clock


def simulate(balancer: ReplicaBalancer, true_s: dict[str, float], calls: int, batch_size: int = 8) -> list[str]:
    """Each chosen replica takes its true time per sample and reports success; forward and
    backward alternate (a backward takes ``backward_cost`` times as long)."""
    chosen = []
    for i in range(calls):
        kind = "backward" if i % 2 else "forward"
        url = balancer.choose(0, kind=kind, batch_size=batch_size)
        cost = balancer.backward_cost if kind == "backward" else 1.0
        balancer.report_success(0, url, true_s[url] * batch_size * cost, batch_size, kind)
        chosen.append(url)
    return chosen


# --- ThroughputEMA ---------------------------------------------------------------------


def test_ema_is_bias_corrected():
    ema = ThroughputEMA(decay=0.9)
    assert ema.value is None and ema.samples == 0
    ema.update(2.0)
    assert ema.value == pytest.approx(2.0, rel=1e-12)  # not 0.1 * 2.0
    assert ema.samples == 1
    for _ in range(5):
        ema.update(2.0)
    assert ema.value == pytest.approx(2.0, rel=1e-12)


def test_ema_follows_a_change():
    ema = ThroughputEMA(decay=0.9)
    ema.update(1.0)
    for _ in range(100):
        ema.update(3.0)
    assert ema.value == pytest.approx(3.0, rel=1e-3)


@pytest.mark.parametrize("decay", [0.0, 1.0, -0.5])
def test_ema_rejects_bad_decay(decay):
    with pytest.raises(ValueError, match="ema_decay"):
        ThroughputEMA(decay)


# --- load in proportion to measured speed ----------------------------------------------


def test_measured_speeds_3_to_1_split_requests_3_to_1():
    balancer, _ = make_balancer()
    for _ in range(50):
        balancer.report_success(0, FAST, 8.0, 8, "forward")  # 1 s per sample
        balancer.report_success(0, SLOW, 60.0, 8, "backward")  # 60 / 2.5 / 8 = 3 s per sample
    assert balancer.estimates(0) == {FAST: pytest.approx(1.0), SLOW: pytest.approx(3.0)}
    counts = Counter(balancer.choose(0, batch_size=8) for _ in range(4000))
    assert 0.70 <= counts[FAST] / 4000 <= 0.80


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_simulation_from_no_measurements_converges_to_3_to_1(seed):
    balancer, _ = make_balancer(seed=seed)
    chosen = simulate(balancer, {FAST: 1.0, SLOW: 3.0}, calls=4000)
    # the work (a backward is backward_cost forwards), not the count of requests: forwards and
    # backwards alternate, and each goes where it finishes first, so the slow replica gets
    # more of the short forwards
    work = [balancer.backward_cost if i % 2 else 1.0 for i in range(len(chosen))]
    fast = sum(w for url, w in zip(chosen[2000:], work[2000:]) if url == FAST) / sum(work[2000:])
    assert 0.70 <= fast <= 0.80
    assert balancer.estimates(0) == {FAST: pytest.approx(1.0), SLOW: pytest.approx(3.0)}


@pytest.mark.parametrize("seed", range(10))
def test_a_burst_goes_where_it_finishes_first(seed):
    """A global step's microbatches sent at once to two idle replicas, one twice as slow: the
    slow one gets one only where it would finish no later than the fast one's queue (a weak
    peer is not the step's last microbatch), also after a while idle, when both replicas'
    virtual times lie in the past."""
    balancer, clock = make_balancer(seed=seed)
    balancer.report_success(0, FAST, 1.0, 1, "forward")
    balancer.report_success(0, SLOW, 1.4, 1, "forward")  # within SLOWER: judged at its estimate
    for _ in range(3):
        clock.now += 60.0  # idle: the next step's burst
        burst = [balancer.choose(0, batch_size=1) for _ in range(3)]
        assert burst[0] == FAST and sorted(burst[1:]) == [FAST, SLOW], burst  # 1 s, then 1.4 s against 2 s


@pytest.mark.parametrize("seed", range(10))
def test_a_much_slower_replica_is_judged_at_twice_its_estimate(seed):
    """A replica four times slower finishes its one request of a burst of 4 when the fast one
    finishes its 4th: a tie, which went either way (the heterogeneous arena's weak stage-0 peer
    took one in every other step, and those steps ended a second later). Judged at twice its
    estimate, it gets a burst's request only past the fast one's 8th; replicas of about one
    speed still share a burst evenly."""
    balancer, clock = make_balancer(seed=seed)
    balancer.report_success(0, FAST, 1.0, 1, "forward")
    balancer.report_success(0, SLOW, 4.0, 1, "forward")
    for _ in range(3):
        clock.now += 60.0
        assert [balancer.choose(0, batch_size=1) for _ in range(4)] == [FAST] * 4
        clock.now += 60.0
        burst = [balancer.choose(0, batch_size=1) for _ in range(9)]
        assert burst[:7] == [FAST] * 7 and burst.count(SLOW) == 1, burst  # the 8th or 9th: judged at 8 s
    even, clock = make_balancer(seed=seed)
    even.report_success(0, FAST, 1.0, 1, "forward")
    even.report_success(0, SLOW, 1.05, 1, "forward")  # within the estimates' noise
    clock.now += 60.0
    assert Counter(even.choose(0, batch_size=1) for _ in range(4)) == {FAST: 2, SLOW: 2}


def test_backward_advances_virtual_time_by_backward_cost():
    balancer, _ = make_balancer()
    for url in (FAST, SLOW):
        balancer.report_success(0, url, 1.0, 1, "forward")  # both 1 s per sample
    assert balancer.choose(0, kind="backward", batch_size=1, exclude=[SLOW]) == FAST  # FAST at 2.5
    nxt = [balancer.choose(0, batch_size=1) for _ in range(4)]
    assert nxt == [SLOW, SLOW, SLOW, FAST]  # SLOW at 1, 2, 3 > 2.5


def test_unmeasured_replica_is_costed_at_the_stage_mean():
    new = "http://new"
    balancer, _ = make_balancer(urls=(FAST, SLOW, new))
    balancer.report_success(0, FAST, 1.0, 1, "forward")
    balancer.report_success(0, SLOW, 4.0, 1, "forward")
    assert balancer.choose(0, batch_size=1, exclude=[FAST, SLOW]) == new  # new at (1 + 4) / 2 = 2.5
    nxt = [balancer.choose(0, batch_size=1, exclude=[SLOW]) for _ in range(5)]
    assert nxt[:4] == [FAST] * 4  # FAST finishing at 1, 2, 3, 4, new at 2.5 + 2.5 = 5
    assert nxt[4] in (FAST, new)  # a tie at 5


def test_rejects_unknown_kind():
    balancer, _ = make_balancer()
    with pytest.raises(ValueError, match="kind"):
        balancer.choose(0, kind="sideways", batch_size=1)
    with pytest.raises(ValueError, match="kind"):
        balancer.report_success(0, FAST, 1.0, 1, "sideways")


# --- new replicas, set_replicas ----------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_new_replica_is_tried_within_two_calls(seed):
    balancer, _ = make_balancer(seed=seed)
    simulate(balancer, {FAST: 1.0, SLOW: 2.7}, calls=3000)
    balancer.set_replicas(0, [FAST, SLOW, "http://new"])
    assert balancer.estimates(0)["http://new"] is None
    assert "http://new" in [balancer.choose(0, batch_size=8) for _ in range(2)]


def test_set_replicas_keeps_survivors_and_drops_removed():
    balancer, _ = make_balancer()
    balancer.report_success(0, FAST, 2.0, 1, "forward")
    balancer.report_success(0, SLOW, 5.0, 1, "forward")
    balancer.set_replicas(0, [FAST, "http://other"])
    assert balancer.estimates(0) == {FAST: pytest.approx(2.0), "http://other": None}
    balancer.set_replicas(0, [FAST, SLOW])
    assert balancer.estimates(0)[SLOW] is None  # forgotten, comes back unmeasured


def test_reports_about_a_removed_replica_are_ignored():
    balancer, _ = make_balancer()
    balancer.set_replicas(0, [FAST])
    balancer.report_success(0, SLOW, 1.0, 1, "forward")
    balancer.report_failure(0, SLOW)
    assert balancer.estimates(0) == {FAST: None}
    assert not balancer.is_banned(0, SLOW)


def test_empty_stage_raises_no_replica():
    balancer = ReplicaBalancer(2, rng=random.Random(0), clock=FakeClock())
    balancer.set_replicas(0, [FAST])
    with pytest.raises(NoReplica) as info:
        balancer.choose(1, batch_size=1)
    assert info.value.stage == 1 and isinstance(info.value, LookupError)
    balancer.set_replicas(0, [])
    with pytest.raises(NoReplica):
        balancer.choose(0, batch_size=1)


def test_stage_out_of_range():
    balancer, _ = make_balancer()
    with pytest.raises(IndexError, match="num_stages"):
        balancer.choose(1, batch_size=1)


# --- ties --------------------------------------------------------------------------------


def test_ties_are_broken_at_random():
    firsts = set()
    for seed in range(50):
        balancer, _ = make_balancer(seed=seed)
        firsts.add(balancer.choose(0, batch_size=1))
    assert firsts == {FAST, SLOW}


# --- bans --------------------------------------------------------------------------------


def test_banned_replica_is_skipped_until_its_ban_expires():
    balancer, clock = make_balancer()
    balancer.report_failure(0, FAST)
    assert balancer.is_banned(0, FAST) and balancer.usable(0) == [SLOW]
    assert {balancer.choose(0, batch_size=1) for _ in range(100)} == {SLOW}
    clock.now += 0.999
    assert balancer.is_banned(0, FAST)
    clock.now += 0.001
    assert not balancer.is_banned(0, FAST) and balancer.usable(0) == [FAST, SLOW]
    assert FAST in [balancer.choose(0, batch_size=1) for _ in range(2)]


def test_ban_doubles_with_consecutive_failures_up_to_the_cap_and_resets_on_success():
    balancer, clock = make_balancer(ban_base_s=1.0, ban_max_s=10.0)
    expected = [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    for ban_s in expected:
        balancer.report_failure(0, FAST)
        clock.now += ban_s - 1e-6
        assert balancer.is_banned(0, FAST)
        clock.now += 1e-6
        assert not balancer.is_banned(0, FAST)
    balancer.report_success(0, FAST, 1.0, 1, "forward")
    balancer.report_failure(0, FAST)
    clock.now += 1.0
    assert not balancer.is_banned(0, FAST)  # back to ban_base_s


def test_when_every_replica_is_banned_bans_are_ignored():
    balancer, _ = make_balancer()
    balancer.report_failure(0, FAST)
    balancer.report_failure(0, SLOW)
    assert not balancer.has_usable(0) and balancer.usable(0) == []
    assert {balancer.choose(0, batch_size=1) for _ in range(20)} == {FAST, SLOW}


def test_exclude_skips_the_replica_that_failed_this_hop():
    balancer, _ = make_balancer()
    balancer.report_success(0, FAST, 1.0, 1, "forward")
    balancer.report_success(0, SLOW, 100.0, 1, "forward")
    assert {balancer.choose(0, batch_size=1, exclude=[FAST]) for _ in range(5)} == {SLOW}
    # Exclude holds over bans while a non-excluded replica exists.
    balancer.report_failure(0, SLOW)
    assert balancer.choose(0, batch_size=1, exclude=[FAST]) == SLOW
    # Everything excluded: pick among all (bans still count).
    assert balancer.choose(0, batch_size=1, exclude=[FAST, SLOW]) == FAST


def test_replica_back_from_a_ban_gets_no_burst():
    balancer, clock = make_balancer()
    for url in (FAST, SLOW):
        balancer.report_success(0, url, 1.0, 1, "forward")  # equal speeds
    balancer.report_failure(0, FAST)
    for _ in range(1000):
        balancer.choose(0, batch_size=1)  # all to SLOW while FAST is banned
    clock.now += 1.0
    counts = Counter(balancer.choose(0, batch_size=1) for _ in range(20))
    assert counts[FAST] <= 11


def test_a_hot_spare_gets_no_request_while_another_replica_is_usable_and_takes_over_when_none_is():
    balancer, clock = make_balancer()
    balancer.set_replicas(0, [FAST, SLOW], spares=[FAST])  # even the faster one, when marked
    assert Counter(balancer.choose(0, batch_size=4) for _ in range(50)) == Counter({SLOW: 50})
    assert balancer.alternates(0, SLOW, 2) == [FAST]  # where a chain goes if SLOW fails
    balancer.report_failure(0, SLOW)  # banned: the spare takes over at once
    assert balancer.choose(0, batch_size=4) == FAST
    clock.now += 3600  # the ban ran out
    assert balancer.choose(0, batch_size=4) == SLOW
    balancer.set_replicas(0, [FAST, SLOW])  # no longer a spare: both serve again
    assert set(balancer.choose(0, batch_size=4) for _ in range(50)) == {FAST, SLOW}
