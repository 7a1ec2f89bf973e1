"""Bench: joins. How soon a server that joins a training swarm serves its first microbatch.

One swarm of 2 stages (tiny model, int8 wire, heartbeats of 0.5 s, so leases of 1.5 s) and
one trainer in this process (following the registry every 0.5 s, 2 microbatches in flight)
that trains throughout:

- **cold**: ``swarm server --stage 1`` is started beside one replica of stage 1: seconds from
  its start (the process spawned) to the first forward it serves (its ``/health`` stats), with
  when it listened and when the coordinator listed it; then it is stopped (drained), and the
  next one starts. Importing torch, building the stage, downloading the stage's state from the
  live replica and registering are all in it.
- **standby**: every stage has two replicas, and a server started with ``--stage standby``
  waits (torch imported, nothing built). A replica of stage 1 is killed (SIGKILL); once its
  lease ends the coordinator hands the standby stage 1: seconds from that assignment (the
  standby leaves ``/swarm``'s standby list) to its first served forward, and from the kill.
  The standby, now a replica of stage 1, is the next one killed.

Each kind runs 5 times (2 with ``--quick``); the table gives the median, min and max. Targets
(issue 28): cold within 6 s of its start, standby within 2 s of its assignment, on an idle
machine: run it alone.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass

import aiohttp

from bench.processes import BenchProcesses, run_id
from bench.pump import MeshClient
from bench.report import BenchResult

COLUMNS = ["join", "runs", "median s", "min s", "max s", "target s", "listening (median s)", "listed (median s)"]
POLL_S = 0.05
JOIN_DEADLINE_S = 60.0  # a join that has served nothing by then failed
TARGETS = {"cold": 6.0, "standby": 2.0}
SERVED = ("forwards", "backwards")  # a stage's work (the last stage's forward is part of its backward)


@dataclass(frozen=True)
class Plan:
    runs: int
    seq_len: int
    microbatch_size: int
    in_flight: int


FULL = Plan(runs=5, seq_len=64, microbatch_size=4, in_flight=2)
QUICK = Plan(runs=2, seq_len=32, microbatch_size=2, in_flight=2)


def run(ctx) -> BenchResult:
    plan = QUICK if ctx.quick else FULL
    env = {
        "SWARM_HEARTBEAT_S": "0.5",
        "SWARM_WIRE_CODEC": "int8",
        "SWARM_GLOBAL_BATCH": str(4 * plan.in_flight * plan.microbatch_size),
        "SWARM_JOIN_TIMEOUT_S": "30",
        "SWARM_LOG_LEVEL": "info",
    }
    with BenchProcesses(run_id("joins"), ctx.logs("joins")) as procs:
        coordinator_name, coordinator = procs.coordinator(2, {"SWARM_HEARTBEAT_S": "0.5"})
        env["SWARM_COORDINATOR"] = coordinator
        urls = {coordinator_name: coordinator}
        for stage in (0, 1):
            name, urls[name] = procs.stage_server(stage, 2, env, name=f"stage{stage}-a")
        procs.wait_healthy(urls)
        cold, standby = asyncio.run(_joins(procs, coordinator, plan, env))
    rows = [
        _row("cold", cold, "from the process's start"),
        _row("standby", standby, "from the coordinator's assignment"),
    ]
    notes = [
        (
            f"2 stages (tiny model, int8 wire, heartbeats 0.5 s), one trainer with {plan.in_flight} microbatches of "
            f"{plan.microbatch_size} x {plan.seq_len} tokens in flight, training throughout; "
            f"{plan.runs} joins of each kind"
        ),
        "cold: seconds from the spawn of `swarm server --stage 1` to the first forward it served",
        (
            "standby: seconds from the coordinator's assignment to the first forward served; from the kill of the "
            "replica it replaced: "
            + ", ".join(f"{r['from_kill_s']:.2f}" for r in standby)
            + " s (the lease of 1.5 s first)"
        ),
    ]
    summary = {
        kind: statistics.median(r["first_s"] for r in runs) for kind, runs in (("cold", cold), ("standby", standby))
    }
    return BenchResult(
        "joins",
        "seconds from a server's start (cold) or its assignment (standby) to its first served microbatch",
        COLUMNS,
        rows,
        params=vars(plan),
        notes=notes,
        summary={f"{k}_median_s": v for k, v in summary.items()}
        | {f"{k}_target_s": t for k, t in TARGETS.items()}
        | {"cold_runs_s": [r["first_s"] for r in cold], "standby_runs_s": [r["first_s"] for r in standby]},
    )


def _row(kind: str, runs: list[dict], since: str) -> dict:
    firsts = [r["first_s"] for r in runs]
    return {
        "join": f"{kind} ({since})",
        "runs": len(runs),
        "median s": statistics.median(firsts),
        "min s": min(firsts),
        "max s": max(firsts),
        "target s": TARGETS[kind],
        "listening (median s)": statistics.median(r["listening_s"] for r in runs),
        "listed (median s)": statistics.median(r["listed_s"] for r in runs),
    }


async def _joins(procs: BenchProcesses, coordinator: str, plan: Plan, env: dict) -> tuple[list[dict], list[dict]]:
    async with MeshClient(
        run_id=procs.run_id,
        num_stages=2,
        codec="int8",
        seq_len=plan.seq_len,
        microbatch_size=plan.microbatch_size,
    ) as mesh:
        await mesh.use_coordinator(coordinator, refresh_s=0.5)
        stop = asyncio.Event()
        pump = asyncio.create_task(mesh.pump(in_flight=plan.in_flight, seconds=3600, stop=stop))
        try:
            cold = []
            for i in range(plan.runs):
                started = time.monotonic()
                name, url = procs.stage_server(1, 2, env, name=f"cold-{i}")
                cold.append(await _first_microbatch(mesh.session, coordinator, url, started))
                procs.stop([name])  # drained: it deregisters
                await _until(
                    lambda u=url: _listed(mesh.session, coordinator, u, present=False), "the cold joiner to leave"
                )
            replicas = {}
            for stage in (0, 1):
                name, url = procs.stage_server(stage, 2, env, name=f"stage{stage}-b")
                replicas[name] = url
            for name, url in replicas.items():
                await _until(lambda u=url: _listed(mesh.session, coordinator, u), f"{name} to register")
            victim = "stage1-b"
            standby = []
            for i in range(plan.runs):
                name, url = procs.stage_server(1, 2, {**env, "SWARM_STAGE": "standby"}, name=f"standby-{i}")
                await _until(lambda: _standbys(mesh.session, coordinator), "the standby to wait at the coordinator")
                killed = time.monotonic()
                procs.kill(victim)
                await _until(
                    lambda: _standbys(mesh.session, coordinator, waiting=False), "the coordinator to assign the standby"
                )
                assigned = time.monotonic()
                run = await _first_microbatch(mesh.session, coordinator, url, assigned)
                standby.append({**run, "from_kill_s": run["first_s"] + assigned - killed})
                victim = name
        finally:
            stop.set()
            await pump
    return cold, standby


async def _first_microbatch(session: aiohttp.ClientSession, coordinator: str, url: str, since: float) -> dict:
    """Seconds from ``since`` until ``url`` listens, is listed by the coordinator and has served a forward."""
    listening = listed = None
    deadline = since + JOIN_DEADLINE_S
    while time.monotonic() < deadline:
        health = await _get(session, url + "/health")
        now = time.monotonic()
        if health is not None:
            listening = listening or now
            if listed is None and await _listed(session, coordinator, url):
                listed = time.monotonic()
            stats = health.get("stats", {})
            if sum(stats.get(k, 0) for k in SERVED) > 0:
                return {"first_s": now - since, "listening_s": listening - since, "listed_s": (listed or now) - since}
        await asyncio.sleep(POLL_S)
    raise RuntimeError(
        f"{url} served no microbatch within {JOIN_DEADLINE_S:.0f} s (listening: {listening is not None}, "
        f"listed: {listed is not None}, its stats: {health and health.get('stats')})"
    )


async def _get(session: aiohttp.ClientSession, url: str) -> dict | None:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
            return await resp.json() if resp.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None


async def _listed(session: aiohttp.ClientSession, coordinator: str, url: str, present: bool = True) -> bool:
    swarm = await _get(session, coordinator + "/swarm")
    urls = {r["url"] for s in (swarm or {}).get("stages", []) for r in s["replicas"]}
    return swarm is not None and (url in urls) == present


async def _standbys(session: aiohttp.ClientSession, coordinator: str, waiting: bool = True) -> bool:
    """Does the coordinator list a standby waiting (``waiting``), or none (not ``waiting``)?"""
    swarm = await _get(session, coordinator + "/swarm")
    return swarm is not None and bool(swarm.get("standby")) == waiting


async def _until(condition, what: str, timeout_s: float = JOIN_DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        await asyncio.sleep(POLL_S)
