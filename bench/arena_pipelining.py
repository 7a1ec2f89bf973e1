"""One rank of ``torch.distributed.pipelining`` in the WAN arena (``bench/arena.py``).

``python -m bench.arena_pipelining CONFIG_JSON``, run in a peer's namespace: joins the gloo
group (rank 0's peer address, this peer's veth), then

1. the sweep: for each microbatch count of the global batch, a fresh copy of the model
   (same seed) takes 2 steps; the second is timed. The fastest count wins (decided on the
   last rank, broadcast to all);
2. the run: a fresh copy trains with that count until the held-out loss reaches the
   target or the time budget is spent, evaluated every ``eval_every`` steps; with
   ``snapshots`` in the config, every rank writes its weights after every step there (as
   the mesh's servers do with ``SWARM_STEP_SNAPSHOT_DIR``), and the arena evaluates every
   step from them after the run.

The model, the data and the optimizer are the mesh's: ``shared.model.build_stage`` with
the same seed (or, with ``layers`` in the config, the layers split so: the arena's
speed-balanced pipelining), the same samples per global step (the mesh's microbatches ``step * n ..``
concatenated), the stage servers' optimizer with their defaults (weight decay on matrices
only, betas, linear warm-up, the stage's gradient clipped to ``max_grad_norm``; the
arena's ``--optimizer`` and ``--beta1`` where given). Activations cross the links in fp32,
as PyTorch sends them. The evaluation runs the same held-out microbatches forward through
the ranks (point-to-point sends, fp32) between steps; its time is left out of the clock:
pipelining is credited with its training time only.

Prints JSON lines on stdout: ``sweep`` (per count, seconds per step), ``step`` (step,
elapsed_s: its training time), ``eval`` (step, elapsed_s, loss), ``done``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from datetime import timedelta

import torch
import torch.nn.functional as F

from bench.workload import Workload
from services.stage_server.runtime import OptimizerConfig, make_optimizer
from services.stage_server.state import StepSnapshots
from shared.config import StageServerSettings
from shared.model import StageSpec, build_stage, init_stage, stage_model

EVAL_MICROBATCHES = 4  # the trainer's held-out microbatches (Trainer.eval_microbatches)
TIMEOUT_S = 300.0


def emit(event: str, **fields) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def stock_optimizer(model: torch.nn.Module, optim: OptimizerConfig) -> torch.optim.Optimizer:
    """The optimizer as a stage server builds it (``make_optimizer``): weight decay on matrices only."""
    return make_optimizer(list(model.parameters()), optim)


def stock_optimizer_config(optimizer: str = "", beta1: float = 0.0) -> OptimizerConfig:
    """The stage servers' defaults (``SWARM_LR``, ``SWARM_WEIGHT_DECAY``, ...), with the
    arena's ``SWARM_OPTIMIZER`` and ``SWARM_BETA1`` where it sets them."""
    field = StageServerSettings.model_fields
    return OptimizerConfig(
        lr=field["lr"].default,
        weight_decay=field["weight_decay"].default,
        name=optimizer or field["optimizer"].default,
        betas=(beta1 or field["beta1"].default, OptimizerConfig.betas[1]),
        warmup_steps=field["warmup_steps"].default,
        max_grad_norm=field["max_grad_norm"].default,
    )


def fresh_stage(work: Workload, rank: int, world: int, layers: list[int] | None = None) -> torch.nn.Module:
    """Stage ``rank`` of ``world`` as every side starts it (seed 0): the layers split equally
    (``partition``, the mesh's), or ``layers`` per rank (the speed-balanced pipelining)."""
    cfg = work.gpt_config()
    if not layers:
        return build_stage(cfg, rank, world, seed=0)
    start = sum(layers[:rank])
    model = stage_model(cfg, StageSpec(rank, world, range(start, start + layers[rank])))
    init_stage(model, 0)
    return model


class Rank:
    def __init__(self, cfg: dict):
        import torch.distributed as dist

        self.dist = dist
        self.rank, self.world = cfg["rank"], cfg["world"]
        self.work = Workload(**cfg["work"])
        self.batcher = self.work.batcher()
        self.optim = stock_optimizer_config(cfg.get("optimizer", ""), cfg.get("beta1", 0.0))
        self.cfg = cfg

    def fresh(self, microbatches: int):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        model = fresh_stage(self.work, self.rank, self.world, self.cfg.get("layers"))
        optimizer = stock_optimizer(model, self.optim)
        schedule = Schedule1F1B(
            PipelineStage(model, self.rank, self.world, torch.device("cpu")),
            n_microbatches=microbatches,
            loss_fn=loss_fn,
        )
        return model, optimizer, schedule

    def step_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.work.microbatches_per_step
        mbs = [self.batcher.microbatch(step * n + i) for i in range(n)]
        return torch.cat([m.inputs for m in mbs]), torch.cat([m.targets for m in mbs])

    def train_step(self, model, optimizer, schedule, step: int) -> None:
        x, y = self.step_batch(step)
        if self.rank == 0:
            schedule.step(x)
        elif self.rank == self.world - 1:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()
        torch.nn.utils.clip_grad_norm_(
            list(model.parameters()), self.optim.max_grad_norm if self.optim.max_grad_norm > 0 else math.inf
        )
        for group in optimizer.param_groups:
            group["lr"] = self.optim.lr_at(step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def evaluate(self, model) -> float:
        """The held-out loss, forward only, through the ranks (meaningful on the last rank)."""
        dist, losses = self.dist, []
        w = self.work
        with torch.no_grad():
            for i in range(EVAL_MICROBATCHES):
                mb = self.batcher.microbatch(i, split="eval")
                if self.rank == 0:
                    h = model(mb.inputs)
                else:
                    h = torch.empty(w.microbatch_size, w.seq_len, w.d_model)
                    dist.recv(h, self.rank - 1)
                    h = model(h)
                if self.rank < self.world - 1:
                    dist.send(h.contiguous(), self.rank + 1)
                else:
                    losses.append(float(loss_fn(h, mb.targets)))
        return sum(losses) / len(losses) if losses else float("nan")

    def decide(self, value: float) -> float:
        """The last rank's ``value``, on every rank."""
        t = torch.tensor([value], dtype=torch.float64)
        self.dist.broadcast(t, src=self.world - 1)
        return float(t.item())

    def sweep(self) -> int:
        timings = {}
        for n in self.cfg["candidates"]:
            model, optimizer, schedule = self.fresh(n)
            self.train_step(model, optimizer, schedule, 0)
            self.dist.barrier()
            started = time.perf_counter()
            self.train_step(model, optimizer, schedule, 1)
            self.dist.barrier()
            timings[n] = time.perf_counter() - started
            if self.rank == self.world - 1:
                emit(
                    "sweep",
                    microbatches=n,
                    microbatch_size=self.work.samples_per_step // n,
                    step_s=round(timings[n], 3),
                )
        best = min(timings, key=timings.get)
        return int(self.decide(best))

    def run(self, microbatches: int) -> None:
        model, optimizer, schedule = self.fresh(microbatches)
        target, budget, every = self.cfg["target"], self.cfg["budget_s"], self.cfg["eval_every"]
        last = self.rank == self.world - 1
        self.dist.barrier()
        started, step, eval_s = time.perf_counter(), 0, 0.0
        emit("start", microbatches=microbatches)
        snapshots = StepSnapshots(self.cfg["snapshots"]) if self.cfg.get("snapshots") else None
        while True:
            self.train_step(model, optimizer, schedule, step)
            step += 1
            elapsed = time.perf_counter() - started - eval_s  # training time: evaluations are not in the clock
            if snapshots is not None:  # every step's weights, for the arena to evaluate after the run
                snapshots.save(self.rank, step, model.named_parameters())
            if last:
                emit("step", step=step, elapsed_s=round(elapsed, 3))
            stop = elapsed >= budget
            if step % every == 0:
                eval_started = time.perf_counter()
                loss = self.evaluate(model)
                eval_s += time.perf_counter() - eval_started
                if last:
                    emit(
                        "eval",
                        step=step,
                        samples=step * self.work.samples_per_step,
                        elapsed_s=round(elapsed, 3),
                        loss=round(loss, 4),
                    )
                    stop = stop or round(loss, 4) <= target  # as the bench reads it
            if self.decide(1.0 if stop else 0.0):
                break
        if snapshots is not None:
            snapshots.close()
        if last:
            emit(
                "done", steps=step, elapsed_s=round(time.perf_counter() - started - eval_s, 3), eval_s=round(eval_s, 3)
            )


def main(argv: list[str]) -> int:
    import torch.distributed as dist

    cfg = json.loads(argv[0])
    os.environ.update(
        MASTER_ADDR=cfg["master_addr"], MASTER_PORT=str(cfg["master_port"]), GLOO_SOCKET_IFNAME=cfg["ifname"]
    )
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo", rank=cfg["rank"], world_size=cfg["world"], timeout=timedelta(seconds=TIMEOUT_S))
    try:
        rank = Rank(cfg)
        microbatches = rank.sweep() if len(cfg["candidates"]) > 1 else cfg["candidates"][0]
        rank.run(microbatches)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
