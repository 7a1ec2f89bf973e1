"""The arena's churn schedule (``bench/arena.py: ChurnPlan``): kills by global steps, the
second one a whole stage, victims back by steps or, when the side stalls, by the clock."""

from __future__ import annotations

from bench.arena import CHURN_STALL_S, FULL, ChurnPlan

STAGES = {0: ["s0", "s7"], 1: ["s1", "s6"], 2: ["s2", "s5"], 3: ["s3", "s4"]}


def live(stages: dict[int, list[str]], down: set[str]) -> dict[int, list[str]]:
    return {s: [p for p in members if p not in down] for s, members in stages.items()}


def test_kills_come_by_steps_and_the_second_takes_a_stage_s_last_replica():
    churn, down, log = ChurnPlan(every=6, back=8), set(), []
    for step in range(0, 25):
        for _ in range(3):  # several polls at one step: one kill a step at most
            victims = churn.victims(step, live(STAGES, down))
            down |= set(victims)
            log += [(step, tuple(victims), live(STAGES, down))] if victims else []
        down -= set(churn.returning(step, now=float(step)))
    assert [step for step, _, _ in log] == [6, 12, 18, 24]
    first, second = log[0][1], log[1][1]
    assert len(first) == 1
    # the first victim was still down at step 12 (back at 14): its stage had the fewest replicas,
    # and the second kill took every one of them, its last among them
    stage = next(s for s, members in STAGES.items() if first[0] in members)
    assert set(second) == set(STAGES[stage]) - set(first)
    assert log[1][2][stage] == [] and all(log[1][2][s] for s in STAGES if s != stage)
    assert all(len(victims) == 1 for _, victims, _ in log[2:])


def test_a_victim_comes_back_by_steps_and_a_stalled_side_gets_one_back_by_the_clock():
    churn = ChurnPlan(every=2, back=3)
    assert churn.victims(1, STAGES) == [] and churn.returning(1, now=0.0) == []
    (a,) = churn.victims(2, STAGES)
    assert churn.returning(4, now=1.0) == [] and churn.returning(5, now=2.0) == [a]
    b1, b2 = churn.victims(5, STAGES)  # the second kill (due since step 4): a whole stage
    assert any(sorted(m) == [b1, b2] for m in STAGES.values())
    # the side stalls at step 5: nothing back before CHURN_STALL_S without a step, then one victim
    # (the longest down), and the next one a CHURN_STALL_S later
    assert churn.returning(5, now=2.0 + CHURN_STALL_S - 0.1) == []
    assert churn.returning(5, now=2.0 + CHURN_STALL_S) == [b1]
    assert churn.returning(5, now=2.0 + 2 * CHURN_STALL_S - 0.1) == []
    assert churn.returning(5, now=2.0 + 2 * CHURN_STALL_S) == [b2]
    assert churn.returning(5, now=2.0 + 5 * CHURN_STALL_S) == []  # nobody left down


def test_pipelining_meets_the_same_schedule_and_stops_by_the_second_kill_at_the_latest():
    ranks, idle = ["s3", "s5", "s6", "s7"], ("s0", "s1", "s2", "s4")
    churn = ChurnPlan(every=6, back=8)
    stages = dict(enumerate([r] for r in ranks))
    first = churn.victims(6, stages, idle)
    second = churn.victims(12, stages, idle)
    assert len(first) == 1 and first[0] in ranks + list(idle)
    assert len(second) == 1 and second[0] in ranks  # a stage's only rank


def test_the_churn_scenario_kills_three_times_before_its_target():
    (sc,) = [s for s in FULL.scenarios if s.churn]
    every, back = sc.churn
    # each victim is back before the next kill, so only the second kill (a whole stage) empties a stage
    assert 3 * every < sc.target_steps and back < every
