"""Unit tests of the coordinator's registry: leases on a fake clock, persistence in SQLite,
stage assignment, upserts, validation and the size limit. No sockets, no sleeps."""

from __future__ import annotations

import math

import pytest

from services.coordinator.registry import JOIN_WINDOW_S, Registry, RegistryFull, StageOutOfRange, UnknownServer
from shared.errors import BadPayload, Overloaded

HEARTBEAT_S = 2.0
LEASE_S = 3 * HEARTBEAT_S
T0 = 1_700_000_000.0


class FakeClock:
    def __init__(self, now: float = T0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def make_registry(clock, path=":memory:", **overrides) -> Registry:
    kwargs = dict(num_stages=4, heartbeat_s=HEARTBEAT_S, lease_heartbeats=3, clock=clock)
    return Registry(path, **{**kwargs, **overrides})


@pytest.fixture
def registry(clock):
    reg = make_registry(clock)
    yield reg
    reg.close()


def add(reg: Registry, n: int, stage: int = 0, throughput: float = 1.0, queue_length: int = 0):
    return reg.register(f"s{n}", stage, f"http://127.0.0.1{n}:8100", "0.1.0", throughput, queue_length)


def ids(reg: Registry) -> list[str]:
    return [s.server_id for s in reg.live()]


# --- leases -------------------------------------------------------------------------------


def test_lease_expires_after_exactly_three_missed_heartbeats(registry, clock):
    add(registry, 1)
    clock.advance(LEASE_S)  # three heartbeat periods: the third is due, not yet missed
    assert ids(registry) == ["s1"]
    assert registry.expire() == []
    clock.advance(1e-3)
    assert ids(registry) == []
    assert [s.server_id for s in registry.expire()] == ["s1"]
    assert registry.expire() == []  # removed once


def test_heartbeats_keep_the_lease(registry, clock):
    add(registry, 1)
    for _ in range(10):
        clock.advance(HEARTBEAT_S * 2.9)
        assert registry.heartbeat("s1", 2.0, 3) == clock.now + LEASE_S
    assert registry.expire() == []
    (server,) = registry.live()
    assert (server.throughput, server.queue_length, server.last_heartbeat) == (2.0, 3, clock.now)


def test_heartbeat_of_unknown_or_expired_server(registry, clock):
    with pytest.raises(UnknownServer):
        registry.heartbeat("nobody", 1.0, 0)
    add(registry, 1)
    clock.advance(LEASE_S + 0.5)  # expired, not yet removed by expire()
    with pytest.raises(UnknownServer) as err:
        registry.heartbeat("s1", 1.0, 0)
    assert err.value.status == 404 and err.value.code == "unknown_server"
    add(registry, 1)  # re-registering brings it back
    assert registry.heartbeat("s1", 1.0, 0) == clock.now + LEASE_S


def test_deregister_removes_at_once(registry):
    add(registry, 1), add(registry, 2)
    assert registry.deregister("s1") is True
    assert ids(registry) == ["s2"]
    assert registry.deregister("s1") is False
    with pytest.raises(UnknownServer):
        registry.heartbeat("s1", 1.0, 0)


# --- persistence --------------------------------------------------------------------------


def test_state_survives_reopening_the_file(tmp_path, clock):
    path = str(tmp_path / "coordinator.sqlite")
    reg = make_registry(clock, path)
    add(reg, 1, stage=2, throughput=5.0)
    clock.advance(1.0)
    add(reg, 2, stage=0)
    reg.close()

    clock.advance(4.5)  # the coordinator was down for a while
    reg = make_registry(clock, path)
    assert ids(reg) == ["s2", "s1"]  # by stage
    view = reg.view()
    assert view["stages"][2]["replicas"][0]["lease_age_s"] == pytest.approx(5.5)
    assert view["stages"][2]["replicas"][0]["registered_at"] == T0
    clock.advance(0.6)  # s1's lease (from T0) ran out, s2's (from T0 + 1) did not
    assert [s.server_id for s in reg.expire()] == ["s1"]
    reg.close()

    reg = make_registry(clock, path)
    assert ids(reg) == ["s2"]
    reg.close()


def test_reopening_with_fewer_stages_is_refused(tmp_path, clock):
    path = str(tmp_path / "coordinator.sqlite")
    reg = make_registry(clock, path)
    add(reg, 1, stage=3)
    reg.close()
    with pytest.raises(ValueError, match="num_stages is 2"):
        make_registry(clock, path, num_stages=2)


# --- assignment ---------------------------------------------------------------------------


def test_assign_stage_empty_swarm_is_stage_zero(registry):
    assert registry.assign_stage() == 0


def test_assign_stage_least_capacity(registry):
    add(registry, 1, stage=0, throughput=3.0)
    add(registry, 2, stage=1, throughput=1.0)
    add(registry, 3, stage=2, throughput=2.0)
    add(registry, 4, stage=3, throughput=2.5)
    assert registry.assign_stage() == 1
    add(registry, 5, stage=1, throughput=2.5)  # stage 1 now 3.5: stage 2 is weakest
    assert registry.assign_stage() == 2


def test_assign_stage_ties_fewest_replicas_then_lowest_index(registry):
    add(registry, 1, stage=0, throughput=2.0)
    add(registry, 2, stage=1, throughput=1.0)
    add(registry, 3, stage=1, throughput=1.0)
    add(registry, 4, stage=2, throughput=2.0)
    add(registry, 5, stage=3, throughput=2.0)
    assert registry.assign_stage() == 0  # all 2.0; stages 0, 2, 3 have one replica
    registry.deregister("s1")
    add(registry, 6, stage=0, throughput=1.0)
    add(registry, 7, stage=0, throughput=1.0)
    assert registry.assign_stage() == 2


def test_assign_stage_spreads_servers_that_ask_before_they_register(registry, clock):
    """Servers started together (a Deployment scaled to 6, stage auto) all ask before any
    registers: each hand-out counts until its server registers or the join window passes."""
    assert [registry.assign_stage() for _ in range(6)] == [0, 1, 2, 3, 0, 1]
    for n, stage in enumerate([0, 1, 2, 3, 0, 1]):
        add(registry, n + 1, stage=stage, throughput=1.0)  # each registration uses up its hand-out
    assert registry.assign_stage() == 2  # 2 and 3 have one replica each; no hand-out left over
    for _ in range(int(JOIN_WINDOW_S // (LEASE_S - 1)) + 1):  # the window passes; the servers heartbeat: live
        clock.advance(LEASE_S - 1)
        for n in range(1, 7):
            registry.heartbeat(f"s{n}", 1.0, 0)
    assert registry.assign_stage() == 2  # had the lapsed hand-out counted, stage 2 would have 2 and 3 be chosen


def test_a_slow_joiner_s_hand_out_still_counts_after_several_lease_periods(registry, clock):
    """A weak peer registers tens of seconds after its /assign: its stage stays covered
    meanwhile, so the next joiner goes to a stage with one replica, not a third to its own."""
    assert [registry.assign_stage() for _ in range(6)] == [0, 1, 2, 3, 0, 1]
    for n, stage in enumerate([0, 1, 2, 3, 1]):  # the second server of stage 0 is slow to start
        add(registry, n + 1, stage=stage, throughput=1.0)
    for _ in range(5):  # 25 s: five lease periods
        clock.advance(LEASE_S - 1)
        for n in range(1, 6):
            registry.heartbeat(f"s{n}", 1.0, 0)
    assert [p.stage for p in registry.pending_joins()] == [0]
    assert registry.assign_stage() in (2, 3)


def test_assign_stage_counts_zero_throughput_and_ignores_expired(registry, clock):
    for stage in range(4):
        add(registry, stage + 1, stage=stage, throughput=0.0)
    add(registry, 9, stage=0, throughput=0.0)
    assert registry.assign_stage() == 1  # capacities tie at 0; stage 0 has two replicas
    clock.advance(LEASE_S - 1)
    for n in (1, 2, 4, 9):
        registry.heartbeat(f"s{n}", 1.0, 0)
    clock.advance(2)  # only s3 (stage 2) missed its heartbeats
    assert registry.assign_stage() == 2


# --- upserts ------------------------------------------------------------------------------


def test_reregister_same_id_replaces_row(registry, clock):
    add(registry, 1, stage=0)
    clock.advance(1.0)
    server = registry.register("s1", 3, "http://127.0.0.99:8100/", "0.2.0", 7.0, 2)
    assert server.url == "http://127.0.0.99:8100"  # trailing '/' dropped
    (only,) = registry.live()
    assert only == server
    assert (only.stage, only.version, only.registered_at, only.last_heartbeat) == (3, "0.2.0", T0 + 1, T0 + 1)


def test_register_same_url_other_id_replaces_row(registry):
    add(registry, 1, stage=0)
    registry.register("restarted", 1, "http://127.0.0.11:8100", "0.1.0", 1.0, 0)
    assert ids(registry) == ["restarted"]
    with pytest.raises(UnknownServer):
        registry.heartbeat("s1", 1.0, 0)


def test_view_orders_stages_and_replicas_by_url(registry, clock):
    registry.register("b", 1, "http://b:1", "v", 1.5, 4)
    registry.register("a", 1, "http://a:1", "v", 2.0, 0)
    registry.register("c", 3, "http://c:1", "v", 0.0, 0)
    clock.advance(0.25)
    view = registry.view()
    assert (view["num_stages"], view["heartbeat_s"], view["lease_s"]) == (4, HEARTBEAT_S, LEASE_S)
    assert [s["stage"] for s in view["stages"]] == [0, 1, 2, 3]
    assert [s["capacity"] for s in view["stages"]] == [0.0, 3.5, 0.0, 0.0]
    assert [r["url"] for r in view["stages"][1]["replicas"]] == ["http://a:1", "http://b:1"]
    assert view["stages"][1]["replicas"][1] == {
        "server_id": "b",
        "url": "http://b:1",
        "version": "v",
        "throughput": 1.5,
        "queue_length": 4,
        "lease_age_s": 0.25,
        "registered_at": T0,
        "rtt_ms": {},
        "region": "",
        "link_mbit": 0.0,
    }


# --- validation and limits ----------------------------------------------------------------

GOOD = dict(server_id="s1", stage=0, url="http://h:1", version="v", throughput=1.0, queue_length=0)
BAD_FIELDS = [
    ("server_id", ""),
    ("server_id", "x" * 65),
    ("server_id", "a b"),
    ("server_id", "é"),
    ("server_id", 7),
    ("server_id", None),
    ("stage", "0"),
    ("stage", 1.0),
    ("stage", True),
    ("stage", None),
    ("url", "ftp://h/"),
    ("url", "h:1"),
    ("url", "http://"),
    ("url", "http://h:99999"),
    ("url", "http://h/" + "x" * 512),
    ("url", None),
    ("version", 1),
    ("version", "v" * 65),
    ("version", None),
    ("throughput", -1.0),
    ("throughput", math.nan),
    ("throughput", math.inf),
    ("throughput", "1"),
    ("throughput", True),
    ("throughput", None),
    ("queue_length", -1),
    ("queue_length", 1.0),
    ("queue_length", 2**31),
    ("queue_length", False),
    ("queue_length", None),
]


@pytest.mark.parametrize("field,value", BAD_FIELDS)
def test_register_rejects_bad_fields(registry, field, value):
    with pytest.raises(BadPayload, match=field):
        registry.register(**{**GOOD, field: value})
    assert registry.live() == []


@pytest.mark.parametrize("field,value", [("server_id", "a/b"), ("throughput", -0.5), ("queue_length", "3")])
def test_heartbeat_rejects_bad_fields(registry, field, value):
    add(registry, 1)
    good = dict(server_id="s1", throughput=1.0, queue_length=0)
    with pytest.raises(BadPayload, match=field):
        registry.heartbeat(**{**good, field: value})


@pytest.mark.parametrize("stage", [-1, 4, 10**6])
def test_register_stage_out_of_range(registry, stage):
    with pytest.raises(StageOutOfRange) as err:
        registry.register(**{**GOOD, "stage": stage})
    assert err.value.status == 409
    assert registry.live() == []


def test_max_servers(clock):
    reg = make_registry(clock, max_servers=2)
    add(reg, 1), add(reg, 2)
    with pytest.raises(RegistryFull) as err:
        add(reg, 3)
    assert isinstance(err.value, Overloaded) and err.value.status == 503
    assert ids(reg) == ["s1", "s2"]
    add(reg, 2, stage=1)  # re-registering a known server is not a new one
    reg.register("s9", 0, "http://127.0.0.11:8100", "v", 1.0, 0)  # nor is taking over a known URL
    assert ids(reg) == ["s9", "s2"]
    clock.advance(LEASE_S + 1)  # expired servers leave room even before expire() runs
    add(reg, 3), add(reg, 4)
    assert ids(reg) == ["s3", "s4"]
    reg.close()


def test_run_state_is_kept_in_the_file_and_tied_to_one_run(tmp_path, clock):
    path = str(tmp_path / "coordinator.sqlite")
    first = Registry(path, num_stages=2, heartbeat_s=1.0, clock=clock)
    first.bind_run("run-a")
    first.register("s0", 0, "http://127.0.0.1:1000", "v", 1.0, 0)
    first.record_checkpoint(120, "/ckpt/step-00000120")
    first.close()

    again = Registry(path, num_stages=2, heartbeat_s=1.0, clock=clock)
    again.bind_run("run-a")  # the same run comes back: allowed
    assert again.run_state() == {
        "run_id": "run-a",
        "step": 120,
        "checkpoint": "/ckpt/step-00000120",
        "assignment": [["s0"], []],
    }
    with pytest.raises(ValueError, match="belongs to run 'run-a'"):
        again.bind_run("run-b")
    again.close()
