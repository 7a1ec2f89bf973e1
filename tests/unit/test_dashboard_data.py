"""The coordinator's dashboard data without HTTP: events, trainers' progress, weakest stage."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from services.coordinator.dashboard import (
    EventRecorder,
    RecentEvents,
    TrainingProgress,
    dashboard_view,
    replica_health,
    weakest_stage,
)
from shared.errors import BadPayload
from shared.log import get_logger


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_recent_events_are_bounded_newest_first_and_counted():
    events = RecentEvents(maxlen=3, clock=Clock())
    for i in range(5):
        events.add("registry.registered", server_id=f"s{i}", stage=i, ignored_field="x")
    assert [e["server_id"] for e in events.recent()] == ["s4", "s3", "s2"]
    assert events.counts["registry.registered"] == 5
    assert events.recent(1) == [
        {"t": 1000.0, "event": "registry.registered", "level": "info", "server_id": "s4", "stage": 4}
    ]


def test_event_recorder_logs_as_before_and_records_dashboard_events():
    events = RecentEvents()
    log = EventRecorder(get_logger(service="coordinator"), events).bind(run="r1")
    with capture_logs() as logs:
        log.info("registry.registered", server_id="s1", stage=0, url="http://127.0.0.1:1")
        log.warning("averaging.start.refused", round_id="avg-1", member="http://127.0.0.1:2", reason=ValueError("busy"))
        log.info("coordinator.ready", servers=0)  # logged, not an event of the swarm
        for _ in range(300):  # one per stage per global step: would push every other event out of the list
            log.info("step.round.started", round_id="step-s0-x", stage=0)
    assert [e["event"] for e in logs[:3]] == [
        "registry.registered",
        "averaging.start.refused",
        "coordinator.ready",
    ] and len(logs) == 303
    assert events.counts["step.round.started"] == 300
    assert logs[0]["run"] == "r1" and logs[0]["server_id"] == "s1"
    recorded = events.recent()
    assert [(e["event"], e["level"]) for e in recorded] == [
        ("averaging.start.refused", "warning"),
        ("registry.registered", "info"),
    ]
    assert recorded[0]["reason"] == "busy" and recorded[1]["url"] == "http://127.0.0.1:1"


def report(trainer_id: str, *records: tuple) -> dict:
    return {
        "trainer_id": trainer_id,
        "records": [
            {"step": step, "loss": loss, "tokens_per_s": tps, "elapsed_s": step} for step, loss, tps in records
        ],
    }


def test_progress_keeps_a_bounded_history_of_each_trainer():
    clock, events = Clock(), RecentEvents()
    board = TrainingProgress(max_trainers=2, max_points=4, events=events, clock=clock)
    clock.now += 1
    assert board.record(report("a", (1, 4.9, 100.0), (2, 4.8, 200.0))) == 2
    clock.now += 1
    assert (
        board.record(report("a", (2, 4.8, 200.0), (3, 4.7, 300.0), (4, 4.6, 400.0), (5, 4.5, 500.0))) == 3
    )  # step 2 came again
    history = board.view()["a"]
    assert [p["step"] for p in history] == [1, 3, 5]  # past 4 points: every other one, the newest kept
    assert history[-1] == {"t": 1002.0, "step": 5, "loss": 4.5, "tokens_per_s": 500.0, "elapsed_s": 5.0}
    board.record(report("b", (1, None, 0)))
    board.record(report("a", (6, 4.4, 600)))
    board.record({**report("c", (1, 3.0, 1)), "unknown_field": 1})  # the longest silent (b) goes
    assert sorted(board.view()) == ["a", "c"] and len(board) == 2
    assert [(e["trainer_id"], e["step"]) for e in events.recent() if e["event"] == "trainer.joined"] == [
        ("c", 1),
        ("b", 1),
        ("a", 1),
    ]


GOOD = {"step": 1, "loss": 1.0, "tokens_per_s": 1.0}


@pytest.mark.parametrize(
    "msg, fragment",
    [
        ({"records": [GOOD]}, "'trainer_id'"),
        ({"trainer_id": "a b", "records": [GOOD]}, "'trainer_id'"),
        ({"trainer_id": "a", "records": []}, "'records'"),
        ({"trainer_id": "a", "records": GOOD}, "'records'"),
        ({"trainer_id": "a", "records": [GOOD] * 257}, "'records'"),
        ({"trainer_id": "a", "records": [GOOD, 3]}, "each of 'records'"),
        ({"trainer_id": "a", "records": [GOOD, {**GOOD, "step": -1}]}, "'step'"),
        ({"trainer_id": "a", "records": [{**GOOD, "step": True}]}, "'step'"),
        ({"trainer_id": "a", "records": [{**GOOD, "loss": float("nan")}]}, "'loss'"),
        ({"trainer_id": "a", "records": [{**GOOD, "loss": "low"}]}, "'loss'"),
        ({"trainer_id": "a", "records": [{**GOOD, "tokens_per_s": -3}]}, "'tokens_per_s'"),
        ({"trainer_id": "a", "records": [{**GOOD, "tokens_per_s": float("inf")}]}, "'tokens_per_s'"),
        ({"trainer_id": "a", "records": [{**GOOD, "elapsed_s": "1"}]}, "'elapsed_s'"),
    ],
)
def test_bad_progress_is_refused_and_nothing_kept(msg, fragment):
    board = TrainingProgress()
    with pytest.raises(BadPayload, match=fragment):
        board.record(msg)
    assert board.view() == {}


def stage(index: int, capacity: float, replicas: int) -> dict:
    return {
        "stage": index,
        "capacity": capacity,
        "replicas": [{"queue_length": 1, "lease_age_s": 0.6 * r} for r in range(replicas)],
    }


def test_weakest_stage_is_least_capacity_then_fewest_replicas():
    assert weakest_stage([stage(0, 5.0, 2), stage(1, 3.0, 3), stage(2, 4.0, 1)]) == 1
    assert weakest_stage([stage(0, 0.0, 2), stage(1, 0.0, 1), stage(2, 0.0, 1)]) == 1
    assert weakest_stage([stage(0, 2.0, 1), stage(1, 0.0, 0)]) == 1  # a stage without replicas
    assert weakest_stage([]) is None


def test_dashboard_view_marks_health_and_the_weakest_stage():
    swarm = {"num_stages": 2, "heartbeat_s": 1.0, "lease_s": 3.0, "stages": [stage(0, 5.0, 2), stage(1, 2.0, 4)]}
    view = dashboard_view("run", swarm, TrainingProgress(), RecentEvents(), now=5.0)
    assert view["weakest_stage"] == 1 and view["run_id"] == "run" and view["now"] == 5.0
    assert [r["health"] for r in view["stages"][1]["replicas"]] == ["ok", "ok", "ok", "late"]
    assert [s["queue_length"] for s in view["stages"]] == [2, 4]
    assert replica_health(1.5, 1.0) == "ok" and replica_health(1.6, 1.0) == "late"
