"""Bench 6, rebalancing: replicas of speeds 1:2:4 started on a bad assignment.

Three stage servers of a 2-stage model, made slow by injected delays (``SWARM_INJECT_DELAY_S``:
seconds per forward pass of work) of 4x, 2x and 1x a base delay, so their speeds are
1:2:4 whatever the CPU does. They start on the worst assignment, the speed-1 replica
alone on stage 0 and the other two on stage 1, with the coordinator rebalancing every
few seconds (a move needs the same best move on 2 checks in a row and a gain of 1/0.75).
One trainer (this process, following the registry) trains throughout; measured: when the
coordinator moved a replica, tokens/s once the moved server has rejoined, and whether
anything moves again. A second swarm, started at the same time, without coordinator,
has servers of the same speeds placed both ways: there the trainer is given the URLs of
the bad assignment, then of the best one that an exhaustive search
(``services.coordinator.assignment.best_assignment``) finds for these speeds, and
tokens/s of each is measured over a full window (the rebalancing swarm moves too soon
for a long "before" window; its tokens/s before the move is in the notes).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp

from bench.processes import BenchProcesses, run_id
from bench.pump import MeshClient, registry_view
from bench.report import BenchResult
from shared.policy.throughput import best_assignment

STAGES = 2
SPEEDS = (1, 2, 4)
BAD = (0, 1, 1)  # stage of each replica: the slowest alone on stage 0
COLUMNS = ["assignment", "stage speeds", "tokens/s", "vs best", "moves"]


@dataclass(frozen=True)
class Plan:
    base_delay_s: float  # the speed-4 replica's delay per forward pass of work
    rebalance_every_s: float
    warmup_s: float
    window_s: float
    settle_s: float  # after the moved replica rejoined, before the "after" window
    move_timeout_s: float
    seq_len: int = 32
    microbatch_size: int = 4
    in_flight: int = 12


FULL = Plan(base_delay_s=0.02, rebalance_every_s=3.0, warmup_s=2.0, window_s=10.0, settle_s=3.0, move_timeout_s=90.0)
QUICK = Plan(base_delay_s=0.01, rebalance_every_s=1.5, warmup_s=0.5, window_s=2.0, settle_s=0.5, move_timeout_s=60.0)


def describe(stages: list[int] | tuple[int, ...]) -> str:
    """``[1] | [2, 4]``: the speeds of the replicas on each stage."""
    return " | ".join(str(sorted(SPEEDS[i] for i, s in enumerate(stages) if s == stage)) for stage in range(STAGES))


def run(ctx) -> BenchResult:
    plan = QUICK if ctx.quick else FULL
    best, best_capacity = best_assignment(list(SPEEDS), STAGES)
    placements = sorted({*enumerate(BAD), *enumerate(best)})  # (replica, stage) of the fixed swarm
    with (
        BenchProcesses(run_id("rebalancing"), ctx.logs("rebalancing")) as procs,
        BenchProcesses(run_id("rebalancing-fixed"), ctx.logs("rebalancing")) as fixed_procs,
    ):
        swarm = _start(procs, plan, list(enumerate(BAD)), rebalance_every_s=plan.rebalance_every_s)
        fixed = _start(fixed_procs, plan, placements, rebalance_every_s=None)
        procs.wait_healthy(swarm["health"])
        fixed_procs.wait_healthy(fixed["health"])
        moved = asyncio.run(_rebalanced(procs, swarm, plan))
        procs.stop_all()  # its processes must not compete with the next measurements
        bad_tps = asyncio.run(_steady(fixed_procs, fixed, list(enumerate(BAD)), plan))
        best_tps = asyncio.run(_steady(fixed_procs, fixed, list(enumerate(best)), plan))
    after = moved["after"]
    rows = [
        {
            "assignment": "start (bad)",
            "stage speeds": describe(BAD),
            "tokens/s": bad_tps,
            "vs best": bad_tps / best_tps,
            "moves": 0,
        },
        {
            "assignment": "after rebalancing",
            "stage speeds": describe(moved["assignment"]) if moved["assignment"] else "no move",
            "tokens/s": after,
            "vs best": after / best_tps if after else None,
            "moves": moved["moves"],
        },
        {
            "assignment": "best (exhaustive)",
            "stage speeds": describe(best),
            "tokens/s": best_tps,
            "vs best": 1.0,
            "moves": 0,
        },
    ]
    notes = [
        (
            "2 stages, 3 replicas of speeds 1:2:4 (injected "
            f"{plan.base_delay_s * 4:.2f}/{plan.base_delay_s * 2:.2f}/{plan.base_delay_s:.2f} s per forward of work), "
            f"tiny model, microbatch {plan.microbatch_size} x {plan.seq_len}, {plan.in_flight} in flight"
        ),
        (
            f"start and best: {plan.window_s:.0f} s windows in a swarm without coordinator whose servers hold both "
            f"assignments; after: {plan.window_s:.0f} s once the moved server rejoined, in the rebalancing swarm"
        ),
        (
            f"coordinator checks every {plan.rebalance_every_s} s; a move needs the same move on 2 consecutive checks; "
            f"best minimum capacity by exhaustive search: {best_capacity:g} speed units, vs 1 at the start"
        ),
        (
            f"the move was ordered {moved['move_after_s']:.1f} s after training started "
            f"({moved['move_after_s'] / plan.rebalance_every_s:.1f} periods), at {_figure(moved['before'])} tokens/s "
            f"until then; the moved server was serving its new stage {moved['rejoin_s']:.1f} s later"
        )
        if moved["move_after_s"] is not None
        else f"no move within {plan.move_timeout_s} s",
        "moves: assignment changes seen in the registry until the end of the 'after' window (1 = no oscillation)",
    ]
    summary = {
        "after_over_best": rows[1]["vs best"],
        "before_over_best": rows[0]["vs best"],
        "moves": moved["moves"],
        "move_after_periods": moved["move_after_s"] / plan.rebalance_every_s
        if moved["move_after_s"] is not None
        else None,
    }
    return BenchResult(
        "rebalancing",
        "throughput before/after rebalancing vs the exhaustive optimum",
        COLUMNS,
        rows,
        params=vars(plan) | {"speeds": SPEEDS, "bad": BAD, "best": best},
        notes=notes,
        summary=summary,
    )


def _figure(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def _start(
    procs: BenchProcesses, plan: Plan, placements: list[tuple[int, int]], *, rebalance_every_s: float | None
) -> dict:
    """Servers for ``(replica, stage)`` placements (replica i has speed ``SPEEDS[i]``); with a
    rebalancing coordinator, or (``rebalance_every_s=None``) none: the trainer then gets
    the servers' URLs directly."""
    health, urls, coordinator = {}, {}, ""
    if rebalance_every_s is not None:
        # throughput placement: this bench measures the single-move planner of issue 4 (on loopback,
        # where RTTs do not matter, topology placement would plan by the same capacities)
        env = {
            "SWARM_HEARTBEAT_S": "0.5",
            "SWARM_REBALANCE_EVERY_S": str(rebalance_every_s),
            "SWARM_PLACEMENT": "throughput",
        }
        name, coordinator = procs.coordinator(STAGES, env)
        health[name] = coordinator
    for replica, stage in placements:
        # the global batch is what the bench keeps in flight: no staler than one step (docs/architecture.md, Staleness)
        env = {
            "SWARM_COORDINATOR": coordinator,
            "SWARM_HEARTBEAT_S": "0.5",
            "SWARM_WIRE_CODEC": "fp32",
            "SWARM_GLOBAL_BATCH": str(plan.in_flight * plan.microbatch_size),
            "SWARM_INJECT_DELAY_S": str(plan.base_delay_s * max(SPEEDS) / SPEEDS[replica]),
        }
        name, url = procs.stage_server(stage, STAGES, env, name=f"speed{SPEEDS[replica]}-stage{stage}")
        health[name] = url
        urls[(replica, stage)] = url
    return {"coordinator": coordinator, "health": health, "urls": urls, "replica_urls": [urls[p] for p in placements]}


def _assignment(view: list[list[dict]], urls: list[str]) -> tuple[int, ...] | None:
    """The stage of each replica, or None while one of them is not in the registry."""
    where = {r["url"]: stage for stage, replicas in enumerate(view) for r in replicas}
    return tuple(where[u] for u in urls) if all(u in where for u in urls) else None


async def _wait_listed(session: aiohttp.ClientSession, swarm: dict, timeout_s: float = 60.0) -> tuple[int, ...]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (
            found := _assignment(await registry_view(session, swarm["coordinator"]), swarm["replica_urls"])
        ) is not None:
            return found
        await asyncio.sleep(0.2)
    raise RuntimeError(f"not every replica registered within {timeout_s} s")


async def _rebalanced(procs: BenchProcesses, swarm: dict, plan: Plan) -> dict:
    async with MeshClient(
        run_id=procs.run_id, num_stages=STAGES, codec="fp32", seq_len=plan.seq_len, microbatch_size=plan.microbatch_size
    ) as mesh:
        await _wait_listed(mesh.session, swarm)
        await mesh.use_coordinator(swarm["coordinator"], refresh_s=0.5)
        stop = asyncio.Event()
        pump = asyncio.create_task(mesh.pump(in_flight=plan.in_flight, seconds=plan.move_timeout_s + 60, stop=stop))
        started = time.monotonic()
        seen, changes, left_at, back_at, after_from = BAD, 0, None, None, None
        while time.monotonic() - started < plan.move_timeout_s + 30:
            await asyncio.sleep(0.2)
            now, current = (
                time.monotonic(),
                _assignment(await registry_view(mesh.session, swarm["coordinator"]), swarm["replica_urls"]),
            )
            if current is None:  # a server left its stage: the move is under way
                left_at = left_at or now
                continue
            if current != seen:
                changes, seen = changes + 1, current
                back_at = back_at or now
                after_from = after_from or now + plan.settle_s
            if after_from is None and now - started > plan.move_timeout_s:
                break
            if after_from is not None and now > after_from + plan.window_s:
                break
        stop.set()
        log = await pump
    before_until = (left_at or back_at or time.monotonic()) - 0.5
    before = (
        log.tokens_per_s(started + plan.warmup_s, before_until)
        if before_until - started - plan.warmup_s >= 1.0
        else None
    )
    after = log.tokens_per_s(after_from, after_from + plan.window_s) if after_from else None
    left_at = left_at or back_at
    return {
        "before": before,
        "after": after,
        "assignment": seen if changes else None,
        "moves": changes,
        "move_after_s": (left_at - started) if left_at else None,
        "rejoin_s": (back_at - left_at) if back_at and left_at else 0.0,
    }


async def _steady(procs: BenchProcesses, swarm: dict, placements: list[tuple[int, int]], plan: Plan) -> float:
    """Tokens/s of the fixed swarm's servers for these placements, after a warm-up."""
    async with MeshClient(
        run_id=procs.run_id, num_stages=STAGES, codec="fp32", seq_len=plan.seq_len, microbatch_size=plan.microbatch_size
    ) as mesh:
        mesh.use_urls([[swarm["urls"][p] for p in placements if p[1] == stage] for stage in range(STAGES)])
        log = await mesh.pump(in_flight=plan.in_flight, seconds=plan.warmup_s + plan.window_s)
    return log.tokens_per_s(log.started + plan.warmup_s, log.started + plan.warmup_s + plan.window_s)
