"""Joins placed by declared speeds, through the coordinator's real app (``/assign`` and
``/register``): as a swarm forms no server has served, so every throughput reads 0 and
the join rule could only spread servers by count; a ``--stage auto`` server measures its
speed as it joins (``SWARM_SPEED_FLOPS``) and declares it.

The arena's heterogeneous peers (CPU caps 4:4:4:2:2:2:1:1, the strong ones start sooner
and so ask first): with the speeds declared every stage gets at least 4 units, the best
any placement of them can do; with none, the last stage is left with 2 + 1.
"""

from __future__ import annotations

import itertools

import pytest

from services.coordinator.app import create_app
from tests.conftest import coordinator_settings

RUN_ID = "speeds"
UNITS = (4, 4, 4, 2, 2, 2, 1, 1)  # in the order they ask
GFLOPS = 2.5e9  # one unit


async def form(client, declare: bool, links: tuple[float, ...] = ()) -> list[float]:
    """The joiners ask ``/assign`` in order; the first four register (with their report)
    before the rest ask, the others after; ``links``: each one's declared link (Mbit/s).
    Returns each stage's units."""
    return (await form_stages(client, declare, links))[0]


async def form_stages(client, declare: bool, links: tuple[float, ...] = ()) -> tuple[list[float], list[int]]:
    """:func:`form`, and the stage each joiner got."""
    stages: list[int] = []
    for n, units in enumerate(UNITS):
        body = {"run_id": RUN_ID, **({"speed_flops": units * GFLOPS} if declare else {})}
        if links:
            body["link_mbit"] = links[n]
        resp = await client.post("/assign", json=body)
        assert resp.status == 200, await resp.text()
        stages.append((await resp.json())["stage"])
        if n in (3, 7):  # a batch registers: the strong ones while the weak still start
            for m in range(n - 3, n + 1):
                reg = {
                    "run_id": RUN_ID,
                    "server_id": f"s{m}",
                    "stage": stages[m],
                    "url": f"http://127.0.0.1:{9000 + m}",
                    "version": "t",
                    "throughput": 0.0,  # not served yet
                    "queue_length": 0,
                    **({"speed_flops": UNITS[m] * GFLOPS} if declare else {}),
                    **({"link_mbit": links[m]} if links else {}),
                }
                assert (await client.post("/register", json=reg)).status == 200
    held = [0.0] * 4
    for stage, units in zip(stages, UNITS):
        held[stage] += units
    return held, stages


def best_minimum() -> float:
    """The largest weakest-stage capacity any placement of the units on 4 stages gives."""
    best = 0.0
    for placement in itertools.product(range(4), repeat=len(UNITS)):
        held = [0.0] * 4
        for stage, units in zip(placement, UNITS):
            held[stage] += units
        best = max(best, min(held))
    return best


async def test_joiners_that_declare_their_speed_are_placed_so_that_no_stage_is_weak(aiohttp_client):
    app = create_app(coordinator_settings(run_id=RUN_ID, num_stages=4))
    held = await form(await aiohttp_client(app), declare=True)
    assert min(held) == best_minimum() == 4.0, held
    assert sorted(held) == [4.0, 5.0, 5.0, 6.0], held


async def test_without_declared_speeds_joins_are_spread_by_count_only(aiohttp_client):
    """The same joins with no speed declared (every throughput 0): two replicas a stage, but
    the weak peers land where the count rule puts them, a stage of 2 + 1 units."""
    app = create_app(coordinator_settings(run_id=RUN_ID, num_stages=4))
    held = await form(await aiohttp_client(app), declare=False)
    assert min(held) == 3.0, held


# The arena's links by the order above (4, 4, 4, 2, 2, 2, 1, 1 units): one 2-unit peer on 10 Mbit/s
FAST_2 = (50.0, 100.0)  # the other 2-unit peers' links


def arena_links(slow_at: int) -> tuple[float, ...]:
    """The links of the joiners, the 10 Mbit/s 2-unit peer asking ``slow_at``-th of the three 2-unit ones."""
    two = list(FAST_2)
    two.insert(slow_at, 10.0)
    return (20.0, 50.0, 100.0, *two, 100.0, 20.0)


async def test_a_joiner_on_a_slow_link_takes_the_strongest_stage_of_its_need(aiohttp_client):
    """Every step a stage's replicas all-reduce its gradient at the pace of their slowest
    link: the arena's 10 Mbit/s 2-unit peer asking second of the 2-unit ones went to the
    stage of 2 + 2 units (the least capacity), whose round it held to 0.8-0.9 s a step;
    declaring links it joins a 4-unit peer, and the weakest stage gets the two fast ones.
    Asking first it fills the empty stage all the same: need comes first."""
    for slow_at, with_links in ((1, True), (2, True), (1, False), (0, True)):
        app = create_app(coordinator_settings(run_id=RUN_ID, num_stages=4))
        links = arena_links(slow_at)
        held, stages = await form_stages(await aiohttp_client(app), True, links if with_links else ())
        assert sorted(held) == [4.0, 5.0, 5.0, 6.0], (slow_at, with_links, held)  # the speeds still place first
        slow_stage = stages[3 + slow_at]
        if slow_at == 0:  # the first 2-unit joiner fills the empty stage, slow link or not
            assert held[slow_stage] == 4.0, held
        elif with_links:
            assert held[slow_stage] == 6.0, (slow_at, held, stages)  # beside a 4-unit peer
        else:
            assert held[slow_stage] == 4.0, (slow_at, held, stages)  # without links: the 2 + 2 stage


async def test_links_are_left_out_unless_every_server_declared_one(aiohttp_client):
    """One server that declared no link: placement does not know the links, and the slow
    joiner lands where the speeds alone put it (the 2 + 2 stage)."""
    app = create_app(coordinator_settings(run_id=RUN_ID, num_stages=4))
    links = list(arena_links(1))
    links[0] = 0.0  # the first server declares none
    held, stages = await form_stages(await aiohttp_client(app), True, tuple(links))
    assert held[stages[4]] == 4.0, (held, stages)


@pytest.mark.parametrize(
    "field, bads", [("speed_flops", (-1.0, "fast", 2.0**71)), ("link_mbit", (-1.0, "slow", 1e8, float("inf")))]
)
async def test_a_bad_declared_speed_or_link_is_refused(aiohttp_client, field, bads):
    client = await aiohttp_client(create_app(coordinator_settings(run_id=RUN_ID, num_stages=4)))
    for bad in bads:
        resp = await client.post("/assign", json={"run_id": RUN_ID, field: bad})
        assert resp.status == 400 and field in await resp.text(), bad
    reg = {
        "run_id": RUN_ID,
        "server_id": "s0",
        "stage": 0,
        "url": "http://127.0.0.1:9000",
        "version": "t",
        "throughput": 0.0,
        "queue_length": 0,
        field: -5,
    }
    resp = await client.post("/register", json=reg)
    assert resp.status == 400 and field in await resp.text()


async def test_the_swarm_marks_the_replicas_whose_stage_does_not_need_them_as_hot_spares(aiohttp_client):
    """Formed as above, GET /swarm marks as spares the 1-unit peers and the 2-unit peer beside
    a 4-unit one (their stages keep 4 units without them, the weakest stage's 2 + 2), so the
    trainers route nothing to them and their step rounds cost little; off with
    SWARM_HOT_SPARES=false."""
    for hot_spares in (True, False):
        app = create_app(coordinator_settings(run_id=RUN_ID, num_stages=4, hot_spares=hot_spares))
        client = await aiohttp_client(app)
        held, stages = await form_stages(client, True)
        view = await (await client.get("/swarm")).json()
        spare_units = sorted(
            UNITS[int(r["server_id"][1:])] for s in view["stages"] for r in s["replicas"] if r["spare"] is True
        )
        if hot_spares:
            assert spare_units == [1, 1, 2], (held, view)
            weakest = min(range(4), key=lambda s: held[s])
            assert not any(r["spare"] for r in view["stages"][weakest]["replicas"])
            assert all(sum(not r["spare"] for r in s["replicas"]) >= 1 for s in view["stages"])
        else:
            assert spare_units == [], view
