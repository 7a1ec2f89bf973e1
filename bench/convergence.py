"""Bench 7, convergence: held-out loss after the same samples with fp32, fp16, int8 (the
linear map) and int4 wires, and with 1 replica per stage and 1 trainer against 2 replicas
per stage and 2 trainers, in ``global`` mode (the same global batch, all-reduced every
step) and in ``local`` mode (DiLoCo: each replica steps on its own samples, an outer step
every H steps); see docs/architecture.md "One model per stage". The step rounds' bytes per
sample (all replicas together) show what each mode sends between replicas.

Each configuration is a fresh swarm of the tiny model (same seed, so the same initial
weights, and the same sequence of microbatches: two trainers take alternate ones): a
coordinator and the stage servers, trained by the trainer's own ``Trainer`` for the same
number of global steps of the same global batch, then evaluated on the same held-out
microbatches. The trainers together keep the same microbatches in flight in every
configuration (two trainers: half each), so that the pipeline's staleness is the same.
The servers and the coordinator are the stock apps on loopback ports inside this
process (real HTTP and codecs): this bench measures losses, not speed, and starting a
dozen processes per configuration would cost more than the training. Each row also
gives the training loss against samples and wall time (the JSON holds the curves).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from aiohttp import web

from bench.pump import MeshClient
from bench.report import BenchResult
from services.coordinator.app import create_app as create_coordinator
from services.stage_server.app import create_app as create_stage
from services.trainer.admission import AdmissionClient
from services.trainer.trainer import Trainer
from shared.config import CoordinatorSettings, StageServerSettings
from shared.processes import free_port

COLUMNS = [
    "wire",
    "replicas/stage",
    "trainers",
    "sync",
    "global steps",
    "samples",
    "loss before",
    "loss after",
    "vs fp32 x1",
    "seconds",
    "re-runs",
    "sync bytes/sample",
]


@dataclass(frozen=True)
class Plan:
    stages: int
    samples: int
    global_batch: int
    seq_len: int
    microbatch_size: int
    in_flight: int  # all trainers together
    local_steps: int  # sync=local: global steps between outer steps (H)


FULL = Plan(stages=4, samples=1280, global_batch=32, seq_len=128, microbatch_size=8, in_flight=4, local_steps=10)
QUICK = Plan(stages=2, samples=64, global_batch=16, seq_len=32, microbatch_size=4, in_flight=4, local_steps=2)
# (wire, replicas per stage, trainers, sync); fp32 x1 twice: the run-to-run spread
CONFIGS = (
    ("fp32", 1, 1, "global"),
    ("fp32", 1, 1, "global"),
    ("fp32", 2, 2, "global"),
    ("fp32", 2, 2, "local"),
    ("fp16", 1, 1, "global"),
    ("int8", 1, 1, "global"),
    ("int8", 2, 2, "global"),
    ("int4", 1, 1, "global"),
)


@contextlib.asynccontextmanager
async def local_swarm(
    run_id: str, plan: Plan, codec: str, replicas: int, sync: str = "global", schedule: str = "async", **server
):
    """A coordinator (``SWARM_SCHEDULE=schedule``) and ``stages x replicas`` stage servers
    (``server``: more of their settings) as apps on loopback ports; yields the coordinator URL."""
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
        await serve(
            create_coordinator(
                CoordinatorSettings(
                    **common,
                    port=port,
                    state_db=":memory:",
                    average_every_s=0.0,
                    rebalance_every_s=0.0,
                    schedule=schedule,
                )
            ),
            port,
        )
        for stage in range(plan.stages):
            for _ in range(replicas):
                port = free_port()
                settings = StageServerSettings(
                    **common,
                    model="tiny",
                    stage=stage,
                    port=port,
                    coordinator=coordinator,
                    wire_codec=codec,
                    seed=0,
                    global_batch=plan.global_batch,
                    drain_timeout_s=5.0,
                    sync=sync,
                    local_steps=plan.local_steps,
                    **server,
                )
                await serve(create_stage(settings), port)
        yield coordinator
    finally:
        for runner in reversed(runners):  # servers first (they deregister), the coordinator last
            await runner.cleanup()


async def train_one(
    plan: Plan, codec: str, replicas: int, trainers: int, sync: str = "global", schedule: str = "async", **server
) -> dict:
    run_id = f"bench-convergence-{codec}-{replicas}-{trainers}-{sync}"
    steps = plan.samples // plan.global_batch
    async with (
        local_swarm(run_id, plan, codec, replicas, sync, schedule, **server) as coordinator,
        contextlib.AsyncExitStack() as stack,
    ):
        runs = []
        for t in range(trainers):
            mesh = await stack.enter_async_context(
                MeshClient(
                    run_id=run_id,
                    num_stages=plan.stages,
                    codec=codec,
                    seq_len=plan.seq_len,
                    microbatch_size=plan.microbatch_size,
                    seed=0,
                )
            )
            await mesh.use_coordinator(coordinator, refresh_s=0.5)
            await _wait_replicas(mesh, plan.stages * replicas)
            mesh.client.until_step = steps
            mesh.client.client_id = f"t{t}"
            runs.append(
                Trainer(
                    mesh.client,
                    mesh.batcher,
                    steps=steps,
                    global_batch=plan.global_batch,
                    in_flight=plan.in_flight // trainers,
                    seed=0,
                    shard_index=t,
                    num_shards=trainers,
                    before_final_eval=lambda view=mesh.view: view.average(60.0),
                    admission=AdmissionClient(mesh.session, coordinator, run_id=run_id, until_step=steps, wait_s=60.0),
                )
            )  # evaluate once the last step is applied
        summaries = await asyncio.gather(*(r.run() for r in runs))
        stage_steps, sync_bytes = [], 0  # every replica's global step, as it says; bytes of its rounds
        for url in (u for replicas_of in mesh.view.replicas() for u in replicas_of):
            async with mesh.session.get(url + "/health") as resp:
                stage_steps.append((await resp.json())["step"])
            async with mesh.session.get(url + "/average/status") as resp:
                sync_bytes += (await resp.json())["bytes_sent"]
    failed = sum(x.microbatches_failed for x in summaries)
    if failed:
        raise RuntimeError(
            f"{failed} microbatches failed with {codec} x{replicas}: "
            f"{[x.failures[-1] for x in summaries if x.failures]}"
        )
    first = summaries[0]
    curve = [
        {"step": i + 1, "samples": (i + 1) * plan.global_batch, "loss": loss, "seconds": round(at, 3)}
        for i, (loss, at) in enumerate(zip(first.step_losses, first.step_elapsed_s))
    ]
    samples = sum(x.tokens for x in summaries) // plan.seq_len
    return {
        "global steps": min(stage_steps),
        "loss before": first.eval_loss_before,
        "loss after": first.eval_loss_after,
        "samples": samples,
        "seconds": max(x.elapsed_s for x in summaries),
        "re-runs": sum(x.microbatch_reruns for x in summaries),
        "sync bytes/sample": round(sync_bytes / max(samples, 1)),
        "curve": curve,
    }


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
    for codec, replicas, trainers, sync in CONFIGS:
        figures = asyncio.run(train_one(plan, codec, replicas, trainers, sync))
        rows.append({"wire": codec, "replicas/stage": replicas, "trainers": trainers, "sync": sync, **figures})
    reference = rows[0]["loss after"]
    for row in rows:
        row["vs fp32 x1"] = row["loss after"] / reference
    rows[1]["wire"] = "fp32 (again)"
    notes = [
        f"tiny model ({plan.stages} stages), {plan.samples} samples of {plan.seq_len} tokens in global steps of "
        f"{plan.global_batch} samples, {plan.in_flight} microbatches in flight (all trainers together); loss: mean "
        "cross-entropy on 4 held-out microbatches (nats per byte)",
        "2 replicas/stage x 2 trainers: every stage's replicas all-reduce each global step's gradients and take the "
        "same AdamW step; the trainers take alternate microbatches of the same sequence",
        "sync local (DiLoCo): each replica takes its inner AdamW step on its own samples, and every "
        f"{plan.local_steps} global steps the replicas all-reduce what they learned and take an outer Nesterov step "
        "(lr 0.7, momentum 0.5); sync bytes/sample: what the stage servers sent in their step rounds, all together, "
        "per trained sample",
        "wire: the codec of the activations and gradients between the trainer and the stages, both ways (int8: linear "
        "blockwise, one bfloat16 absmax per block of 128 tokens of a channel; int4: 4-bit after a seeded Hadamard "
        "rotation per block of 64 values)",
        (
            "one run per configuration, fp32 x1 twice: the order in which asynchronous microbatches finish varies from "
            "run to run, so the two show the noise a difference must exceed"
        ),
        (
            "training loss against samples and against wall time: the 'curve' of each row in the JSON (the first "
            "trainer's mean loss per global step, and when it saw the step done)"
        ),
    ]
    summary = {
        (
            f"{r['wire'].split()[0]}{'_again' if 'again' in r['wire'] else ''}_x{r['replicas/stage']}"
            f"{'_local' if r['sync'] == 'local' else ''}_vs_fp32"
        ): r["vs fp32 x1"]
        for r in rows
    }
    table = [{k: v for k, v in r.items() if k != "curve"} for r in rows]
    return BenchResult(
        "convergence",
        "loss after the same samples: wire codecs, one model on 2 replicas x 2 trainers",
        COLUMNS,
        table,
        params={**vars(plan), "curves": [r["curve"] for r in rows]},
        notes=notes,
        summary=summary,
    )
