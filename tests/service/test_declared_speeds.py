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

from services.coordinator.app import create_app
from tests.conftest import coordinator_settings

RUN_ID = "speeds"
UNITS = (4, 4, 4, 2, 2, 2, 1, 1)  # in the order they ask
GFLOPS = 2.5e9  # one unit


async def form(client, declare: bool) -> list[float]:
    """The joiners ask ``/assign`` in order; the first four register (with their report)
    before the rest ask, the others after. Returns each stage's units."""
    stages: list[int] = []
    for n, units in enumerate(UNITS):
        body = {"run_id": RUN_ID, **({"speed_flops": units * GFLOPS} if declare else {})}
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
                }
                assert (await client.post("/register", json=reg)).status == 200
    held = [0.0] * 4
    for stage, units in zip(stages, UNITS):
        held[stage] += units
    return held


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


async def test_a_bad_declared_speed_is_refused(aiohttp_client):
    client = await aiohttp_client(create_app(coordinator_settings(run_id=RUN_ID, num_stages=4)))
    for bad in (-1.0, "fast", 2.0**71):
        resp = await client.post("/assign", json={"run_id": RUN_ID, "speed_flops": bad})
        assert resp.status == 400 and "speed_flops" in await resp.text(), bad
    reg = {
        "run_id": RUN_ID,
        "server_id": "s0",
        "stage": 0,
        "url": "http://127.0.0.1:9000",
        "version": "t",
        "throughput": 0.0,
        "queue_length": 0,
        "speed_flops": -5,
    }
    resp = await client.post("/register", json=reg)
    assert resp.status == 400 and "speed_flops" in await resp.text()
