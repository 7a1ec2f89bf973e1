"""Service tests of the coordinator through its real aiohttp app (``aiohttp_client``):
register / heartbeat / deregister / assign / swarm / health round trips, and every bad
request refused with the right status and a JSON error, leaving the registry unchanged.

Leases run on a fake clock injected through the :class:`Registry`; nothing sleeps.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from structlog.testing import capture_logs

from services.coordinator.__main__ import main
from services.coordinator.app import build_registry, create_app, expire_leases
from services.coordinator.registry import Registry, ServerReport
from services.coordinator.routes import LOG, MAX_BODY_BYTES, REGISTRY
from shared.config import CoordinatorSettings
from tests.conftest import coordinator_settings, until

RUN_ID = "test-run"
HEARTBEAT_S, LEASE_S = 2.0, 6.0
T0 = 1_700_000_000.0


class FakeClock:
    def __init__(self):
        self.now = T0

    def __call__(self) -> float:
        return self.now


def settings(**overrides) -> CoordinatorSettings:
    return coordinator_settings(**{"run_id": RUN_ID, "heartbeat_s": HEARTBEAT_S, **overrides})


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def start(aiohttp_client, clock):
    """``await start(**settings_overrides)`` -> (client, registry on the fake clock)."""
    registries = []

    async def _start(**overrides):
        s = settings(**overrides)
        reg = Registry(
            ":memory:", num_stages=s.num_stages, heartbeat_s=s.heartbeat_s, max_servers=s.max_servers, clock=clock
        )
        registries.append(reg)
        return await aiohttp_client(create_app(s, reg)), reg

    yield _start
    for reg in registries:
        reg.close()


def server(n: int = 1, stage: int = 0, **overrides) -> dict:
    body = dict(
        run_id=RUN_ID,
        server_id=f"s{n}",
        stage=stage,
        url=f"http://127.0.0.1{n}:8100",
        version="0.1.0",
        throughput=1.0,
        queue_length=0,
    )
    return {**body, **overrides}


async def ok(resp) -> dict:
    assert resp.status == 200, await resp.text()
    assert resp.content_type == "application/json"
    return await resp.json()


async def assert_json_error(resp, status: int, code: str, fragment: str = "") -> None:
    assert resp.status == status, await resp.text()
    assert resp.content_type == "application/json"
    err = (await resp.json())["error"]
    assert err["code"] == code
    assert fragment in err["message"]


# --------------------------------------------------------------------------- round trips


async def test_register_heartbeat_deregister_round_trip(start, clock):
    client, reg = await start()
    with capture_logs() as logs:
        body = await ok(await client.post("/register", json=server(1, stage=2, throughput=4.0)))
        assert body == {"server_id": "s1", "stage": 2, "heartbeat_s": HEARTBEAT_S, "lease_s": LEASE_S}
        clock.now += 1.5
        assert await ok(
            await client.post("/heartbeat", json={"server_id": "s1", "throughput": 5.0, "queue_length": 3})
        ) == {"lease_s": LEASE_S}
        clock.now += 0.5
        swarm = await ok(await client.get("/swarm"))
        assert await ok(await client.post("/deregister", json={"server_id": "s1"})) == {"removed": True}
        assert await ok(await client.post("/deregister", json={"server_id": "s1"})) == {"removed": False}
    assert (swarm["run_id"], swarm["num_stages"], swarm["heartbeat_s"], swarm["lease_s"]) == (
        RUN_ID,
        4,
        HEARTBEAT_S,
        LEASE_S,
    )
    assert [s["capacity"] for s in swarm["stages"]] == [0.0, 0.0, 5.0, 0.0]
    assert swarm["stages"][2]["replicas"] == [
        {
            "server_id": "s1",
            "url": "http://127.0.0.11:8100",
            "version": "0.1.0",
            "throughput": 5.0,
            "queue_length": 3,
            "lease_age_s": 0.5,
            "registered_at": T0,
            "rtt_ms": {},
            "region": "",
            "link_mbit": 0.0,
            "spare": False,  # its stage's only replica
        }
    ]
    assert reg.live() == []
    events = [(e["event"], e.get("server_id"), e.get("removed")) for e in logs if e["event"].startswith("registry.")]
    assert events == [
        ("registry.registered", "s1", None),
        ("registry.deregistered", "s1", True),
        ("registry.deregistered", "s1", False),
    ]


async def test_swarm_orders_replicas_by_url_and_ignores_unknown_fields(start):
    client, _ = await start()
    for n, stage in [(3, 1), (2, 1), (1, 0)]:
        await ok(await client.post("/register", json=server(n, stage, future_field={"x": 1})))
    swarm = await ok(await client.get("/swarm"))
    assert [[r["server_id"] for r in s["replicas"]] for s in swarm["stages"]] == [["s1"], ["s2", "s3"], [], []]


async def test_servers_report_region_and_workload_for_placement(start):
    client, reg = await start()
    await ok(
        await client.post(
            "/register", json=server(1, stage=2, region="Oregon", workload={"parameters": 1000, "samples_per_step": 16})
        )
    )
    assert reg.reports["s1"] == ServerReport("Oregon", 1000, 16, 0.0)
    beat = {"server_id": "s1", "throughput": 2.0, "queue_length": 0, "region": "Oregon"}
    await ok(
        await client.post(
            "/heartbeat",
            json={
                **beat,
                "workload": {"parameters": 1000, "samples_per_step": 16, "activation_bytes_per_sample": 4096.5},
            },
        )
    )
    assert reg.reports["s1"] == ServerReport("Oregon", 1000, 16, 4096.5)
    assert (await ok(await client.get("/swarm")))["stages"][2]["replicas"][0]["region"] == "Oregon"
    await ok(
        await client.post("/heartbeat", json={"server_id": "s1", "throughput": 2.0, "queue_length": 0})
    )  # an old server: report kept
    assert reg.reports["s1"].activation_bytes_per_sample == 4096.5
    await ok(await client.post("/deregister", json={"server_id": "s1"}))
    assert reg.reports == {}


async def test_assign_picks_the_weakest_stage(start):
    client, _ = await start()
    assert await ok(await client.post("/assign", json={"run_id": RUN_ID})) == {"stage": 0, "placement": "throughput"}
    await ok(await client.post("/register", json=server(1, stage=0, throughput=2.0)))
    await ok(await client.post("/register", json=server(2, stage=1, throughput=2.0)))
    await ok(await client.post("/register", json=server(3, stage=3, throughput=1.0)))
    assert await ok(await client.post("/assign", json={"run_id": RUN_ID})) == {"stage": 2, "placement": "throughput"}
    await ok(await client.post("/register", json=server(4, stage=2, throughput=3.0)))
    assert await ok(await client.post("/assign", json={"run_id": RUN_ID})) == {"stage": 3, "placement": "throughput"}


async def test_health_counts_live_servers(start, clock):
    client, _ = await start()
    assert {k: v for k, v in (await ok(await client.get("/health"))).items() if k != "traffic"} == {
        "status": "ok",
        "servers": 0,
        "placement_settled": 0,  # no rebalancing here
    }
    await ok(await client.post("/register", json=server(1)))
    await ok(await client.post("/register", json=server(2)))
    assert {k: v for k, v in (await ok(await client.get("/health"))).items() if k != "traffic"} == {
        "status": "ok",
        "servers": 2,
        "placement_settled": 0,  # no rebalancing here
    }
    clock.now += LEASE_S + 0.1
    assert {k: v for k, v in (await ok(await client.get("/health"))).items() if k != "traffic"} == {
        "status": "ok",
        "servers": 0,
        "placement_settled": 0,  # no rebalancing here
    }


async def test_reregister_replaces_the_row(start):
    client, reg = await start()
    await ok(await client.post("/register", json=server(1, stage=0)))
    await ok(await client.post("/register", json=server(1, stage=3, url="http://new:1")))
    await ok(await client.post("/register", json=server(2, stage=1, url="http://new:1")))  # same URL, other id
    assert [(s.server_id, s.stage, s.url) for s in reg.live()] == [("s2", 1, "http://new:1")]


# --------------------------------------------------------------------------- leases


async def test_lease_expires_after_three_missed_heartbeats(start, clock):
    client, reg = await start()
    await ok(await client.post("/register", json=server(1)))
    clock.now += LEASE_S
    await ok(await client.post("/heartbeat", json={"server_id": "s1", "throughput": 1.0, "queue_length": 0}))
    clock.now += LEASE_S + 0.001
    resp = await client.post("/heartbeat", json={"server_id": "s1", "throughput": 1.0, "queue_length": 0})
    await assert_json_error(resp, 404, "unknown_server", "register again")
    assert (await ok(await client.get("/swarm")))["stages"][0]["replicas"] == []
    with capture_logs() as logs:
        expired = expire_leases(reg, client.app[LOG])
    assert [s.server_id for s in expired] == ["s1"]
    assert [(e["event"], e["server_id"], e["stage"]) for e in logs] == [("registry.expired", "s1", 0)]
    await ok(await client.post("/register", json=server(1)))  # the server comes back by registering
    await ok(await client.post("/heartbeat", json={"server_id": "s1", "throughput": 1.0, "queue_length": 0}))


async def test_heartbeat_of_unknown_server_is_404(start):
    client, _ = await start()
    resp = await client.post("/heartbeat", json={"server_id": "ghost", "throughput": 1.0, "queue_length": 0})
    await assert_json_error(resp, 404, "unknown_server", "'ghost'")


async def test_expire_loop_stops_with_the_app(start):
    client, _ = await start()
    assert [t for t in asyncio.all_tasks() if t.get_name() == "registry.expire"]
    await client.close()
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "registry.expire"]


async def test_state_survives_a_restart(aiohttp_client, tmp_path):
    s = settings(state_db=str(tmp_path / "coordinator.sqlite"), heartbeat_s=60.0)
    client = await aiohttp_client(create_app(s))
    await ok(await client.post("/register", json=server(1, stage=3)))
    await client.close()
    client = await aiohttp_client(create_app(s))
    swarm = await ok(await client.get("/swarm"))
    assert [r["server_id"] for r in swarm["stages"][3]["replicas"]] == ["s1"]
    await ok(await client.post("/heartbeat", json={"server_id": "s1", "throughput": 1.0, "queue_length": 0}))


# --------------------------------------------------------------------------- refusals

BAD_REGISTER = [
    ({"server_id": "a b"}, "server_id"),
    ({"server_id": None}, "server_id"),
    ({"stage": "1"}, "stage"),
    ({"url": "ftp://x"}, "url"),
    ({"url": 5}, "url"),
    ({"version": ["1"]}, "version"),
    ({"throughput": -1}, "throughput"),
    ({"throughput": "fast"}, "throughput"),
    ({"queue_length": -3}, "queue_length"),
    ({"queue_length": 0.5}, "queue_length"),
    ({"run_id": 7}, "run_id"),
    ({"region": "Tokyo 2"}, "region"),
    ({"region": 5}, "region"),
    ({"region": "x" * 65}, "region"),
    ({"workload": [1]}, "workload"),
    ({"workload": {"parameters": -1}}, "workload.parameters"),
    ({"workload": {"parameters": 1.5}}, "workload.parameters"),
    ({"workload": {"samples_per_step": "32"}}, "workload.samples_per_step"),
    ({"workload": {"activation_bytes_per_sample": float("nan")}}, "workload.activation_bytes_per_sample"),
    ({"workload": {"activation_bytes_per_sample": -1.0}}, "workload.activation_bytes_per_sample"),
    ({"step": -1}, "step"),
    ({"step": 1.0}, "step"),
    ({"step": "3"}, "step"),
]


@pytest.fixture
async def populated(start):
    """A coordinator with two servers, and a function that asserts its registry is as it was."""
    client, reg = await start(max_servers=2)
    await ok(await client.post("/register", json=server(1, stage=0)))
    await ok(
        await client.post(
            "/register", json=server(2, stage=1, region="Tokyo", workload={"parameters": 10, "samples_per_step": 32})
        )
    )
    before, reports_before, pending_before = reg.view(), dict(reg.reports), reg.pending_joins()

    def unchanged():
        assert reg.view() == before and reg.reports == reports_before and reg.pending_joins() == pending_before

    return client, unchanged


@pytest.mark.parametrize("change,field", BAD_REGISTER)
async def test_register_bad_field_is_400(populated, change, field):
    client, unchanged = populated
    resp = await client.post("/register", json={**server(1, stage=2), **change})  # s1 moving, were it valid
    await assert_json_error(resp, 400, "bad_payload", field)
    unchanged()


async def test_register_missing_field_is_400(populated):
    client, unchanged = populated
    body = server(3)
    del body["throughput"]
    await assert_json_error(await client.post("/register", json=body), 400, "bad_payload", "throughput")
    unchanged()


@pytest.mark.parametrize("path", ["/heartbeat", "/deregister"])
async def test_heartbeat_and_deregister_bad_server_id_is_400(populated, path):
    client, unchanged = populated
    resp = await client.post(path, json={"server_id": "../etc", "throughput": 1.0, "queue_length": 0})
    await assert_json_error(resp, 400, "bad_payload", "server_id")
    unchanged()


@pytest.mark.parametrize("change,field", [c for c in BAD_REGISTER if set(c[0]) <= {"region", "workload"}])
async def test_heartbeat_bad_report_is_400(populated, change, field):
    client, unchanged = populated
    resp = await client.post("/heartbeat", json={"server_id": "s2", "throughput": 3.0, "queue_length": 1, **change})
    await assert_json_error(resp, 400, "bad_payload", field)
    unchanged()


@pytest.mark.parametrize(
    "change,field",
    [
        ({"region": "a/b"}, "region"),
        ({"rtt_ms": {"http://x:1": -1}}, "rtt_ms"),
        ({"rtt_ms": [1]}, "rtt_ms"),
        ({"rtt_ms": {"ftp://x": 1.0}}, "url"),
    ],
)
async def test_assign_bad_joiner_is_400(populated, change, field):
    client, unchanged = populated
    resp = await client.post("/assign", json={"run_id": RUN_ID, **change})
    await assert_json_error(resp, 400, "bad_payload", field)
    unchanged()


async def test_heartbeat_bad_load_is_400(populated):
    client, unchanged = populated
    resp = await client.post("/heartbeat", json={"server_id": "s1", "throughput": 1.0, "queue_length": -1})
    await assert_json_error(resp, 400, "bad_payload", "queue_length")
    unchanged()


@pytest.mark.parametrize("body", [b"{", b"[1, 2]", b'"s1"', b"\xff\xfe\x00", b"", b"[" * 40_000])
async def test_body_that_is_not_a_json_object_is_400(populated, body):
    client, unchanged = populated
    resp = await client.post("/register", data=body, headers={"Content-Type": "application/json"})
    await assert_json_error(resp, 400, "bad_payload")
    unchanged()


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999"])
async def test_non_finite_throughput_is_400(populated, number):
    client, unchanged = populated
    body = json.dumps(server(3, throughput=0.5)).replace("0.5", number)  # json.loads reads all four
    resp = await client.post("/register", data=body, headers={"Content-Type": "application/json"})
    await assert_json_error(resp, 400, "bad_payload", "throughput")
    unchanged()


@pytest.mark.parametrize("path", ["/register", "/assign"])
async def test_wrong_run_is_409(populated, path):
    client, unchanged = populated
    resp = await client.post(path, json=server(3, run_id="other-run"))
    await assert_json_error(resp, 409, "wrong_run", "'other-run'")
    unchanged()


async def test_stage_out_of_range_is_409(populated):
    client, unchanged = populated
    resp = await client.post("/register", json=server(3, stage=4))
    await assert_json_error(resp, 409, "stage_out_of_range", "SWARM_NUM_STAGES")
    unchanged()


async def test_registry_full_is_503(populated):
    client, unchanged = populated
    resp = await client.post("/register", json=server(3))
    await assert_json_error(resp, 503, "registry_full", "SWARM_MAX_SERVERS")
    assert resp.headers["Retry-After"] == "6"
    unchanged()


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/msgpack", "application/x-www-form-urlencoded", None]
)
@pytest.mark.parametrize("path", ["/register", "/assign", "/heartbeat", "/deregister"])
async def test_wrong_content_type_is_415(populated, path, content_type):
    client, unchanged = populated
    headers = {"Content-Type": content_type} if content_type else {}
    resp = await client.post(
        path, data=json.dumps(server(3)).encode(), headers=headers, skip_auto_headers=["Content-Type"]
    )
    await assert_json_error(resp, 415, "unsupported_media_type", "application/json")
    unchanged()


async def test_body_over_64_kib_is_413(populated):
    client, unchanged = populated
    body = json.dumps(server(3, padding="x" * MAX_BODY_BYTES)).encode()
    resp = await client.post("/register", data=body, headers={"Content-Type": "application/json"})
    await assert_json_error(resp, 413, "payload_too_large", str(MAX_BODY_BYTES))
    unchanged()


async def test_chunked_body_over_64_kib_is_413(populated):
    client, unchanged = populated

    async def chunks():
        yield b'{"padding": "'
        for _ in range(MAX_BODY_BYTES // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    resp = await client.post("/register", data=chunks(), headers={"Content-Type": "application/json"})
    await assert_json_error(resp, 413, "payload_too_large", str(MAX_BODY_BYTES))
    unchanged()


async def test_unknown_path_and_method_are_json(populated):
    client, unchanged = populated
    await assert_json_error(await client.get("/nowhere"), 404, "not_found")
    await assert_json_error(await client.get("/register"), 405, "method_not_allowed")
    unchanged()


async def test_coordinator_keeps_serving_after_refusals(populated):
    client, _ = populated
    await client.post("/register", data=b"{", headers={"Content-Type": "application/json"})
    await client.post("/register", data=b"x", headers={"Content-Type": "text/plain"})
    assert {k: v for k, v in (await ok(await client.get("/health"))).items() if k != "traffic"} == {
        "status": "ok",
        "servers": 2,
        "placement_settled": 0,  # no rebalancing here
    }


# --------------------------------------------------------------------------- start-up


def test_bad_state_db_names_the_setting(tmp_path):
    with pytest.raises(ValueError, match="SWARM_STATE_DB"):
        build_registry(settings(state_db=str(tmp_path)))  # a directory
    not_sqlite = tmp_path / "notes.txt"
    not_sqlite.write_text("not a database, but long enough to look like a file header " * 10)
    with pytest.raises(ValueError, match="SWARM_STATE_DB"):
        build_registry(settings(state_db=str(not_sqlite)))


def test_main_exits_2_on_a_bad_state_db(tmp_path, capsys):
    assert main(["--run-id", RUN_ID, "--mdns", "false", "--state-db", str(tmp_path)]) == 2
    assert "SWARM_STATE_DB" in capsys.readouterr().err


def test_registry_key_holds_the_given_registry(clock):
    reg = Registry(":memory:", num_stages=4, heartbeat_s=HEARTBEAT_S, clock=clock)
    assert create_app(settings(), reg)[REGISTRY] is reg
    reg.close()


async def test_a_standby_server_waits_while_every_stage_has_two_replicas_and_takes_a_stage_that_lost_one(start, clock):
    """``/assign`` with ``standby``: held while every stage has two replicas (answered with
    no stage after ``wait_s``); a stage left with one replica takes the standby that is
    waiting, at once, and a second standby is not sent after it (the first is a pending join)."""
    client, reg = await start(num_stages=2)
    for n, stage in ((1, 0), (2, 0), (3, 1), (4, 1)):
        await ok(await client.post("/register", json=server(n, stage=stage)))
    ask = {"run_id": RUN_ID, "standby": True, "server_id": "standby-a", "wait_s": 0}
    assert await ok(await client.post("/assign", json=ask)) == {
        "stage": None,
        "placement": "standby",
        "reason": "every stage has two replicas",
    }
    assert (await ok(await client.get("/swarm")))["standby"] == [{"server_id": "standby-a", "region": ""}]
    held = asyncio.ensure_future(client.post("/assign", json={**ask, "server_id": "standby-h", "wait_s": 10}))
    await until(lambda: {"server_id": "standby-h", "region": ""} in reg.standbys(), 5, "the standby's ask to be held")
    assert not held.done()  # held open: every stage still has two replicas
    await ok(await client.post("/deregister", json={"server_id": "s3"}))  # stage 1 is down to one replica
    reply = await ok(await asyncio.wait_for(held, 5))
    assert reply["stage"] == 1 and reply["placement"] == "standby" and "one replica" in reply["reason"]
    assert (await ok(await client.get("/swarm")))["standby"] == [{"server_id": "standby-a", "region": ""}]
    other = {**ask, "server_id": "standby-b"}
    assert (await ok(await client.post("/assign", json=other)))["stage"] is None  # the pending join counts
    assert (await client.post("/assign", json={**ask, "wait_s": -1})).status == 400
    assert (await client.post("/assign", json={**ask, "server_id": 7})).status == 400
