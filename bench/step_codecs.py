"""Step-round codecs: ``python -m bench.step_codecs`` (``--quick``: a smoke run).

Held-out loss after the same samples, and the bytes each replica sends per global step,
with the stage's gradients all-reduced in ``fp32``, ``int8`` and ``int4`` step rounds
(``SWARM_AVERAGING_CODEC``), each lossy codec with and without error feedback
(``SWARM_ERROR_FEEDBACK``, see ``services/stage_server/error_feedback.py``), over several
seeds. Also checks, after every global step, that the replicas of each stage hold
bit-identical weights and AdamW state (their digests, taken on the compute worker right
after each step).

Each run is a fresh swarm of the tiny model with the ``sync`` schedule (the default: no
microbatch of step k+1 before step k is taken everywhere, so every gradient is computed on
the weights of the step it goes into): a coordinator and ``stages x replicas`` stage
servers, the stock apps on loopback ports inside this process (real HTTP, codecs and
rounds), trained by the trainer's own ``Trainer``; the activations travel in ``fp32`` so
that the step round is the only lossy hop. A seed fixes the initial weights, the data
order and the held-out microbatches; every configuration of a seed sees the same ones,
so the loss ratios to ``fp32`` are paired.

``--routing turns`` (the default): one trainer, one microbatch in flight, each stage's
replicas taken in turn, so that a run repeats exactly and the codec is the only
difference between two runs of a seed. ``--routing measured``: two trainers with two
microbatches in flight each, replicas chosen by the trainers' measured throughputs (as in
a real swarm: a replica's share of a step varies); which replica serves which microbatch
then varies from run to run, and so does the loss, a little, even in ``fp32``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp
from aiohttp import web

from bench.report import BenchResult, format_markdown, format_table, machine, write_json
from services.coordinator.app import create_app as create_coordinator
from services.stage_server.allreduce import AVERAGER
from services.stage_server.app import MEMBERSHIP
from services.stage_server.app import create_app as create_stage
from services.stage_server.routes import RUNTIME
from services.trainer.admission import AdmissionClient
from services.trainer.data import ByteBatcher, load_corpus
from services.trainer.pipeline import PipelineClient
from services.trainer.trainer import Trainer
from shared.codec import FLOAT_CODECS
from shared.config import CoordinatorSettings, StageServerSettings
from shared.processes import free_port
from shared.wiring import ReplicaBalancer

CONFIGS = (("fp32", False), ("int8", False), ("int8", True), ("int4", False), ("int4", True))
COLUMNS = [
    "round codec",
    "error feedback",
    "loss after (per seed)",
    "mean loss after",
    "vs fp32 (mean)",
    "vs fp32 (worst seed)",
    "bytes/step/replica",
    "bytes vs fp32",
    "identical",
    "seconds/run",
]


@dataclass(frozen=True)
class Plan:
    stages: int
    replicas: int  # per stage
    trainers: int
    in_flight: int  # per trainer
    steps: int
    global_batch: int
    seq_len: int
    microbatch_size: int
    eval_microbatches: int
    seeds: tuple[int, ...]
    lr: float = 1e-3  # the stage servers' defaults otherwise (AdamW, 10 warm-up steps, clipping at 1)
    round_robin: bool = False  # one trainer, one microbatch in flight, replicas in turn: runs repeat exactly


FULL = Plan(
    stages=2,
    replicas=2,
    trainers=1,
    in_flight=1,
    steps=200,
    global_batch=32,
    seq_len=64,
    microbatch_size=8,
    eval_microbatches=16,
    seeds=(0, 1, 2),
    round_robin=True,
)
MEASURED = {"trainers": 2, "in_flight": 2, "round_robin": False}  # --routing measured
QUICK = Plan(
    stages=2,
    replicas=2,
    trainers=2,
    in_flight=2,
    steps=4,
    global_batch=16,
    seq_len=32,
    microbatch_size=4,
    eval_microbatches=2,
    seeds=(0,),
)


@dataclass
class Run:
    codec: str
    error_feedback: bool
    seed: int
    loss_before: float
    loss_after: float
    steps: int  # the global step every stage ended at
    round_bytes: int  # sent by every replica in its step rounds, all together
    identical: bool  # the replicas of each stage had one digest after every step
    seconds: float


class RoundRobin(ReplicaBalancer):
    """Each stage's replicas in turn, forwards and backwards counted apart: with one trainer
    and one microbatch in flight, microbatch ``i`` is served by replica ``i mod replicas``
    of every stage in URL order, which is the order of the members of the stage's step
    rounds (the coordinator sorts them): run after run, the same member of a round holds
    the same gradient."""

    def __init__(self, urls: list[list[str]]):
        super().__init__(len(urls), rng=random.Random(0))
        for stage, group in enumerate(urls):
            self.set_replicas(stage, group)
        self._turns: dict[tuple[int, str], int] = {}

    def choose(self, stage: int, *, kind: str = "forward", batch_size: int, exclude=()) -> str:
        excluded = set(exclude)
        urls = sorted(u for u in self.usable(stage) if u not in excluded) or sorted(self.usable(stage))
        turn = self._turns.get((stage, kind), 0)
        self._turns[(stage, kind)] = turn + 1
        return urls[turn % len(urls)]


@dataclass
class Swarm:
    coordinator: str
    apps: list[list[web.Application]]  # per stage, per replica
    urls: list[list[str]]
    digests: dict[tuple[int, int], list[str]]  # (stage, step) -> each replica's digest right after it


@contextlib.asynccontextmanager
async def swarm(run_id: str, plan: Plan, codec: str, error_feedback: bool, seed: int):
    """A coordinator (``sync`` schedule, step rounds in ``codec``) and the stage servers, on
    loopback ports in this process, registered; yields a :class:`Swarm`."""
    runners: list[web.AppRunner] = []

    async def serve(app: web.Application, port: int) -> str:
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=5)
        await runner.setup()
        runners.append(runner)
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return f"http://127.0.0.1:{port}"

    common = {"run_id": run_id, "num_stages": plan.stages, "mdns": False, "heartbeat_s": 60.0, "log_level": "error"}
    try:
        port = free_port()
        coordinator = await serve(
            create_coordinator(
                CoordinatorSettings(
                    **common,
                    port=port,
                    coordinator="",
                    state_db=":memory:",
                    average_every_s=0.0,
                    rebalance_every_s=0.0,
                    schedule="sync",
                    averaging_codec=codec,
                    error_feedback=error_feedback,
                )
            ),
            port,
        )
        result = Swarm(coordinator, [], [], {})
        for stage in range(plan.stages):
            result.apps.append([]), result.urls.append([])
            for _ in range(plan.replicas):
                port = free_port()  # the URL a server registers is the one it listens at
                settings = StageServerSettings(
                    **common,
                    model="tiny",
                    stage=stage,
                    port=port,
                    coordinator=coordinator,
                    wire_codec="fp32",
                    seed=seed,
                    global_batch=plan.global_batch,
                    lr=plan.lr,
                    drain_timeout_s=5.0,
                )
                app = create_stage(settings)
                result.urls[-1].append(await serve(app, port))
                result.apps[-1].append(app)
                _record_digests(app, stage, result.digests)
        for app in (a for group in result.apps for a in group):
            await asyncio.wait_for(app[MEMBERSHIP].registered.wait(), 30)
        yield result
    finally:
        for runner in reversed(runners):  # servers first (they deregister), the coordinator last
            await runner.cleanup()


def _record_digests(app: web.Application, stage: int, digests: dict) -> None:
    """After each step the runtime applies (on its compute worker): its digest."""
    runtime = app[RUNTIME]
    apply_step = runtime.apply_step

    def recording(gradient):
        apply_step(gradient)
        digests.setdefault((stage, runtime.step), []).append(runtime.digest())

    runtime.apply_step = recording


async def train(plan: Plan, codec: str, error_feedback: bool, seed: int) -> Run:
    """One run: ``plan.steps`` global steps of ``plan.global_batch`` samples, then the held-out loss."""
    run_id = f"bench-step-codecs-{codec}-{int(error_feedback)}-{seed}-{os.getpid()}"
    started = time.monotonic()
    async with swarm(run_id, plan, codec, error_feedback, seed) as s, aiohttp.ClientSession() as session:
        runtimes = [app[RUNTIME] for group in s.apps for app in group]

        async def all_stepped() -> None:  # the last step's round may still end on some replica
            while any(r.step < plan.steps for r in runtimes):
                await asyncio.sleep(0.02)

        trainers, count = [], 1 if plan.round_robin else plan.trainers
        for t in range(count):
            balancer = RoundRobin(s.urls) if plan.round_robin else ReplicaBalancer(plan.stages, rng=random.Random(t))
            for stage, group in enumerate(s.urls):
                balancer.set_replicas(stage, group)
            client = PipelineClient(
                session, balancer, run_id=run_id, codec="fp32", until_step=plan.steps, client_id=f"t{t}"
            )
            trainers.append(
                Trainer(
                    client,
                    ByteBatcher(load_corpus(), plan.seq_len, plan.microbatch_size, seed=seed),
                    steps=plan.steps,
                    global_batch=plan.global_batch,
                    in_flight=1 if plan.round_robin else plan.in_flight,
                    seed=seed,
                    eval_microbatches=plan.eval_microbatches,
                    shard_index=t,
                    num_shards=count,
                    before_final_eval=lambda: asyncio.wait_for(all_stepped(), 60),
                    admission=AdmissionClient(session, s.coordinator, run_id=run_id, until_step=plan.steps, wait_s=60),
                )
            )
        summaries = await asyncio.gather(*(t.run() for t in trainers))
        failed = sum(x.microbatches_failed for x in summaries)
        if failed:
            raise RuntimeError(f"{failed} microbatches failed ({codec}, error feedback {error_feedback}, seed {seed})")
        identical = all(
            len(s.digests.get((stage, k), [])) == plan.replicas and len(set(s.digests[(stage, k)])) == 1
            for stage in range(plan.stages)
            for k in range(1, plan.steps + 1)
        )
        return Run(
            codec,
            error_feedback,
            seed,
            summaries[0].eval_loss_before,
            summaries[0].eval_loss_after,
            min(r.step for r in runtimes),
            sum(app[AVERAGER].bytes_sent for group in s.apps for app in group),
            identical,
            time.monotonic() - started,
        )


def rows_of(runs: list[Run], plan: Plan) -> list[dict]:
    """One row per configuration: the losses of its seeds and their ratios to fp32's of the same seed."""
    fp32 = {r.seed: r for r in runs if r.codec == "fp32"}
    rows = []
    for codec, error_feedback in dict.fromkeys((r.codec, r.error_feedback) for r in runs):
        mine = [r for r in runs if (r.codec, r.error_feedback) == (codec, error_feedback)]
        ratios = [r.loss_after / fp32[r.seed].loss_after for r in mine if r.seed in fp32]
        per_step = statistics.mean(r.round_bytes / (r.steps * plan.stages * plan.replicas) for r in mine)
        rows.append(
            {
                "round codec": codec,
                "error feedback": "on" if error_feedback else "off",
                "loss after (per seed)": " ".join(f"{r.loss_after:.4f}" for r in mine),
                "mean loss after": f"{statistics.mean(r.loss_after for r in mine):.4f}",
                "vs fp32 (mean)": f"{statistics.mean(ratios):.4f}" if ratios else None,
                "vs fp32 (worst seed)": f"{max(ratios):.4f}" if ratios else None,
                "bytes/step/replica": round(per_step),
                "identical": "yes" if all(r.identical for r in mine) else "NO",
                "seconds/run": round(statistics.mean(r.seconds for r in mine), 1),
            }
        )
    base = next((r["bytes/step/replica"] for r in rows if r["round codec"] == "fp32"), None)
    for row in rows:
        row["bytes vs fp32"] = f"{row['bytes/step/replica'] / base:.3f}" if base else None
    return rows


def run(plan: Plan, configs=CONFIGS) -> BenchResult:
    runs = []
    routing = "in turn (runs repeat exactly)" if plan.round_robin else "by measured throughput"
    for seed in plan.seeds:
        for codec, error_feedback in configs:
            one = asyncio.run(train(plan, codec, error_feedback, seed))
            print(
                f"  {codec} error_feedback={error_feedback} seed={seed}: loss {one.loss_before:.4f} -> "
                f"{one.loss_after:.4f}, {one.round_bytes} round bytes, identical={one.identical}, {one.seconds:.0f} s",
                flush=True,
            )
            runs.append(one)
    notes = [
        f"tiny model, {plan.stages} stages x {plan.replicas} replicas, {plan.trainers} trainers x {plan.in_flight} "
        f"microbatches in flight, replicas {routing}, sync schedule, {plan.steps} global steps of "
        f"{plan.global_batch} samples of {plan.seq_len} bytes (lr {plan.lr}, the servers' default AdamW, warm-up "
        "and clipping), fp32 activations",
        f"loss: mean cross-entropy (nats per byte) on {plan.eval_microbatches} held-out microbatches of "
        f"{plan.microbatch_size} after the last step; seeds {list(plan.seeds)} (weights, data, held-out set); "
        "vs fp32: the ratio to the fp32 run of the same seed",
        "bytes/step/replica: what each replica sent in its step rounds (parts posted and reductions served), per "
        "global step; identical: the replicas of each stage had one digest (weights and AdamW state) after every step",
        "int8: linear blockwise, one bfloat16 absmax per 128 values; int4: 4-bit after a seeded Hadamard rotation "
        "per block of 64 values; error feedback: each replica adds what the codec lost of its last step's parts (and "
        "of the part it reduced) before it compresses the next",
    ]
    table = rows_of(runs, plan)
    summary = {
        f"{r['round codec']}{'_ef' if r['error feedback'] == 'on' else ''}_vs_fp32": float(r["vs fp32 (mean)"])
        for r in table
        if r["vs fp32 (mean)"] is not None
    }
    return BenchResult(
        "step_codecs",
        "held-out loss after the same samples and bytes per step: fp32, int8 and int4 step rounds, error feedback",
        COLUMNS,
        table,
        params={**vars(plan), "runs": [vars(r) for r in runs]},
        notes=notes,
        summary=summary,
    )


def _name(codec: str, error_feedback: bool) -> str:
    return codec + ("+ef" if error_feedback else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.step_codecs", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks that the bench runs")
    p.add_argument("--seeds", default="", help="comma-separated seeds, e.g. 3,4,5 (default: the plan's)")
    p.add_argument(
        "--configs",
        default=",".join(_name(*c) for c in CONFIGS),
        help="comma-separated round codecs, '+ef' for error feedback (default: %(default)s)",
    )
    p.add_argument("--steps", type=int, default=0, help="global steps per run (default: the plan's)")
    p.add_argument(
        "--routing",
        choices=("turns", "measured"),
        default="turns",
        help="replicas in turn, one microbatch in flight (default; runs repeat exactly), or by measured throughput",
    )
    p.add_argument("--out", default="bench/results", help="directory of the JSON result (default bench/results)")
    p.add_argument("--markdown", default="", help="also write the table as markdown to this file")
    args = p.parse_args(argv)
    import torch

    from shared.log import configure_logging

    torch.set_num_threads(1)
    configure_logging("console", "error")
    plan = QUICK if args.quick else FULL
    if args.routing == "measured":
        plan = replace(plan, **MEASURED)
    seeds = tuple(int(x) for x in args.seeds.split(",")) if args.seeds else plan.seeds
    plan = replace(plan, seeds=seeds, steps=args.steps or plan.steps)
    configs = [(name.removesuffix("+ef"), name.endswith("+ef")) for name in args.configs.split(",")]
    if any(c not in FLOAT_CODECS for c, _ in configs):
        p.error(f"--configs: round codecs are {', '.join(FLOAT_CODECS)}, each with '+ef' or not")
    command = "python -m bench.step_codecs " + shlex.join(sys.argv[1:] if argv is None else argv)
    info = machine()
    print(f"{command} on {info['cores']} cores ({info['cpu']}), load {info['load_avg_1m']}", flush=True)
    started = time.monotonic()
    result = run(plan, configs)
    result.elapsed_s = time.monotonic() - started
    print(format_table(result), flush=True)
    info["load_avg_1m_after"] = machine()["load_avg_1m"]
    write_json(result, Path(args.out) / "step_codecs.json", command=command, machine_info=info, quick=args.quick)
    if args.markdown:
        Path(args.markdown).write_text(
            f"Command: `{command}`. Machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}, "
            f"load {info['load_avg_1m']} at start. Date: {info['date_utc']} UTC. Total {result.elapsed_s:.0f} s.\n\n"
            + format_markdown(result)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
