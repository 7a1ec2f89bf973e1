"""mDNS discovery on loopback only: zeroconf is pinned to 127.0.0.1, IPv4."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from zeroconf import InterfaceChoice, IPVersion, ServiceStateChange
from zeroconf.asyncio import AsyncServiceBrowser, AsyncZeroconf

from shared.discovery import COORDINATOR_TYPE, STAGE_TYPE, Announcer, browse, find_coordinator, parse_interfaces

pytestmark = pytest.mark.timeout(60)

LOOPBACK = "127.0.0.1"


def new_run_id() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("all", InterfaceChoice.All),
        (" ALL ", InterfaceChoice.All),
        ("127.0.0.1", ["127.0.0.1"]),
        ("127.0.0.1, 127.0.0.5,", ["127.0.0.1", "127.0.0.5"]),
    ],
)
def test_parse_interfaces(spec, expected):
    assert parse_interfaces(spec) == expected


@pytest.mark.parametrize("spec", ["", " , ", "eth0", "127.0.0.1,not-an-ip", "::1", "256.0.0.1"])
def test_parse_interfaces_rejects_bad_specs(spec):
    with pytest.raises(ValueError, match="SWARM_MDNS_INTERFACES"):
        parse_interfaces(spec)


async def test_announcer_rejects_unreachable_url():
    async with Announcer(LOOPBACK) as announcer:
        with pytest.raises(ValueError, match="SWARM_ADVERTISE_URL"):
            await announcer.start(COORDINATOR_TYPE, "bad", "http://0.0.0.0:8000", {})
        with pytest.raises(ValueError, match="HOST:PORT"):
            await announcer.start(COORDINATOR_TYPE, "bad", "http://127.0.0.1", {})


async def test_stop_without_start_is_a_no_op():
    announcer = Announcer(LOOPBACK)
    await announcer.stop()
    await announcer.stop()


async def test_find_coordinator_by_run_id_and_not_another_run():
    run_id = new_run_id()
    url = "http://127.0.0.1:18000"
    async with Announcer(LOOPBACK) as announcer:
        await announcer.start(COORDINATOR_TYPE, f"coordinator-{run_id}", url, {"run_id": run_id, "version": "1"})
        assert await find_coordinator(run_id, interfaces_spec=LOOPBACK, timeout_s=5.0) == url

        other = await browse(COORDINATOR_TYPE, interfaces_spec=LOOPBACK, timeout_s=1.5, match={"run_id": new_run_id()})
        assert other == []


async def test_stop_sends_goodbye():
    run_id = new_run_id()
    instance = f"coordinator-{run_id}"
    full_name = f"{instance}.{COORDINATOR_TYPE}"
    # A browser that outlives the announcer: without a goodbye it would keep the record
    # for many minutes; with one it sees the service removed within about a second.
    changes: dict[ServiceStateChange, asyncio.Event] = {s: asyncio.Event() for s in ServiceStateChange}

    def on_change(zeroconf, service_type, name, state_change):
        if name == full_name:
            changes[state_change].set()

    watcher = AsyncZeroconf(interfaces=[LOOPBACK], ip_version=IPVersion.V4Only)
    browser = AsyncServiceBrowser(watcher.zeroconf, COORDINATOR_TYPE, handlers=[on_change])
    try:
        announcer = Announcer(LOOPBACK)
        await announcer.start(COORDINATOR_TYPE, instance, "http://127.0.0.1:18002", {"run_id": run_id})
        await asyncio.wait_for(changes[ServiceStateChange.Added].wait(), 5.0)
        await announcer.stop()
        await announcer.stop()  # twice is fine
        await asyncio.wait_for(changes[ServiceStateChange.Removed].wait(), 5.0)
    finally:
        await browser.async_cancel()
        await watcher.async_close()

    assert await find_coordinator(run_id, interfaces_spec=LOOPBACK, timeout_s=1.5) is None


async def test_browse_stage_servers_by_stage():
    run_id = new_run_id()
    async with Announcer(LOOPBACK) as stage1, Announcer(LOOPBACK) as stage2:
        await asyncio.gather(
            stage1.start(STAGE_TYPE, f"stage-1-{run_id}", "http://localhost:18101", {"run_id": run_id, "stage": "1"}),
            stage2.start(STAGE_TYPE, f"stage-2-{run_id}", "http://127.0.0.1:18102", {"run_id": run_id, "stage": "2"}),
        )
        # Both browses share the responders' answers; the second collects until its timeout.
        stage2_only, whole_run = await asyncio.gather(
            browse(STAGE_TYPE, interfaces_spec=LOOPBACK, timeout_s=5.0, match={"stage": "2", "run_id": run_id}),
            browse(STAGE_TYPE, interfaces_spec=LOOPBACK, timeout_s=3.0, match={"run_id": run_id}, first_only=False),
        )
    assert stage2_only == [
        {
            "name": f"stage-2-{run_id}.{STAGE_TYPE}",
            "url": "http://127.0.0.1:18102",
            "properties": {"run_id": run_id, "stage": "2", "url": "http://127.0.0.1:18102"},
        }
    ]
    assert sorted(r["url"] for r in whole_run) == ["http://127.0.0.1:18102", "http://localhost:18101"]
