"""Bench 7, convergence: held-out loss after the same samples with fp32, fp16 and int8
wires, and with 1 vs 2 replicas per stage kept in sync by averaging.

Each configuration is a fresh swarm of the tiny model (same seed, so the same initial
weights, and the same microbatches in the same order): a coordinator and the stage
servers, trained by the trainer's own ``Trainer`` for the same number of samples, then
evaluated on the same held-out microbatches. The 2-replica swarm averages every 2 s, each
replica steps on 16 samples (together the same 32 per step as one replica), and the
trainer asks for a last averaging pass before the evaluation, as ``swarm train`` does.
The servers and the coordinator are the stock apps on loopback ports inside this
process (real HTTP and codecs): this bench measures losses, not speed, and starting a
dozen processes per configuration would cost more than the training.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from aiohttp import web

from shared.config import CoordinatorSettings, StageServerSettings
from services.coordinator.app import create_app as create_coordinator
from services.local_swarm import free_port
from services.stage_server.app import create_app as create_stage
from services.trainer.trainer import Trainer
from bench.pump import MeshClient
from bench.report import BenchResult

COLUMNS = ["wire", "replicas/stage", "samples", "loss before", "loss after", "vs fp32 x1", "seconds"]


@dataclass(frozen=True)
class Plan:
    stages: int
    samples: int
    samples_per_step: int
    seq_len: int
    microbatch_size: int
    in_flight: int
    average_every_s: float = 2.0


FULL = Plan(stages=4, samples=1280, samples_per_step=32, seq_len=128, microbatch_size=8, in_flight=8)
QUICK = Plan(stages=2, samples=64, samples_per_step=16, seq_len=32, microbatch_size=4, in_flight=4)
CONFIGS = (("fp32", 1), ("fp32", 1), ("fp16", 1), ("int8", 1), ("int8", 2))  # fp32 twice: the run-to-run spread


@contextlib.asynccontextmanager
async def local_swarm(run_id: str, plan: Plan, codec: str, replicas: int):
    """A coordinator and ``stages x replicas`` stage servers as apps on loopback ports; yields the coordinator URL."""
    runners: list[web.AppRunner] = []

    async def serve(app: web.Application, port: int) -> None:
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=5)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)

    common = {"run_id": run_id, "num_stages": plan.stages, "mdns": False, "heartbeat_s": 0.5, "log_level": "error"}
    port = free_port()
    coordinator = f"http://127.0.0.1:{port}"
    try:
        await serve(create_coordinator(CoordinatorSettings(**common, port=port, state_db=":memory:", average_every_s=plan.average_every_s, rebalance_every_s=0.0)), port)
        for stage in range(plan.stages):
            for _ in range(replicas):
                port = free_port()
                settings = StageServerSettings(**common, model="tiny", stage=stage, port=port, coordinator=coordinator, wire_codec=codec, seed=0,
                                               samples_per_step=plan.samples_per_step // replicas, drain_timeout_s=5.0)
                await serve(create_stage(settings), port)
        yield coordinator
    finally:
        for runner in reversed(runners):  # servers first (they deregister), the coordinator last
            await runner.cleanup()


async def train_one(plan: Plan, codec: str, replicas: int) -> dict:
    run_id = f"bench-convergence-{codec}-{replicas}"
    async with local_swarm(run_id, plan, codec, replicas) as coordinator:
        async with MeshClient(run_id=run_id, num_stages=plan.stages, codec=codec, seq_len=plan.seq_len, microbatch_size=plan.microbatch_size) as mesh:
            await mesh.use_coordinator(coordinator, refresh_s=0.5)
            await _wait_replicas(mesh, plan.stages * replicas)
            per_step = plan.samples_per_step // replicas
            trainer = Trainer(mesh.client, mesh.batcher, steps=plan.samples // per_step, samples_per_step=per_step, in_flight=plan.in_flight, seed=0,
                              before_final_eval=(lambda: mesh.view.average(60.0)) if replicas > 1 else None)
            summary = await trainer.run()
    if summary.microbatches_failed:
        raise RuntimeError(f"{summary.microbatches_failed} microbatches failed with {codec} x{replicas}: {summary.failures[-1]}")
    return {"loss before": summary.eval_loss_before, "loss after": summary.eval_loss_after, "samples": summary.tokens // plan.seq_len, "seconds": summary.elapsed_s}


async def _wait_replicas(mesh: MeshClient, count: int, timeout_s: float = 30.0) -> None:
    """Until the trainer's view holds every replica (they register after they listen)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while sum(len(r) for r in mesh.view.replicas()) < count:
        if loop.time() > deadline:
            raise RuntimeError(f"only {mesh.view.replicas()} registered after {timeout_s} s")
        await asyncio.sleep(0.1)
        await mesh.view.refresh()


def run(ctx) -> BenchResult:
    plan = QUICK if ctx.quick else FULL
    rows = []
    for codec, replicas in CONFIGS:
        figures = asyncio.run(train_one(plan, codec, replicas))
        rows.append({"wire": codec, "replicas/stage": replicas, **figures})
    reference = rows[0]["loss after"]
    for row in rows:
        row["vs fp32 x1"] = row["loss after"] / reference
    rows[1]["wire"] = "fp32 (again)"
    notes = [
        f"tiny model ({plan.stages} stages), {plan.samples} samples of {plan.seq_len} tokens, {plan.samples_per_step} samples per step swarm-wide, {plan.in_flight} microbatches in flight; "
        "loss: mean cross-entropy on 4 held-out microbatches (nats per byte)",
        f"2 replicas/stage: averaging every {plan.average_every_s:.0f} s, each replica steps on {plan.samples_per_step // 2} samples, and a last averaging pass before the evaluation",
        "one run per configuration, fp32 twice: the order in which asynchronous microbatches finish varies from run to run, so the two fp32 runs show the noise a difference must exceed",
    ]
    summary = {f"{r['wire'].split()[0]}{'_again' if 'again' in r['wire'] else ''}_x{r['replicas/stage']}_vs_fp32": r["vs fp32 x1"] for r in rows}
    return BenchResult("convergence", "loss after the same samples: wire codecs, averaged replicas", COLUMNS, rows, params=vars(plan), notes=notes, summary=summary)
