"""Bench 5, churn: tokens/s with 2 replicas per stage, without faults and then with a
replica killed (SIGKILL) and a new one started in its place every 20 s.

One swarm (coordinator with leases of 3 heartbeats of 0.5 s, averaging every 10 s,
4 stages x 2 stage servers, int8 wire) and one trainer (this process, following the
coordinator's registry, 8 microbatches in flight) that trains throughout. The first
window has no faults; in the second, every 20 s one replica (of stage 0, 1, 2, 3, ... in
turn) is killed and a replacement for the same stage is started: it downloads the
stage's state from the surviving replica, registers and gets traffic. Both windows are
in the same run. Lost microbatches: those that failed every retry (the trainer retries a
failed hop on another replica of the stage).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp

from bench.processes import BenchProcesses, run_id
from bench.pump import MeshClient, registry_view
from bench.report import BenchResult

KILL_EVERY_S = 20.0
COLUMNS = [
    "window",
    "seconds",
    "tokens/s",
    "vs no faults",
    "kills",
    "lost microbatches",
    "live replica share",
    "kept / live",
]


@dataclass(frozen=True)
class Plan:
    stages: int
    replicas: int
    warmup_s: float
    calm_s: float
    faulty_s: float
    first_kill_s: float  # into the faulty window
    seq_len: int
    microbatch_size: int
    in_flight: int
    average_every_s: float


FULL = Plan(
    stages=4,
    replicas=2,
    warmup_s=5.0,
    calm_s=40.0,
    faulty_s=60.0,
    first_kill_s=2.0,
    seq_len=128,
    microbatch_size=8,
    in_flight=8,
    average_every_s=10.0,
)
QUICK = Plan(
    stages=2,
    replicas=2,
    warmup_s=1.0,
    calm_s=3.0,
    faulty_s=5.0,
    first_kill_s=0.5,
    seq_len=32,
    microbatch_size=4,
    in_flight=4,
    average_every_s=3.0,
)


def run(ctx) -> BenchResult:
    plan = QUICK if ctx.quick else FULL
    # the global batch is what the bench keeps in flight: no staler than one step (docs/architecture.md, Staleness)
    server_env = {
        "SWARM_HEARTBEAT_S": "0.5",
        "SWARM_WIRE_CODEC": "int8",
        "SWARM_GLOBAL_BATCH": str(plan.in_flight * plan.microbatch_size),
        "SWARM_JOIN_TIMEOUT_S": "30",
    }
    with BenchProcesses(run_id("churn"), ctx.logs("churn")) as procs:
        coordinator_name, coordinator = procs.coordinator(
            plan.stages, {"SWARM_HEARTBEAT_S": "0.5", "SWARM_AVERAGE_EVERY_S": str(plan.average_every_s)}
        )
        server_env["SWARM_COORDINATOR"] = coordinator
        stage_of, urls = {}, {coordinator_name: coordinator}
        for stage in range(plan.stages):
            for replica in range(plan.replicas):
                name, urls[name] = procs.stage_server(stage, plan.stages, server_env, name=f"stage{stage}-{replica}")
                stage_of[name] = stage
        procs.wait_healthy(urls)  # all at once: the servers register as soon as the coordinator answers
        windows, faults, failures = asyncio.run(_train(procs, coordinator, plan, server_env, stage_of))
    calm, faulty = windows
    live = 1.0 - sum(f["down_s"] for f in faults) / (plan.stages * plan.replicas * plan.faulty_s)
    ratio = faulty["tokens/s"] / calm["tokens/s"] if calm["tokens/s"] else float("nan")
    rows = [
        {"window": "no faults", **calm, "vs no faults": 1.0, "kills": 0, "live replica share": 1.0, "kept / live": 1.0},
        {
            "window": f"kill+restart every {KILL_EVERY_S:.0f} s",
            **faulty,
            "vs no faults": ratio,
            "kills": len(faults),
            "live replica share": live,
            "kept / live": ratio / live,
        },
    ]
    rejoin = [f["rejoin_s"] for f in faults if f["rejoin_s"] is not None]
    notes = [
        (
            f"{plan.stages} stages x {plan.replicas} replicas (tiny model, int8 wire, averaging every "
            f"{plan.average_every_s:.0f} s), one trainer with {plan.in_flight} microbatches in flight, in one run"
        ),
        (
            "live replica share: replica-seconds of the faulty window during which the replica was serving (a killed "
            "one counts as down until its replacement is in the registry)"
        ),
        "kills: "
        + "; ".join(
            f"stage {f['stage']} at {f['at_s']:.0f} s, replacement listed after {f['rejoin_s']:.1f} s"
            if f["rejoin_s"] is not None
            else f"stage {f['stage']} at {f['at_s']:.0f} s, replacement not listed by the end"
            for f in faults
        ),
    ]
    if failures:
        notes.append(f"last lost microbatch: {failures[-1]}")
    summary = {
        "kept_ratio": ratio,
        "lost_microbatches": calm["lost microbatches"] + faulty["lost microbatches"],
        "kills": len(faults),
        "mean_rejoin_s": sum(rejoin) / len(rejoin) if rejoin else None,
    }
    return BenchResult(
        "churn",
        "tokens/s with a replica killed and restarted every 20 s",
        COLUMNS,
        rows,
        params=vars(plan) | {"kill_every_s": KILL_EVERY_S},
        notes=notes,
        summary=summary,
    )


async def _train(procs: BenchProcesses, coordinator: str, plan: Plan, server_env: dict, stage_of: dict[str, int]):
    faults: list[dict] = []
    async with MeshClient(
        run_id=procs.run_id,
        num_stages=plan.stages,
        codec="int8",
        seq_len=plan.seq_len,
        microbatch_size=plan.microbatch_size,
    ) as mesh:
        await mesh.use_coordinator(coordinator, refresh_s=0.5)
        total = plan.warmup_s + plan.calm_s + plan.faulty_s
        pump = asyncio.create_task(mesh.pump(in_flight=plan.in_flight, seconds=total))
        started = time.monotonic()
        faulty_from = started + plan.warmup_s + plan.calm_s
        trackers = []
        kill_at = faulty_from + plan.first_kill_s
        while kill_at < started + total - 1.0:
            await asyncio.sleep(max(0.0, kill_at - time.monotonic()))
            stage = len(faults) % plan.stages
            victim = next(n for n, s in stage_of.items() if s == stage)  # the oldest replica of the stage
            procs.kill(victim)
            del stage_of[victim]
            name, url = procs.stage_server(stage, plan.stages, server_env, name=f"stage{stage}-r{len(faults)}")
            stage_of[name] = stage
            fault = {"stage": stage, "at_s": time.monotonic() - faulty_from, "rejoin_s": None, "down_s": 0.0}
            faults.append(fault)
            trackers.append(
                asyncio.create_task(
                    _track_rejoin(mesh.session, coordinator, url, stage, fault, time.monotonic(), started + total)
                )
            )
            kill_at += KILL_EVERY_S
        log = await pump
        await asyncio.gather(*trackers)
    lost_calm = sum(1 for c in log.completions if not c.ok and c.at < faulty_from)
    windows = [
        {
            "seconds": plan.calm_s,
            "tokens/s": log.tokens_per_s(started + plan.warmup_s, faulty_from),
            "lost microbatches": lost_calm,
        },
        {
            "seconds": plan.faulty_s,
            "tokens/s": log.tokens_per_s(faulty_from, started + total),
            "lost microbatches": log.failed - lost_calm,
        },  # stragglers included
    ]
    return windows, faults, log.failures


async def _track_rejoin(
    session: aiohttp.ClientSession,
    coordinator: str,
    url: str,
    stage: int,
    fault: dict,
    killed_at: float,
    window_end: float,
) -> None:
    """Record when the replacement appears in the registry (the replica is down until then)."""
    while time.monotonic() < window_end:
        try:
            if any(r["url"] == url for r in (await registry_view(session, coordinator))[stage]):
                fault["rejoin_s"] = time.monotonic() - killed_at
                break
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        await asyncio.sleep(0.2)
    fault["down_s"] = min(time.monotonic(), window_end) - killed_at
