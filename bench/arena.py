"""Bench 8, arena: the mesh and torch.distributed.pipelining on shaped links, uneven peers
and churn, scored by the time to a target held-out loss.

Every peer (each stage server, each trainer, the coordinator, each pipelining rank) runs
in its own network namespace behind its own shaped access link with latency, and stage
peers under a CPU cap (``bench/arena_net.py``). Three sides train the same model (the
``small`` preset's dimensions, 8 layers over 4 stages, seed 0) on the same samples with the
same global batch and the same optimizer:

- ``mesh int8``: coordinator, stage servers and trainers as stock processes, the default
  wire codec; its best number of trainers, microbatches in flight and samples a microbatch
  (8, 4 or 2, as pipelining's microbatch counts cut the batch), swept where the scenario says
  so (tokens/s over a few steps), else the last sweep's best. Whatever the microbatch size,
  a run trains on the same samples in the same global steps as the reference (the trainer's
  ``ByteBatcher`` cuts one stream of samples), as pipelining does;
- ``mesh fp32``: the same with the fp32 wire (what the codec buys, against the design);
- ``pipelining``: ``torch.distributed.pipelining`` over gloo, Schedule1F1B, fp32
  activations (``bench/arena_pipelining.py``), with its microbatch count for the global
  batch swept in the same arena first and its fastest used; on the scenario's strongest
  servers, one per stage, the layers split equally;
- ``pipelining balanced`` (where those servers' CPU caps differ): the same with the layers
  split in proportion to their caps (:func:`balanced_layers`).

Each row gives its side's compute bound against equal-split pipelining's
(:func:`compute_bounds`: CPU cores per layer of the slowest stage, the mesh at its best
placement), beside the measured tokens/s and time ratios.

The target is the held-out loss the same model reaches in one process after
``target_steps`` global steps (computed here, printed). Each side trains until its
held-out loss reaches the target or its budget is spent (the signal to stop: pipelining
evaluates every ``eval_every`` steps between steps, off its clock; the mesh's snapshots, see
below, are evaluated as they come by ``bench.arena_eval`` at the lowest CPU priority, so its
trainer evaluates nothing on the stage servers' cores). Steps and time to target are then
counted exactly, off the clock:
every side writes each stage's weights after every global step (the mesh's servers with
``SWARM_STEP_SNAPSHOT_DIR``, pipelining's ranks likewise), and after the run every step's
model is evaluated here (:func:`snapshot_curve`); the first step at the target counts, at
the training time when the side saw it done. Tokens/s: tokens of the global steps done over
their time. Bytes per
token: what all the side's peers sent on their links, from the interfaces' counters,
over those tokens.

``swarm bench arena`` runs every scenario (about 30 minutes here); ``python -m bench.arena
SCENARIO`` runs one (``--list`` names them). Needs root, ``ip`` and ``tc``: without them
the bench says so and skips.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import typing
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from bench.arena_eval import forward, held_out_loss, snapshot_curve
from bench.arena_net import Arena, PeerSpec, measure_link, unavailable
from bench.report import BenchResult
from bench.workload import Workload
from services.trainer.utilisation import run_utilisation
from shared.flops import stage_flops
from shared.model import StageSpec, partition
from shared.peak_flops import resolve_peak

COORD_PORT, SERVER_PORT, GLOO_PORT = 7000, 7100, 29500
FIRST_HEAD_S = 3.0  # --first: the head start of that server (it asks for a stage before the others start)
START_TIMEOUT_S = 240.0  # many processes import torch at once on 2 cores, some capped
POLL_S = 0.25
# a side this long past its budget in wall time (from its start) without the budget in training time has
# stalled: stopped
STALL_GRACE_S = 60.0
CHURN_STALL_S = 20.0  # a side with a victim down that takes no global step this long gets one back at once
TRAINERS = ("t0", "t1", "t2", "t3")  # the peers trainers run in (stopped before the servers)
HOMOGENEOUS_CPUS = 0.4  # per stage peer: 4 x 0.4 leaves the machine's rest to trainers, coordinator and the switch
HETERO_UNIT = 1.6 / 24  # caps 1:1:2:2:2:4:4:4 of this many cores: 1.6 cores in all

COLUMNS = [
    "scenario",
    "side",
    "best setting",
    "time to target s",
    "steps to target",
    "tokens/s",
    "bytes/token",
    "mesh / pipelining time",
    "mesh / pipelining tok/s",
    "mesh / balanced time",
    "with / without kills, time",
    "re-runs",
    "compute bound (x pipelining)",
    "MFU per stage",
]


@dataclass(frozen=True)
class Scenario:
    name: str
    servers: tuple[tuple[float, float | None], ...]  # per stage server: (link Mbit/s, CPU cap in cores or None)
    one_way_ms: float  # latency of every access link, each direction (a peer-to-peer path has two)
    trainer_mbit: float
    budget_s: float  # each side's training time at most
    stages: int = 4
    # (kill every N global steps, a victim back M global steps after its kill): see ChurnPlan
    churn: tuple[int, int] | None = None
    target_steps: int | None = None  # the target: the loss one process reaches after this many steps (None: the plan's)
    rebalance_every_s: float = 0.0  # the coordinator's rebalancing (0: off; one server per stage)
    # the mesh's checkpoints (0: none): a restarted server whose stage has no live replica resumes from the latest
    checkpoint_every_s: float = 0.0
    # sweep the mesh's trainers x in-flight x microbatch size here (else the last sweep's best)
    sweep_mesh: bool = False
    description: str = ""

    def peer_specs(self, trainers: int) -> list[PeerSpec]:
        peers = [PeerSpec(f"s{i}", rate, self.one_way_ms, cpus) for i, (rate, cpus) in enumerate(self.servers)]
        peers += [PeerSpec(f"t{i}", self.trainer_mbit, self.one_way_ms) for i in range(trainers)]
        return peers + [PeerSpec("coord", self.trainer_mbit, self.one_way_ms)]

    def pipeline_ranks(self) -> list[str]:
        """Pipelining's best static assignment: the ``stages`` strongest servers (CPU cap, then
        link), one per stage; the rest idle."""
        order = sorted(range(len(self.servers)), key=lambda i: (-(self.servers[i][1] or 1e9), -self.servers[i][0], i))
        return [f"s{i}" for i in sorted(order[: self.stages])]


@dataclass
class ChurnPlan:
    """A scenario's kills, by global steps, so that a faster side meets as many: the k-th kill
    at step ``k * every``; the second takes a whole stage (every live replica of the stage
    with the fewest, so its last one among them: that stage's recovery is part of the run),
    every other one a random live server. A victim comes back ``back`` global steps after its
    kill; a side that takes no step for ``CHURN_STALL_S`` while victims are down (a stage
    lost every replica) gets its longest-down victim back at once."""

    every: int
    back: int
    rng: random.Random = field(default_factory=lambda: random.Random(0))  # the same victims in every run
    kills: int = 0
    down: dict[str, int] = field(default_factory=dict)  # victim -> its kill's step, the longest down first
    last_step: int = -1
    last_step_at: float = 0.0

    def victims(self, step: int, stages: dict[int, list[str]], idle: tuple[str, ...] = ()) -> list[str]:
        """Whom to kill at global ``step`` (nobody, one server or a whole stage), from the live
        servers of each stage and the live servers that hold none (``idle``)."""
        live = sorted({p for members in stages.values() for p in members} | set(idle))
        if not self.due(step) or not live:
            return []
        self.kills += 1
        if self.kills == 2 and any(stages.values()):
            fewest = min(len(m) for m in stages.values() if m)
            stage = self.rng.choice(sorted(s for s, m in stages.items() if len(m) == fewest))
            chosen = sorted(stages[stage])
        else:
            chosen = [self.rng.choice(live)]
        for victim in chosen:
            self.down[victim] = step
        return chosen

    def due(self, step: int) -> bool:
        """Whether global ``step`` is at or past the next kill's."""
        return step >= (self.kills + 1) * self.every

    def returning(self, step: int, now: float) -> list[str]:
        """The victims to start again at global ``step`` and monotonic time ``now``."""
        if step != self.last_step:
            self.last_step, self.last_step_at = step, now
        back = [v for v, killed_at in self.down.items() if step >= killed_at + self.back]
        if not back and self.down and now - self.last_step_at >= CHURN_STALL_S:
            back, self.last_step_at = [next(iter(self.down))], now
        for victim in back:
            del self.down[victim]
        return back


def layer_splits(n_layer: int, parts: int):
    """Every split of ``n_layer`` contiguous layers into ``parts`` stages of at least one."""
    if parts == 1:
        yield (n_layer,)
        return
    for first in range(1, n_layer - parts + 2):
        for rest in layer_splits(n_layer - first, parts - 1):
            yield (first, *rest)


def balanced_layers(cores: list[float], n_layer: int) -> tuple[int, ...]:
    """The split of ``n_layer`` layers over pipeline ranks of these CPU ``cores`` (in rank
    order) whose slowest rank has the most cores per layer (ties: the most even split)."""
    return max(
        layer_splits(n_layer, len(cores)),
        key=lambda split: (min(c / n for c, n in zip(cores, split)), -sum(n * n for n in split)),
    )


def compute_bounds(cores: list[float], stages: int, work: Workload, ranks: list[int]) -> dict:
    """Each side's compute bound: the CPU cores per layer of its slowest stage (the rate of a
    pipeline is its slowest stage's, embeddings and head left out), for ``cores`` of the stage
    servers. The mesh: every server in some stage, the stages' layers as ``partition`` splits
    them, its best placement (the coordinator's to find); pipelining: the servers ``ranks``,
    one per stage, with equal splits and with :func:`balanced_layers`."""
    n_layer = work.n_layer
    sizes = [len(spec.layers) for spec in partition(work.gpt_config(), stages)]
    mesh = 0.0
    for placement in itertools.product(range(stages), repeat=len(cores)):
        held = [0.0] * stages
        for server, stage in enumerate(placement):
            held[stage] += cores[server]
        mesh = max(mesh, min(h / n for h, n in zip(held, sizes)))
    rank_cores = [cores[i] for i in ranks]
    balanced = balanced_layers(rank_cores, n_layer)
    return {
        "mesh": mesh,
        "pipelining": min(c / n for c, n in zip(rank_cores, sizes)),
        "pipelining balanced": min(c / n for c, n in zip(rank_cores, balanced)),
        "balanced_layers": list(balanced),
    }


@dataclass(frozen=True)
class Plan:
    work: Workload
    scenarios: tuple[Scenario, ...]
    target_steps: int
    eval_every: int
    # (trainers, microbatches in flight, all trainers together[, samples a microbatch]): the
    # microbatch's size is swept as pipelining's is (pipeline_candidates); absent, the workload's
    mesh_settings: tuple[tuple[int, ...], ...]
    pipeline_candidates: tuple[int, ...]  # microbatches per global step
    sweep_steps: int = 4
    routing: str = ""  # the mesh trainers' SWARM_ROUTING ("": the trainer's default)
    max_staleness: int = 0  # the mesh servers' SWARM_MAX_STALENESS (0: the server's default)
    schedule: str = ""  # the mesh coordinator's SWARM_SCHEDULE ("": its default)
    optimizer: str = ""  # the mesh servers' SWARM_OPTIMIZER, and pipelining's optimizer ("": the servers' default)
    beta1: float = 0.0  # the mesh servers' SWARM_BETA1, and pipelining's (0: the servers' default)
    sync: str = ""  # the mesh servers' SWARM_SYNC ("": their default, global)
    local_steps: int = 0  # the mesh servers' SWARM_LOCAL_STEPS under sync local (0: their default)
    first: int = -1  # the mesh server started FIRST_HEAD_S before the others (-1: all at once, in index order)
    log_level: str = ""  # the mesh's processes' SWARM_LOG_LEVEL ("": warning, info for the coordinator and trainers)
    pipelining: bool = True  # False: the mesh sides only (a diagnosis; no ratio is printed)
    codecs: tuple[str, ...] = (
        "int8",
        "fp32",
    )  # the mesh sides, one per wire codec: the default one, and fp32 to set the codec apart
    # the mesh coordinator's SWARM_AVERAGING_CODEC, a mesh side each with every wire codec ("": its default)
    round_codecs: tuple[str, ...] = ("",)
    extra: dict = field(default_factory=dict)

    @property
    def mesh_routing(self) -> str:
        from shared.config import TrainerSettings

        return self.routing or TrainerSettings.model_fields["routing"].default


def _homogeneous(rate: float, budget_s: float, sweep: bool = False) -> Scenario:
    return Scenario(
        f"homogeneous-{rate:g}",
        ((rate, HOMOGENEOUS_CPUS),) * 4,
        10.0,
        rate,
        budget_s,
        sweep_mesh=sweep,
        description=(
            f"4 stages x 1 peer, every link {rate:g} Mbit/s and 10 ms (20 ms one way peer to peer), stage peers capped "
            f"at {HOMOGENEOUS_CPUS} cores"
        ),
    )


# caps in the ratio 1:1:2:2:2:4:4:4, links 10-100 Mbit/s mixed (strong peers on slow links too)
HETERO_SERVERS = tuple(
    (rate, units * HETERO_UNIT)
    for rate, units in ((100, 1), (20, 1), (10, 2), (50, 2), (100, 2), (20, 4), (50, 4), (100, 4))
)
HETERO = Scenario(
    "heterogeneous",
    HETERO_SERVERS,
    10.0,
    100,
    150.0,
    rebalance_every_s=10.0,
    sweep_mesh=True,
    description=(
        "8 servers, CPU caps 1:1:2:2:2:4:4:4 (1.6 cores in all), links 10-100 Mbit/s mixed, 10 ms each; mesh: stages "
        "assigned and rebalanced by the coordinator (each server declares its link's rate, SWARM_LINK_MBIT)"
    ),
)
FULL = Plan(
    work=Workload(d_model=256, n_layer=8, seq_len=64),  # microbatches of 8, 32 samples per global step
    scenarios=(
        _homogeneous(10, 200.0, sweep=True),
        _homogeneous(50, 150.0, sweep=True),
        _homogeneous(200, 150.0, sweep=True),
        HETERO,
        Scenario(
            "churn",
            HETERO_SERVERS,
            10.0,
            100,
            600.0,
            churn=(6, 4),
            rebalance_every_s=10.0,
            target_steps=24,
            checkpoint_every_s=20.0,
            description=(
                "heterogeneous, with a kill every 6 global steps (at 6, 12, 18, ...: the second every live replica "
                "of the stage with the fewest, its last replica among them; every other one a random stage server), "
                "each victim restarted 4 global steps after its kill (a side that takes no step for "
                f"{CHURN_STALL_S:g} s gets its longest-down victim back at once); a later target, so that the runs see "
                "3 kills before it; the mesh also runs without kills, for its own reference"
            ),
        ),
    ),
    target_steps=8,
    eval_every=2,
    # microbatches of 8, 4 and 2 samples, as pipelining's candidates cut its global batch of 32
    mesh_settings=((1, 4), (1, 8), (2, 8), (1, 8, 4), (2, 8, 4), (1, 16, 2), (2, 16, 2)),
    pipeline_candidates=(4, 8, 16),  # Schedule1F1B needs at least as many microbatches as stages
)
QUICK = Plan(
    work=Workload(d_model=64, n_layer=2, seq_len=32, microbatch_size=4, samples_per_step=8),
    scenarios=(
        Scenario(
            "quick",
            ((50, 0.5), (50, 0.5)),
            5.0,
            50,
            20.0,
            stages=2,
            description="2 stages x 1 peer capped at 0.5 cores, links 50 Mbit/s and 5 ms",
        ),
    ),
    target_steps=2,
    eval_every=1,
    mesh_settings=((1, 2),),
    pipeline_candidates=(2,),
)


# ------------------------------------------------------------------------------ the target
def reference_targets(work: Workload, stages: int, steps: set[int]) -> dict[int, float]:
    """The held-out loss (4 decimals, as the sides print theirs) of the model trained in this
    process, as ``stages`` stages each with the stage servers' optimizer and clipping, after
    each number of global steps in ``steps``: what the sides must reach."""
    from bench.arena_pipelining import loss_fn, stock_optimizer, stock_optimizer_config
    from shared.model import build_stage

    optim = stock_optimizer_config()
    models = [build_stage(work.gpt_config(), s, stages, seed=0) for s in range(stages)]
    optimizers = [stock_optimizer(m, optim) for m in models]
    batcher, n = work.batcher(), work.microbatches_per_step

    targets = {}
    for step in range(max(steps)):
        for i in range(n):
            mb = batcher.microbatch(step * n + i)
            (loss_fn(forward(models, mb.inputs), mb.targets) / n).backward()
        reference_step(models, optimizers, optim, step)
        if step + 1 in steps:
            targets[step + 1] = held_out_loss(models, work)
    return targets


def reference_step(models: list[torch.nn.Module], optimizers, optim, step: int) -> None:
    """Global step ``step`` of the reference's stages on their accumulated gradients, as a
    stage server takes it: each stage clipped to its norm, the schedule's learning rate, AdamW."""
    for m, opt in zip(models, optimizers):
        torch.nn.utils.clip_grad_norm_(list(m.parameters()), optim.max_grad_norm)
        for group in opt.param_groups:
            group["lr"] = optim.lr_at(step)
        opt.step()
        opt.zero_grad(set_to_none=True)


# ------------------------------------------------------------------------------ compute against transfer
WIRE_BYTES_PER_VALUE = {
    "fp32": 4.0,
    "int8": 1.0 + 2 / 128,
    "int4": 0.5 + 2 / 64,
}  # int8: a code a value, a bfloat16 scale per block of 128; int4: half a byte, a scale per 64


def stage_compute_s(work: Workload, stages: int, reps: int = 5) -> float:
    """Seconds of one middle stage's forward and backward of one microbatch, one thread, uncapped
    (median of ``reps`` after a warm-up): the stage servers' compute per hop at a full core."""
    from shared.model import build_stage

    stage = build_stage(work.gpt_config(), min(1, stages - 1), stages, seed=0)
    x = torch.randn(work.microbatch_size, work.seq_len, work.d_model, requires_grad=True)
    times = []
    for _ in range(reps + 1):
        started = time.perf_counter()
        out = stage(x)
        out.backward(torch.ones_like(out))
        times.append(time.perf_counter() - started)
        stage.zero_grad(set_to_none=True)
    return sorted(times[1:])[reps // 2]


def hop_ratios(work: Workload, compute_s: float, servers: tuple[tuple[float, float | None], ...]) -> list[dict]:
    """Per distinct (link, CPU cap): a hop's compute (forward and backward at the cap) over the
    time its activation and its gradient take on the link, per codec: the square-cube ratio
    that docs/benchmarks.md sets against SWARM's T4 at 200 Mbit/s."""
    values = work.microbatch_size * work.seq_len * work.d_model
    rows = []
    for rate, cpus in sorted(set(servers)):
        compute = compute_s / (cpus or 1.0)
        row = {"link_mbit": rate, "cpus": round(cpus, 3) if cpus else None, "compute_s": round(compute, 4)}
        for codec, per_value in WIRE_BYTES_PER_VALUE.items():
            transfer = 2 * values * per_value * 8 / (rate * 1e6)  # the activation forward, its gradient back
            row[f"transfer_s_{codec}"], row[f"ratio_{codec}"] = round(transfer, 4), round(compute / transfer, 2)
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------ watching a side
class Watch:
    """Follows a process's JSON-lines log (a trainer's structlog events, a pipelining rank's
    lines): the events seen so far, read as the log grows."""

    def __init__(self, path: Path):
        self.path, self.offset, self.events = path, 0, []

    def poll(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        new = []
        for line in complete.decode(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    new.append(json.loads(line))
                except ValueError:
                    continue
        self.events += new
        return new


@dataclass
class Outcome:
    """One side's run: its evaluation curve and what the links carried."""

    curve: list[dict] = field(default_factory=list)  # {step, elapsed_s, loss}
    steps: int = 0
    elapsed_s: float = 0.0  # training time at ``steps``
    reached_s: float | None = None  # training time when the held-out loss first reached the target
    reached_step: int | None = None  # the global step of that evaluation
    bytes_sent: int = 0
    stopped: str = ""  # why the run ended: target, budget, a kill (pipelining under churn)
    kills: list[dict] = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    step_times: dict[int, float] = field(default_factory=dict)  # step -> training time when the side saw it done

    def point(self, step: int, elapsed_s: float, loss: float | None, target: float, **extra: float) -> None:
        if loss is not None:
            self.curve.append({"step": step, "elapsed_s": round(elapsed_s, 2), "loss": round(loss, 4), **extra})
            if self.reached_s is None and loss <= target:
                self.reached_s, self.reached_step = elapsed_s, step

    def exact(self, snapshots: Path, work: Workload, stages: int, target: float, layers=None) -> None:
        """Every step evaluated from the side's snapshots (:func:`snapshot_curve`), after the
        run: the curve, steps and time to target come from them; what the side evaluated
        while it trained (the mesh beside its training, pipelining every ``eval_every``
        steps: the stop signal) moves to ``extra["during_training"]``. The snapshots are
        deleted then (26 MB a step at the full plan's size)."""
        curve = snapshot_curve(snapshots, work, stages, target, self.step_times, layers)
        shutil.rmtree(snapshots, ignore_errors=True)
        self.extra["during_training"] = {
            "curve": self.curve,
            "reached_step": self.reached_step,
            "reached_s": self.reached_s,
        }
        # a step the side never saw done (written past its clock, the run over) has no time: not reached
        hit = next((p for p in curve if p["loss"] <= target and p["elapsed_s"] is not None), None)
        self.curve = curve
        self.reached_step = hit["step"] if hit else None
        self.reached_s = hit["elapsed_s"] if hit else None


class SideRun:
    """What one side needs from the arena: environments, logs, the bytes on its links."""

    def __init__(self, arena: Arena, scenario: Scenario, plan: Plan, logs: Path, label: str):
        self.arena, self.sc, self.plan, self.logs, self.label = arena, scenario, plan, logs, label
        self.run_id = f"arena-{label}"
        logs.mkdir(parents=True, exist_ok=True)

    def log(self, name: str) -> Path:
        path = self.logs / f"{self.label}-{name}.log"
        path.unlink(missing_ok=True)
        return path

    def sent(self, peers: list[str]) -> int:
        counters = self.arena.counters()
        return sum(counters[p]["sent"] for p in peers)

    def url(self, peer: str, port: int) -> str:
        return f"http://{self.arena.peers[peer].address}:{port}"

    def base_env(self) -> dict[str, str]:
        return {
            "SWARM_RUN_ID": self.run_id,
            "SWARM_MDNS": "false",
            "SWARM_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1",
            "SWARM_LOG_LEVEL": self.plan.log_level or "warning",
            "SWARM_NUM_STAGES": str(self.sc.stages),
        }

    def log_level(self, default: str) -> str:
        return self.plan.log_level or default


# ------------------------------------------------------------------------------ the mesh
class MeshSide(SideRun):
    def __init__(self, *args, codec: str, round_codec: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self.codec, self.round_codec = codec, round_codec
        self.servers: dict[str, object] = {}
        self.coordinator = self.url("coord", COORD_PORT)
        self.checkpoints = self.logs / f"{self.label}-checkpoints"
        self.snapshots: Path | None = None  # where the servers write every step's weights (the run, not the sweep)

    def start_swarm(self) -> None:
        env = {
            **self.base_env(),
            "SWARM_HOST": self.arena.peers["coord"].address,
            "SWARM_PORT": str(COORD_PORT),
            "SWARM_STATE_DB": str(self.logs / f"{self.label}-coordinator.sqlite"),
            "SWARM_REBALANCE_EVERY_S": str(self.sc.rebalance_every_s),
            "SWARM_HOT_SPARES": "true",  # replicas whose stage does not need them hold no samples (policy.spares)
            # its joins, moves and rounds: a few lines a step, none per microbatch
            "SWARM_LOG_LEVEL": self.log_level("info"),
        }
        if self.plan.schedule:
            env["SWARM_SCHEDULE"] = self.plan.schedule
        if self.round_codec:  # the codec of the step rounds' parts (the coordinator names it for each round)
            env["SWARM_AVERAGING_CODEC"] = self.round_codec
        if self.plan.max_staleness:  # the coordinator's async schedule admits steps within it
            env["SWARM_MAX_STALENESS"] = str(self.plan.max_staleness)
        (self.logs / f"{self.label}-coordinator.sqlite").unlink(missing_ok=True)
        if (
            self.sc.checkpoint_every_s
        ):  # one directory the coordinator writes and restarted servers read (a shared volume in a deployment)
            shutil.rmtree(self.checkpoints, ignore_errors=True)
            env.update(
                SWARM_CHECKPOINT_DIR=str(self.checkpoints), SWARM_CHECKPOINT_EVERY_S=str(self.sc.checkpoint_every_s)
            )
        self.arena.popen("coord", [sys.executable, "-m", "services.coordinator"], env=env, log=self.log("coordinator"))
        first = self.plan.first if 0 <= self.plan.first < len(self.sc.servers) else None
        if first is not None:  # an arrival order: this one asks for its stage before the others start
            self.start_server(f"s{first}", first)
            time.sleep(FIRST_HEAD_S)
        for i in range(len(self.sc.servers)):
            if i != first:
                self.start_server(f"s{i}", i)
        # formed: every server registered and, where the coordinator places them, a rebalancing
        # check that saw them all found nothing to move (a slow link it took out of the weakest
        # stage is a formation's work, as pipelining's placement is its operator's)
        for key in ("servers", "placement_settled") if self.sc.rebalance_every_s else ("servers",):
            self.arena.run(
                "coord",
                [
                    sys.executable,
                    "-m",
                    "bench.arena_probe",
                    "wait-http",
                    "--url",
                    f"{self.coordinator}/health",
                    "--key",
                    key,
                    "--at-least",
                    str(len(self.sc.servers)),
                    "--timeout",
                    str(START_TIMEOUT_S),
                ],
                timeout_s=START_TIMEOUT_S,
            )

    def start_server(self, peer: str, index: int) -> None:
        w = self.plan.work
        stage = "auto" if self.sc.rebalance_every_s else str(index % self.sc.stages)
        env = {
            **self.base_env(),
            "SWARM_HOST": self.arena.peers[peer].address,
            "SWARM_PORT": str(SERVER_PORT),
            "SWARM_COORDINATOR": self.coordinator,
            "SWARM_STAGE": stage,
            "SWARM_WIRE_CODEC": self.codec,
            "SWARM_GLOBAL_BATCH": str(w.samples_per_step),
            "SWARM_DRAIN_TIMEOUT_S": "2",
            # what its operator would say of its link: the rate it is shaped to (a slow one joins where it costs least)
            "SWARM_LINK_MBIT": f"{self.sc.servers[index][0]:g}",
        }
        if self.plan.max_staleness:
            env["SWARM_MAX_STALENESS"] = str(self.plan.max_staleness)
        if self.plan.optimizer:
            env["SWARM_OPTIMIZER"] = self.plan.optimizer
        if self.plan.beta1:
            env["SWARM_BETA1"] = str(self.plan.beta1)
        if self.plan.sync:
            env["SWARM_SYNC"] = self.plan.sync
        if self.plan.local_steps:
            env["SWARM_LOCAL_STEPS"] = str(self.plan.local_steps)
        if self.sc.checkpoint_every_s:
            env["SWARM_CHECKPOINT_DIR"] = str(self.checkpoints)
        if self.snapshots is not None:
            env["SWARM_STEP_SNAPSHOT_DIR"] = str(self.snapshots)
        self.servers[peer] = self.arena.popen(
            peer,
            [sys.executable, "-m", "bench.stage_proc", *self.model_args()],
            env=env,
            log=self.logs / f"{self.label}-{peer}.log",
        )

    def model_args(self) -> list[str]:
        """The model's dimensions for ``bench.stage_proc`` (servers and trainers alike)."""
        return [f"--bench-{k.replace('_', '-')}={v}" for k, v in self.plan.work.dims.items()]

    def start_trainers(
        self,
        trainers: int,
        in_flight: int,
        *,
        start_step: int,
        steps: int,
        eval_every: int,
        tag: str,
        microbatch_size: int,
    ) -> list[Path]:
        w, logs = self.plan.work, []
        for t in range(trainers):
            env = {
                **self.base_env(),
                "SWARM_COORDINATOR": self.coordinator,
                "SWARM_SEQ_LEN": str(w.seq_len),
                "SWARM_MICROBATCH_SIZE": str(microbatch_size),
                "SWARM_WIRE_CODEC": self.codec,
                "SWARM_IN_FLIGHT": str(max(1, in_flight // trainers)),
                "SWARM_STEPS": str(steps),
                "SWARM_START_STEP": str(start_step),
                "SWARM_SHARD_INDEX": str(t),
                "SWARM_NUM_SHARDS": str(trainers),
                "SWARM_EVAL_EVERY": str(eval_every if t == 0 else 0),
                "SWARM_LOG_FORMAT": "json",
                "SWARM_LOG_LEVEL": self.log_level("info"),
                "SWARM_LOG_EVERY": "1",
                "SWARM_PROGRESS": "off",
                "SWARM_FINAL_AVERAGE": "false",
                "SWARM_ROUTING": self.plan.mesh_routing,
            }
            logs.append(self.log(f"{tag}-t{t}"))
            self.arena.popen(
                f"t{t}",
                [sys.executable, "-m", "bench.stage_proc", "trainer", *self.model_args()],
                env=env,
                log=logs[-1],
            )
        return logs

    def stop_trainers(self, trainers: int) -> None:
        for t in range(trainers):
            for proc in list(self.arena.peers[f"t{t}"].processes):
                self.arena.kill(f"t{t}", proc)

    def sweep(self, settings: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], list[dict]]:
        """Tokens/s of each (trainers, in flight[, microbatch size]) over ``sweep_steps`` steps on one swarm."""
        steps, done, rows = self.plan.sweep_steps, 0, []
        tokens_per_step = self.plan.work.samples_per_step * self.plan.work.seq_len
        for setting in settings:
            trainers, in_flight, size = _mesh_setting(setting, self.plan.work)
            watch = Watch(
                self.start_trainers(
                    trainers,
                    in_flight,
                    start_step=done,
                    steps=done + steps,
                    eval_every=0,
                    tag=f"sweep{trainers}x{in_flight}x{size}",
                    microbatch_size=size,
                )[0]
            )
            seen = self._follow(
                watch,
                lambda ev, until_step=done + steps: ev.get("event") == "train.step" and ev.get("step", 0) >= until_step,
                START_TIMEOUT_S + 60 * steps,
            )
            times = {ev["step"]: ev["elapsed_s"] for ev in seen if ev.get("event") == "train.step"}
            first, last = min(times), max(times)
            rate = (
                (last - first) * tokens_per_step / (times[last] - times[first])
                if last > first and times[last] > times[first]
                else 0.0
            )
            rows.append(
                {"trainers": trainers, "in_flight": in_flight, "microbatch_size": size, "tokens_per_s": round(rate, 1)}
            )
            self.stop_trainers(trainers)
            done = last
        best = max(rows, key=lambda r: r["tokens_per_s"])
        return (best["trainers"], best["in_flight"], best["microbatch_size"]), rows

    def train_to_target(self, trainers: int, in_flight: int, microbatch_size: int, target: float) -> Outcome:
        out, sc = Outcome(), self.sc
        peers = [p for p in self.arena.peers if p.startswith("s")] + [f"t{t}" for t in range(trainers)] + ["coord"]
        sent0 = self.sent(peers)
        # no evaluation on the stage servers' cores while training: the snapshots are
        # evaluated beside it, at the lowest CPU priority, as the signal to stop
        logs = self.start_trainers(
            trainers, in_flight, start_step=0, steps=100_000, eval_every=0, tag="run", microbatch_size=microbatch_size
        )
        watch = Watch(logs[0])
        evaluator, evaluations = self.follow_snapshots(target, START_TIMEOUT_S + sc.budget_s + 60)
        try:
            started_at, churn = None, ChurnPlan(*sc.churn) if sc.churn else None
            meters = None  # the servers' MFU meters when the training clock started, and when
            deadline = time.monotonic() + START_TIMEOUT_S + sc.budget_s + 60
            while time.monotonic() < deadline:
                for ev in evaluations.poll():  # credited at the time the trainer saw its step done
                    at = out.step_times.get(ev["step"], out.elapsed_s)
                    out.point(ev["step"], at, ev["loss"], target)
                for ev in watch.poll():
                    if ev.get("event") == "train.start":
                        started_at = time.monotonic()
                    elif ev.get("event") == "train.step":
                        out.steps, out.elapsed_s = ev["step"], ev["elapsed_s"]
                        out.step_times.setdefault(ev["step"], ev["elapsed_s"])
                    elif ev.get("event") == "train.eval" and ev.get("when") == "before":  # its clock starts
                        meters = (self.utilisation(), time.monotonic())
                now = time.monotonic() - started_at if started_at else 0.0
                # the target's step counts once the trainer saw it done (its time): the evaluator may see
                # its snapshots first
                reached = out.reached_step is not None and out.steps >= out.reached_step
                if reached or out.elapsed_s >= sc.budget_s or now >= sc.budget_s + STALL_GRACE_S:
                    out.stopped = "target" if reached else "budget" if out.elapsed_s >= sc.budget_s else "stalled"
                    break
                if churn is not None and started_at:
                    self.churn_turn(churn, out, now)
                time.sleep(POLL_S)
            else:
                out.stopped = "timed out"
        finally:
            evaluator.kill()
            evaluator.wait()
        out.bytes_sent = self.sent(peers) - sent0
        failures = [ev for ev in watch.events if ev.get("event") == "microbatch.failed"]
        steps = [ev for ev in watch.events if ev.get("event") == "train.step"]
        out.extra = {"microbatches_failed": len(failures), "log": str(watch.path), "steps_logged": len(steps)}
        out.extra.update(_reruns(logs))
        if meters is not None:  # each stage's MFU over the training (services/trainer/utilisation.py)
            before, since = meters
            now = self.utilisation()
            out.extra["stages"] = run_utilisation(before, now, time.monotonic() - since, sc.stages)
            out.extra["per_server"] = self.per_server(before, now)
            # what the live servers counted: gradients that went into a later step than their
            # forward's weights (within SWARM_MAX_STALENESS), backwards refused as stale, samples dropped
            out.extra["servers"] = {
                key: sum(report["stats"].get(key, 0) for report in now.values())
                for key in ("stale_gradients", "stale_backwards", "samples_dropped", "samples")
            }
        return out

    def follow_snapshots(self, target: float, timeout_s: float) -> tuple[subprocess.Popen, Watch]:
        """``bench.arena_eval`` on this side's snapshots, in the arena's own namespace at the
        lowest CPU priority (``nice 19``: what the capped peers leave idle); its log, one
        JSON line per step evaluated."""
        log = self.log("snapshot-eval")
        cfg = {
            "root": str(self.snapshots),
            "work": asdict(self.plan.work),
            "stages": self.sc.stages,
            "target": target,
            "timeout_s": timeout_s,
        }
        with open(log, "wb") as f:
            proc = subprocess.Popen(
                ["nice", "-n", "19", sys.executable, "-m", "bench.arena_eval", json.dumps(cfg)],
                stdout=f,
                stderr=subprocess.STDOUT,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
        return proc, Watch(log)

    def churn_turn(self, churn: ChurnPlan, out: Outcome, now: float) -> None:
        """Kill and restart servers as ``churn`` says at the side's global step; each kill and
        each restart goes into ``out.kills``."""
        victims = churn.victims(out.steps, self.stage_members()) if churn.due(out.steps) else []
        for victim in victims:
            self.arena.kill(victim, self.servers.pop(victim))
        if victims:
            out.kills.append({"servers": victims, "step": out.steps, "killed_at_s": round(now, 1)})
            print(f"arena {self.sc.name} {self.label}: killed {victims} at step {out.steps}, {now:.1f} s", flush=True)
        for victim in churn.returning(out.steps, time.monotonic()):
            self.start_server(victim, int(victim[1:]))
            out.kills.append({"restarted": victim, "step": out.steps, "at_s": round(now, 1)})

    def stage_members(self) -> dict[int, list[str]]:
        """The live servers of each stage, as the coordinator's ``GET /swarm`` lists them (by peer)."""
        probe = [sys.executable, "-m", "bench.arena_probe", "wait-http", "--url", f"{self.coordinator}/swarm"]
        view = json.loads(self.arena.run("coord", [*probe, "--timeout", "10"], timeout_s=15))
        by_address = {self.arena.peers[p].address: p for p in self.servers}
        members: dict[int, list[str]] = {}
        for stage in view["stages"]:
            hosts = (r["url"].split("//", 1)[1].rsplit(":", 1)[0] for r in stage["replicas"])
            members[stage["stage"]] = sorted(by_address[h] for h in hosts if h in by_address)
        return members

    def utilisation(self) -> dict[str, dict]:
        """Each live server's MFU meter (its ``GET /health``, read from the first trainer's
        namespace) with its stage, by URL; a server that does not answer is left out."""
        found = {}
        for peer in list(self.servers):
            url = self.url(peer, SERVER_PORT)
            probe = [sys.executable, "-m", "bench.arena_probe", "wait-http", "--url", f"{url}/health", "--timeout", "5"]
            try:
                health = json.loads(self.arena.run("t0", probe, timeout_s=10))
            except (RuntimeError, ValueError):
                continue  # killed by the churn, or draining
            if isinstance(health.get("utilisation"), dict):
                found[url] = {**health["utilisation"], "stage": health["stage"], "stats": health.get("stats") or {}}
        return found

    def per_server(self, before: dict[str, dict], after: dict[str, dict]) -> list[dict]:
        """Each live server's share of the training between two :meth:`utilisation` readings:
        its peer and CPU cap, its stage, the tokens it trained and its seconds of compute (where
        a weak peer's microbatches went, and how busy it was)."""
        caps = {self.url(peer, SERVER_PORT): (peer, self.arena.peers[peer].spec.cpus) for peer in self.servers}
        rows = []
        for url, end in sorted(after.items()):
            start = before.get(url)
            if start is None or start["stage"] != end["stage"] or start["tokens_trained"] > end["tokens_trained"]:
                start = {"tokens_trained": 0, "compute_s": 0.0}
            peer, cpus = caps.get(url, (url, None))
            rows.append(
                {
                    "peer": peer,
                    "cpus": cpus,
                    "stage": end["stage"],
                    "tokens_trained": end["tokens_trained"] - start["tokens_trained"],
                    "compute_s": round(end["compute_s"] - start["compute_s"], 2),
                }
            )
        return rows

    def _follow(self, watch: Watch, until, timeout_s: float) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(until(ev) for ev in watch.poll()):
                return watch.events
            for proc in self.arena.peers["t0"].processes:
                if proc.poll() is not None:
                    raise RuntimeError(f"the trainer exited ({proc.returncode}); see {watch.path}")
            time.sleep(POLL_S)
        raise RuntimeError(f"the trainer did not get there in {timeout_s:.0f} s; see {watch.path}")


def _reruns(trainer_logs: list[Path]) -> dict:
    """Microbatches the trainers completed and ran again after a stale refusal (each
    trainer's last ``train.step`` event), and the re-runs' share of them."""
    done = reruns = 0
    for log in trainer_logs:
        last = next((ev for ev in reversed(Watch(log).poll()) if ev.get("event") == "train.step"), {})
        done, reruns = done + last.get("microbatches", 0), reruns + last.get("reruns", 0)
    return {"microbatches": done, "microbatch_reruns": reruns, "rerun_share": round(reruns / done, 4) if done else None}


def run_mesh(
    arena: Arena,
    sc: Scenario,
    plan: Plan,
    logs: Path,
    codec: str,
    setting: tuple[int, ...] | None,
    target: float,
    round_codec: str = "",
    suffix: str = "",
) -> tuple[Outcome, tuple[int, ...], list[dict]]:
    """One mesh side: a fresh swarm for the sweep (when ``setting`` is None), a fresh one for
    the run (its logs named by the codecs, then ``suffix``); ``round_codec``: its step
    rounds' (the coordinator's default where empty)."""
    sweep_rows: list[dict] = []
    name = codec + (f"-rounds-{round_codec}" if round_codec else "")
    if setting is None and len(plan.mesh_settings) == 1:
        setting = plan.mesh_settings[0]  # nothing to choose between
    if setting is None:
        side = MeshSide(arena, sc, plan, logs, f"{name}-sweep", codec=codec, round_codec=round_codec)
        try:
            side.start_swarm()
            setting, sweep_rows = side.sweep(plan.mesh_settings)
        finally:
            arena.stop_processes(first=TRAINERS)
    side = MeshSide(arena, sc, plan, logs, name + suffix, codec=codec, round_codec=round_codec)
    side.snapshots = logs / f"{side.label}-snapshots"
    shutil.rmtree(side.snapshots, ignore_errors=True)
    try:
        side.start_swarm()
        trainers, in_flight, size = _mesh_setting(setting, plan.work)
        outcome = side.train_to_target(trainers, in_flight, size, target=target)
    finally:
        arena.stop_processes(first=TRAINERS)
    outcome.exact(side.snapshots, plan.work, sc.stages, target)
    return outcome, setting, sweep_rows


def _mesh_setting(setting: tuple[int, ...], work: Workload) -> tuple[int, int, int]:
    """(trainers, in flight, samples a microbatch) of a mesh setting, the workload's size where it names none."""
    trainers, in_flight, *size = setting
    return trainers, in_flight, size[0] if size else work.microbatch_size


# ------------------------------------------------------------------------------ pipelining
_GLOO_RUNS = 0


def run_pipelining(
    arena: Arena, sc: Scenario, plan: Plan, logs: Path, target: float, layers: list[int] | None = None
) -> tuple[Outcome, int, list[dict]]:
    """Pipelining on the scenario's strongest servers: ``layers`` per rank (None: equal splits)."""
    global _GLOO_RUNS
    _GLOO_RUNS += 1
    side = SideRun(arena, sc, plan, logs, "pipelining" if layers is None else "pipelining-balanced")
    ranks = sc.pipeline_ranks()
    out, sweep_rows, microbatches = Outcome(), [], plan.pipeline_candidates[0]
    watch = None
    snapshots = logs / f"{side.label}-snapshots"
    shutil.rmtree(snapshots, ignore_errors=True)
    try:
        for r, peer in enumerate(ranks):
            cfg = {
                "rank": r,
                "world": len(ranks),
                "master_addr": arena.peers[ranks[0]].address,
                "master_port": GLOO_PORT + _GLOO_RUNS,
                "ifname": arena.peers[peer].veth_peer,
                "work": asdict(plan.work),
                "candidates": list(plan.pipeline_candidates),
                "eval_every": plan.eval_every,
                "target": target,
                "budget_s": sc.budget_s,
                "layers": layers,
                "snapshots": str(snapshots),
                "optimizer": plan.optimizer,
                "beta1": plan.beta1,
            }
            log = side.log(f"rank{r}")
            arena.popen(
                peer,
                [sys.executable, "-m", "bench.arena_pipelining", json.dumps(cfg)],
                env={"OMP_NUM_THREADS": "1"},
                log=log,
            )
            if r == len(ranks) - 1:
                watch = Watch(log)
        sent0, started_at = None, None
        churn = ChurnPlan(*sc.churn) if sc.churn else None
        idle = tuple(f"s{i}" for i in range(len(sc.servers)) if f"s{i}" not in ranks)
        sweep_allowance = START_TIMEOUT_S + 3 * 2 * len(plan.pipeline_candidates) * 60
        deadline = time.monotonic() + sweep_allowance + sc.budget_s + 60
        while time.monotonic() < deadline:
            for ev in watch.poll():
                if ev["event"] == "sweep":
                    sweep_rows.append({k: v for k, v in ev.items() if k != "event"})
                elif ev["event"] == "start":
                    microbatches, started_at, sent0 = ev["microbatches"], time.monotonic(), side.sent(ranks)
                elif ev["event"] == "step":
                    out.steps, out.elapsed_s = ev["step"], ev["elapsed_s"]
                    out.step_times[ev["step"]] = ev["elapsed_s"]
                elif ev["event"] == "eval":
                    out.steps, out.elapsed_s = ev["step"], ev["elapsed_s"]
                    out.point(ev["step"], ev["elapsed_s"], ev["loss"], target)
                elif ev["event"] == "done":
                    out.steps, out.elapsed_s = ev["steps"], ev["elapsed_s"]
                    out.stopped = "target" if out.reached_s is not None else "budget"
            if out.stopped:
                break
            now = time.monotonic() - started_at if started_at else 0.0
            victims = churn.victims(out.steps, dict(enumerate([r] for r in ranks)), idle) if churn else []
            if victims:  # the mesh's schedule, by this side's steps; a victim not among its ranks idled
                out.kills.append({"servers": victims, "step": out.steps, "killed_at_s": round(now, 1)})
                hit = [v for v in victims if v in ranks]
                if hit:  # a pipeline with a dead stage cannot go on: record where it stopped
                    for proc in list(arena.peers[hit[0]].processes):
                        arena.kill(hit[0], proc)
                    out.stopped = f"{hit[0]} killed at step {out.steps}, {now:.0f} s"
                    break
            for peer in ranks:
                for proc in arena.peers[peer].processes:
                    if proc.poll() not in (None, 0):
                        raise RuntimeError(f"pipelining's rank in {peer} exited with {proc.returncode}; see {logs}")
            time.sleep(POLL_S)
        else:
            out.stopped = "timed out"
        out.bytes_sent = side.sent(ranks) - sent0 if sent0 is not None else 0
    finally:
        arena.stop_processes()
    out.exact(snapshots, plan.work, sc.stages, target, layers)
    return out, microbatches, sweep_rows


# ------------------------------------------------------------------------------ the bench
def _links(arena: Arena, sc: Scenario, quick: bool) -> list[dict]:
    """The trainer's path to one server of each link rate, as built (bandwidth and RTT)."""
    firsts = {rate: i for i, (rate, _) in reversed(list(enumerate(sc.servers)))}
    return [
        measure_link(arena, "t0", f"s{i}", seconds=1.0 if quick else 2.0, pings=5 if quick else 10)
        for _, i in sorted(firsts.items())
    ]


def _row(
    sc: Scenario, side: str, setting: str, out: Outcome, plan: Plan, bound: float, layers: list[int] | None = None
) -> dict:
    tokens = out.steps * plan.work.samples_per_step * plan.work.seq_len
    if out.reached_s is not None:
        ttt = round(out.reached_s, 1)
    else:
        best = min((p["loss"] for p in out.curve), default=None)
        ttt = f"not reached ({out.stopped}; best {best} in {out.elapsed_s:.1f} s)"
    return {
        "scenario": sc.name,
        "side": side,
        "best setting": setting,
        "time to target s": ttt,
        "steps to target": out.reached_step,
        "tokens/s": round(tokens / out.elapsed_s, 1) if out.elapsed_s else 0.0,
        "bytes/token": round(out.bytes_sent / tokens) if tokens else None,
        "compute bound (x pipelining)": round(bound, 2),
        "MFU per stage": _stage_mfu(side, out, plan, sc.stages, tokens, layers),
        **(
            {"re-runs": f"{out.extra['microbatch_reruns']} of {out.extra['microbatches']}"}
            if "microbatches" in out.extra
            else {}
        ),
    }


def _stage_mfu(
    side: str, out: Outcome, plan: Plan, stages: int, tokens: int, layers: list[int] | None = None
) -> list[float | None]:
    """Each stage's wall MFU over the training: the mesh's stage servers measure theirs (model
    FLOPs of what they trained and evaluated, over the peak of their thread, ``out.extra``);
    pipelining's, one rank and thread per stage, from its tokens/s and each stage's FLOPs per token."""
    if not side.startswith("pipelining"):
        return [s["mfu_wall"] for s in out.extra.get("stages", [])]
    if not out.elapsed_s:
        return [None] * stages
    cfg, peak = plan.work.gpt_config(), resolve_peak("cpu", "fp32", threads=1).flops  # the servers' (one cache)
    specs = partition(cfg, stages)
    if layers:
        starts = [sum(layers[:r]) for r in range(stages)]
        specs = [StageSpec(r, stages, range(starts[r], starts[r] + layers[r])) for r in range(stages)]
    return [
        round(tokens / out.elapsed_s * stage_flops(cfg, spec).per_token(plan.work.seq_len) / peak, 6) for spec in specs
    ]


def _ratios(rows: list[dict]) -> None:
    """The mesh's rows against pipelining's (equal splits) and, where it ran, the speed-balanced one."""
    pipe = next((r for r in rows if r["side"] == "pipelining"), None)
    if pipe is None:
        return  # the mesh alone (--no-pipelining)
    balanced = next((r for r in rows if r["side"] == "pipelining balanced"), None)
    for r in rows:
        if r["side"].startswith("pipelining"):
            continue
        r["mesh / pipelining time"] = _sooner(r, pipe)
        if balanced is not None:
            r["mesh / balanced time"] = _sooner(r, balanced)
        if pipe["tokens/s"]:
            r["mesh / pipelining tok/s"] = round(r["tokens/s"] / pipe["tokens/s"], 2)


def _sooner(mesh: dict, pipe: dict) -> float | str | None:
    """How many times sooner the mesh reached the target than ``pipe``."""
    a, b = mesh["time to target s"], pipe["time to target s"]
    if isinstance(a, float) and isinstance(b, float):
        return round(b / a, 2)
    if isinstance(a, float):
        return f"{pipe['side']} did not reach it"
    return None


def run_scenario(
    sc: Scenario,
    plan: Plan,
    target: float,
    compute_s: float,
    logs: Path,
    quick: bool,
    best_mesh: tuple[int, ...] | None,
) -> tuple[list[dict], dict, tuple[int, ...]]:
    trainers = max(setting[0] for setting in plan.mesh_settings)
    ranks = sc.pipeline_ranks()
    cores = [cap or 1.0 for _, cap in sc.servers]
    bounds = compute_bounds(cores, sc.stages, plan.work, [int(r[1:]) for r in ranks])
    equal = [len(spec.layers) for spec in partition(plan.work.gpt_config(), sc.stages)]
    balanced = bounds["balanced_layers"] if bounds["balanced_layers"] != equal else None
    detail: dict = {
        "scenario": asdict(sc),
        "ranks": ranks,
        "hop_ratios": hop_ratios(plan.work, compute_s, sc.servers),
        "compute_bounds": bounds,
    }
    with Arena(sc.peer_specs(trainers)) as arena:
        detail["links"] = _links(arena, sc, quick)
        detail["qdiscs"] = arena.qdiscs()
        measured = [
            (x["set_mbit"], x["mbit_s"], x["set_rtt_ms"], x["rtt_ms"], x["rtt_ms_min"]) for x in detail["links"]
        ]
        print(f"arena {sc.name}: links {measured}", flush=True)
        rows = []
        setting = None if sc.sweep_mesh or best_mesh is None else best_mesh
        for codec, round_codec in itertools.product(plan.codecs, plan.round_codecs):
            out, setting, sweep = run_mesh(
                arena, sc, plan, logs / sc.name, codec, setting, target, round_codec=round_codec
            )
            name = codec + (f", rounds {round_codec}" if round_codec else "")
            key = f"mesh_{codec}" + (f"_rounds_{round_codec}" if round_codec else "")
            detail[key] = asdict(out) | {"sweep": sweep}
            n_trainers, in_flight, size = _mesh_setting(setting, plan.work)
            described = f"{n_trainers} trainer(s), {in_flight} in flight of {size}, {plan.mesh_routing}"
            bound = bounds["mesh"] / bounds["pipelining"]
            rows.append(_row(sc, f"mesh {name}", described, out, plan, bound))
            print(f"arena {sc.name}: {rows[-1]}", flush=True)
            if sc.churn:  # the mesh's own reference: the same scenario without its kills
                calm_sc = replace(sc, churn=None)
                calm, _, _ = run_mesh(
                    arena, calm_sc, plan, logs / sc.name, codec, setting, target, round_codec, "-no-kills"
                )
                detail[f"{key}_no_kills"] = asdict(calm)
                rows.append(_row(sc, f"mesh {name}, no kills", described, calm, plan, bound))
                rows[-2]["with / without kills, time"] = _sooner(rows[-1], rows[-2])
                print(f"arena {sc.name}: {rows[-1]}", flush=True)
        for side, layers in (("pipelining", None), ("pipelining balanced", balanced)) if plan.pipelining else ():
            if side != "pipelining" and layers is None:
                continue  # equal splits are the balanced ones: the ranks are equal
            out, microbatches, sweep = run_pipelining(arena, sc, plan, logs / sc.name, target, layers)
            detail[side.replace(" ", "_")] = asdict(out) | {"sweep": sweep}
            pipe_setting = f"{microbatches} microbatches of {plan.work.samples_per_step // microbatches}"
            rows.append(
                _row(
                    sc,
                    side,
                    pipe_setting + (f", layers {'/'.join(map(str, layers))}" if layers else ""),
                    out,
                    plan,
                    bounds[side] / bounds["pipelining"],
                    layers,
                )
            )
            print(f"arena {sc.name}: {rows[-1]}", flush=True)
        detail["torn_down"] = {"namespaces": [arena.hub, *(p.netns for p in arena.peers.values())]}
    _ratios(rows)
    return rows, detail, setting


def run(ctx) -> BenchResult:
    why = unavailable()
    if why:
        return BenchResult(
            "arena",
            "the WAN arena",
            ["skipped"],
            [{"skipped": why}],
            notes=[f"arena: skipped: {why}"],
            summary={"skipped": why},
        )
    plan = replace(QUICK if ctx.quick else FULL, **ctx.cache.get("arena_plan", {}))
    scenarios = ctx.cache.get("arena_scenarios") or plan.scenarios
    stages = scenarios[0].stages
    started = time.monotonic()
    targets = reference_targets(
        plan.work, stages, {plan.target_steps} | {sc.target_steps for sc in scenarios if sc.target_steps}
    )
    target = targets[plan.target_steps]
    print(
        (
            f"arena: target held-out losses {targets} (one process, after that many global steps, "
            f"{time.monotonic() - started:.0f} s)"
        ),
        flush=True,
    )
    compute_s = stage_compute_s(plan.work, stages)
    rows, details, best_mesh = [], [], (plan.mesh_settings[0] if len(plan.mesh_settings) == 1 else None)
    for sc in scenarios:
        steps = sc.target_steps or plan.target_steps
        sc_rows, detail, best_mesh = run_scenario(
            sc, plan, targets[steps], compute_s, ctx.log_dir / "arena", ctx.quick, best_mesh
        )
        detail.update(target=targets[steps], target_steps=steps)
        rows += sc_rows
        details.append(detail)
    w = plan.work
    notes = [
        f"model: {w.n_layer} layers, d_model {w.d_model}, {w.n_head} heads, byte vocabulary, seq {w.seq_len}; global "
        f"steps of {w.samples_per_step} samples (mesh microbatches of {w.microbatch_size}); the stage servers' AdamW "
        "(lr warm-up 10 steps, each stage clipped to norm 1) on every side",
        f"target: held-out loss {target:.4f}, what the same model reaches in one process after {plan.target_steps} "
        "global steps (churn: its own, below); steps and time to target are exact: every side writes its weights "
        "after every global step, and after its run every step's model is evaluated here on the same 4 held-out "
        "microbatches, off the clock; time to target is the side's training time when it saw the first step at the "
        f"target done. While training, each side evaluates only to know when to stop (pipelining every "
        f"{plan.eval_every} steps between steps, off its clock; the mesh's snapshots as they come, at the lowest CPU "
        "priority, nothing on its servers); those figures are in the JSON (during_training)",
        (
            "tokens/s: tokens of the global steps done over their time; bytes/token: bytes all of a side's peers sent "
            "on their links (interface counters) per such token"
        ),
        (
            "mesh / pipelining time: pipelining's time to the target over the mesh's (above 1: the mesh got there "
            "sooner); tok/s likewise"
        ),
        (
            "MFU per stage: model FLOPs per second of training over the peak of the threads in use (one thread's "
            "measured fp32 matmul rate per stage server or rank; shared.flops, shared.peak_flops): the mesh's servers "
            "count what they trained and evaluated between the training's start and end (their busy MFU is in the "
            "JSON, scenarios' mesh_*.extra.stages); pipelining's from its tokens/s. A stage peer's CPU cap bounds it"
        ),
    ]
    for d in details:
        links = "; ".join(
            f"{link['set_mbit']:g} Mbit/s -> {link['mbit_s']}, RTT {link['set_rtt_ms']:g} -> {link['rtt_ms']} ms"
            for link in d["links"]
        )
        ratios = "; ".join(
            f"{h['link_mbit']:g} Mbit/s, {h['cpus']} cores: int8 {h['ratio_int8']}, fp32 {h['ratio_fp32']}"
            for h in d["hop_ratios"]
        )
        notes.append(
            f"{d['scenario']['name']}: {d['scenario']['description']}; target {d['target']} (after {d['target_steps']} "
            f"steps); pipelining ranks {', '.join(d['ranks'])}; links as measured (set -> measured): {links}; compute "
            f"/ transfer per hop: {ratios}"
        )
        b = d["compute_bounds"]
        notes.append(
            f"{d['scenario']['name']} compute bounds (CPU cores per layer of the slowest stage, embeddings and head "
            f"left out): mesh {b['mesh']:.4f} (its best placement, equal layers a stage), pipelining "
            f"{b['pipelining']:.4f} (ranks {', '.join(d['ranks'])}, equal splits), speed-balanced pipelining "
            f"{b['pipelining balanced']:.4f} (layers {'/'.join(map(str, b['balanced_layers']))}): the mesh's is "
            f"{b['mesh'] / b['pipelining']:.2f}x and {b['mesh'] / b['pipelining balanced']:.2f}x theirs"
        )
        for side in (*(k for k in d if k.startswith("mesh_")), "pipelining", "pipelining_balanced"):
            if side in d and d[side].get("kills"):
                notes.append(f"{d['scenario']['name']} {side.replace('_', ' ')} churn: {d[side]['kills']}")
    summary = {
        f"{r['scenario']}_{r['side'].replace(' ', '_')}_time_ratio": r.get("mesh / pipelining time")
        for r in rows
        if not r["side"].startswith("pipelining")
    } | {
        f"{r['scenario']}_{r['side'].replace(' ', '_')}_balanced_time_ratio": r["mesh / balanced time"]
        for r in rows
        if "mesh / balanced time" in r
    }
    params = {
        "work": asdict(w),
        "target": target,
        "stage_compute_s": round(compute_s, 4),
        "target_steps": plan.target_steps,
        "eval_every": plan.eval_every,
        "mesh_settings": plan.mesh_settings,
        "mesh_routing": plan.mesh_routing,
        "max_staleness": plan.max_staleness or "default",
        "schedule": plan.schedule or "default",
        "sync": plan.sync or "default",
        "round_codecs": [c or "default" for c in plan.round_codecs],
        "local_steps": plan.local_steps or "default",
        "first": f"s{plan.first}" if plan.first >= 0 else "all at once",
        "pipeline_candidates": plan.pipeline_candidates,
        "scenarios": details,
    }
    return BenchResult(
        "arena",
        "time to a target loss on shaped links: mesh int8 / fp32 against torch.distributed.pipelining",
        COLUMNS,
        rows,
        params=params,
        notes=notes,
        summary=summary,
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.arena [SCENARIO ...]``: run some of the arena's scenarios by hand."""
    from bench.__main__ import BenchContext
    from bench.report import format_table, machine, write_json
    from shared.log import configure_logging

    names = [s.name for s in FULL.scenarios + QUICK.scenarios]
    p = argparse.ArgumentParser(prog="python -m bench.arena", description=main.__doc__.split(":")[0])
    p.add_argument(
        "scenarios", nargs="*", metavar="SCENARIO", help=f"one of {', '.join(names)} (default: all of the full bench)"
    )
    p.add_argument("--list", action="store_true", help="print the scenarios and exit")
    p.add_argument("--out", default="bench/results", help="directory of the JSON result (arena-SCENARIO.json)")
    p.add_argument(
        "--routing", choices=("relay", "chain"), help="the mesh trainers' routing (default: the trainer's default)"
    )
    p.add_argument(
        "--max-staleness", type=int, default=0, help="the mesh servers' SWARM_MAX_STALENESS (default: the servers' own)"
    )
    p.add_argument("--schedule", choices=("async", "sync"), help="the mesh coordinator's SWARM_SCHEDULE")
    p.add_argument(
        "--optimizer", choices=("adamw", "nadamw"), help="the mesh servers' SWARM_OPTIMIZER, and pipelining's optimizer"
    )
    p.add_argument("--beta1", type=float, default=0.0, help="the mesh servers' SWARM_BETA1, and pipelining's")
    p.add_argument(
        "--sync", choices=("global", "local"), help="the mesh servers' SWARM_SYNC (local: DiLoCo, no round a step)"
    )
    p.add_argument("--local-steps", type=int, default=0, help="the mesh servers' SWARM_LOCAL_STEPS (with --sync local)")
    p.add_argument(
        "--log-level",
        choices=("debug", "info", "warning"),
        help="the mesh's processes' SWARM_LOG_LEVEL (debug: every hop and reservation, for a step's timeline)",
    )
    p.add_argument(
        "--first",
        metavar="SERVER",
        help=(
            f"start this mesh server (s0, s1, ...) {FIRST_HEAD_S:g} s before the others, so that it asks for its stage "
            "first (e.g. heterogeneous's 10 Mbit/s peer, s2; default: all at once, in index order)"
        ),
    )
    p.add_argument(
        "--no-pipelining", action="store_true", help="run the mesh sides only (a diagnosis: no ratio to pipelining)"
    )
    p.add_argument(
        "--codecs", metavar="C,...", help="the mesh sides' wire codecs (default int8,fp32; e.g. int4,int8,fp32)"
    )
    p.add_argument(
        "--round-codecs",
        metavar="C,...",
        help=(
            "the mesh coordinator's step-round codecs (SWARM_AVERAGING_CODEC), a mesh side each with every wire codec "
            "(default: the coordinator's own; e.g. int4,int8)"
        ),
    )
    p.add_argument(
        "--mesh",
        metavar="TxF,...",
        help=(
            "the mesh's settings to sweep, trainers x microbatches in flight [x samples a microbatch] (default: the "
            "plan's: 1x4,1x8,2x8,1x8x4,2x8x4,1x16x2,2x16x2)"
        ),
    )
    args = p.parse_args(argv)
    if args.list:
        for sc in FULL.scenarios + QUICK.scenarios:
            print(f"{sc.name:<18} {sc.description}")
        return 0
    unknown = [n for n in args.scenarios if n not in names]
    if unknown:
        p.error(f"unknown scenario {unknown[0]!r}; choose from {', '.join(names)}")
    changes: dict = {"routing": args.routing} if args.routing else {}
    if args.max_staleness:
        changes["max_staleness"] = args.max_staleness
    if args.schedule:
        changes["schedule"] = args.schedule
    if args.optimizer:
        changes["optimizer"] = args.optimizer
    if args.beta1:
        if not 0 < args.beta1 < 1:
            p.error(f"--beta1 must be in (0, 1), got {args.beta1}")
        changes["beta1"] = args.beta1
    if args.sync:
        changes["sync"] = args.sync
    if args.local_steps:
        if args.local_steps < 1 or args.sync != "local":
            p.error("--local-steps takes a count >= 1, with --sync local")
        changes["local_steps"] = args.local_steps
    if args.first:
        if not re.fullmatch(r"s[0-9]+", args.first):
            p.error(f"--first takes a server's name, s0, s1, ..., got {args.first!r}")
        changes["first"] = int(args.first[1:])
    if args.log_level:
        changes["log_level"] = args.log_level
    if args.no_pipelining:
        changes["pipelining"] = False
    if args.codecs:
        from shared.codec import FLOAT_CODECS

        changes["codecs"] = tuple(args.codecs.split(","))
        if not set(changes["codecs"]) <= set(FLOAT_CODECS):
            p.error(f"--codecs: each one of {', '.join(FLOAT_CODECS)}, got {args.codecs!r}")
    if args.round_codecs:
        from shared.config import Codec

        changes["round_codecs"] = tuple(args.round_codecs.split(","))
        if not set(changes["round_codecs"]) <= set(typing.get_args(Codec)):
            p.error(f"--round-codecs: each one of {', '.join(typing.get_args(Codec))}, got {args.round_codecs!r}")
    if args.mesh:
        try:
            changes["mesh_settings"] = tuple(tuple(int(n) for n in item.split("x")) for item in args.mesh.split(","))
        except ValueError:
            p.error(
                f"--mesh takes settings like 1x4,2x8,2x8x4 (trainers x in flight [x samples a microbatch]), "
                f"got {args.mesh!r}"
            )
        if not all(
            len(m) in (2, 3) and 1 <= m[0] <= len(TRAINERS) and m[1] >= m[0] and (len(m) == 2 or m[2] >= 1)
            for m in changes["mesh_settings"]
        ):
            p.error(
                f"--mesh: 1 to {len(TRAINERS)} trainers, at least one microbatch in flight each, microbatches of "
                "at least one sample"
            )
    # the options are good: only now the process is set up (a refusal changes nothing)
    torch.set_num_threads(1)
    configure_logging("console", "error")
    signal.signal(
        signal.SIGTERM, lambda *_: sys.exit(143)
    )  # SIGTERM and Ctrl-C take the arena down (finally blocks), as in `swarm bench`
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also where SIGINT was ignored (a background job)
    quick = bool(args.scenarios) and all(n in [s.name for s in QUICK.scenarios] for n in args.scenarios)
    ctx = BenchContext(quick=quick, log_dir=Path(args.out) / "logs")
    ctx.cache["arena_scenarios"] = tuple(
        s for s in (QUICK if quick else FULL).scenarios if not args.scenarios or s.name in args.scenarios
    )
    ctx.cache["arena_plan"] = changes
    result = run(ctx)
    print(format_table(result))
    write_json(
        result,
        Path(args.out) / f"arena-{'-'.join(args.scenarios) or 'all'}.json",
        command="python -m bench.arena " + " ".join(argv or sys.argv[1:]),
        machine_info=machine(),
        quick=quick,
    )
    return 0 if result.columns != ["error"] else 1


if __name__ == "__main__":
    sys.exit(main())
