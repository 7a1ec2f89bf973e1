"""Bench 4, pipelining: mesh tokens/s over torch.distributed.pipelining's on the same work.

PyTorch's own pipeline parallelism: 4 processes (one thread each) on loopback joined by
gloo, each holding the same stage ``shared.model.build_stage`` gives a mesh server (same
seed, same weights), scheduled with 1F1B over the 4 microbatches of each 32-sample step,
AdamW after each step. The mesh side is ``bench.square_cube``'s measurement of the same
workload (made once per invocation; measured here if square-cube did not run). As a
check that both do the same work, the first step's loss under pipelining is compared
with the same model's loss in this process on the same samples (smallest size only).

Run as ``python -m bench.pipelining --worker RANK WORLD PORT PLAN OUT``, this module is
one of those processes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.processes import BenchProcesses, run_id
from bench.report import BenchResult
from bench.square_cube import mesh_figures, plan
from bench.workload import Workload
from shared.model import build_gpt, build_stage
from shared.processes import fixed_port

TIMEOUT_S = 900.0
COLUMNS = [
    "d_model",
    "pipelining tok/s",
    "mesh tok/s",
    "mesh / pipelining",
    "pipelining CPU s/token",
    "mesh CPU s/token",
    "mesh / pipelining per CPU s",
    "loss check",
]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def step_batch(work: Workload, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples of one step: the mesh's microbatches ``step * n .. step * n + n - 1``."""
    batcher, n = work.batcher(), work.microbatches_per_step
    mbs = [batcher.microbatch(step * n + i) for i in range(n)]
    return torch.cat([m.inputs for m in mbs]), torch.cat([m.targets for m in mbs])


def worker(rank: int, world: int, port: int, plan_items: list[dict], out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT_S))
    results = []
    try:
        for item in plan_items:
            work = Workload(**item["work"])
            model = build_stage(work.gpt_config(), rank, world, seed=0)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, betas=(0.9, 0.95))
            schedule = Schedule1F1B(
                PipelineStage(model, rank, world, torch.device("cpu")),
                n_microbatches=work.microbatches_per_step,
                loss_fn=loss_fn,
            )
            first_loss, started, cpu_started = None, 0.0, 0.0
            for step in range(item["warmup_steps"] + item["steps"]):
                if step == item["warmup_steps"]:
                    dist.barrier()
                    started, cpu_started = time.perf_counter(), time.process_time()
                x, y = step_batch(work, step)
                losses: list = []
                if rank == 0:
                    schedule.step(x)
                elif rank == world - 1:
                    schedule.step(target=y, losses=losses)
                else:
                    schedule.step()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if step == 0 and losses:
                    first_loss = float(torch.stack([loss.detach() for loss in losses]).mean())
            dist.barrier()
            results.append(
                {
                    "wall_s": time.perf_counter() - started,
                    "cpu_s": time.process_time() - cpu_started,
                    "first_loss": first_loss,
                }
            )
    finally:
        dist.destroy_process_group()
    out.write_text(json.dumps(results))


def run_pipelining(ctx, items: list[dict], world: int) -> list[dict]:
    """The plan under torch.distributed.pipelining; one result per item (rank 0's wall time,
    every rank's CPU summed, the last rank's first loss). Raises RuntimeError with the
    reason when it cannot run."""
    logs = ctx.logs("pipelining")
    port = fixed_port()
    outs = [logs / f"rank{r}.json" for r in range(world)]
    for out in outs:
        out.unlink(missing_ok=True)
    with BenchProcesses(run_id("pipelining"), logs) as procs:
        for rank in range(world):
            procs.start(
                f"rank{rank}",
                ["bench.pipelining", "--worker", str(rank), str(world), str(port), json.dumps(items), str(outs[rank])],
                {},
            )
        deadline = time.monotonic() + TIMEOUT_S
        for rank in range(world):
            proc = procs.procs[f"rank{rank}"]
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except Exception:  # subprocess.TimeoutExpired: the context manager kills it
                raise RuntimeError(f"torch.distributed.pipelining did not finish within {TIMEOUT_S} s") from None
            if code != 0:
                tail = (logs / f"rank{rank}.log").read_text(errors="replace").strip().splitlines()[-3:]
                raise RuntimeError(
                    f"torch.distributed.pipelining rank {rank} exited with status {code}: {' | '.join(tail)}"
                )
    per_rank = [json.loads(out.read_text()) for out in outs]
    return [
        {
            "wall_s": per_rank[0][i]["wall_s"],
            "cpu_s": sum(r[i]["cpu_s"] for r in per_rank),
            "first_loss": per_rank[-1][i]["first_loss"],
        }
        for i in range(len(items))
    ]


def reference_loss(work: Workload) -> float:
    """The first step's mean microbatch loss of the same model in this process."""
    model = build_gpt(work.gpt_config(), seed=0)
    x, y = step_batch(work, 0)
    n = work.microbatches_per_step
    with torch.no_grad():
        return float(sum(model(xi, yi) for xi, yi in zip(x.chunk(n), y.chunk(n))) / n)


def run(ctx) -> BenchResult:
    works, stages, in_flight = plan(ctx.quick)
    items = [
        {"work": vars(w), "warmup_steps": 1, "steps": max(2, measured // w.microbatches_per_step)}
        for w, _, measured in works
    ]
    try:
        pipe, error = run_pipelining(ctx, items, stages), ""
    except RuntimeError as exc:
        pipe, error = [None] * len(items), str(exc)
    rows = []
    for (work, warmup, measured), item, p in zip(works, items, pipe):
        mesh = mesh_figures(ctx, work, warmup, measured, stages, in_flight)
        row = {
            "d_model": work.d_model,
            "mesh tok/s": mesh["tokens_per_s"],
            "mesh CPU s/token": (mesh["server_cpu_s"] + mesh["trainer_cpu_s"]) / mesh["tokens"],
        }
        if p is None:
            row |= {"pipelining tok/s": f"failed: {error}"}
        else:
            tokens = item["steps"] * work.microbatches_per_step * work.tokens_per_microbatch
            row |= {
                "pipelining tok/s": tokens / p["wall_s"],
                "mesh / pipelining": mesh["tokens_per_s"] * p["wall_s"] / tokens,
                "pipelining CPU s/token": p["cpu_s"] / tokens,
            }
            row["mesh / pipelining per CPU s"] = row["pipelining CPU s/token"] / row["mesh CPU s/token"]
            if work is works[0][0] and p["first_loss"] is not None:
                ref = reference_loss(work)
                row["loss check"] = f"{p['first_loss']:.4f} vs {ref:.4f} in 1 process"
        rows.append(row)
    w = works[0][0]
    notes = [
        (
            f"the same model ({w.n_layer} layers, seq {w.seq_len}), microbatches of {w.microbatch_size} and steps of "
            f"{w.samples_per_step} samples on both sides; {stages} processes x 1 thread each"
        ),
        "pipelining: torch.distributed.pipelining, gloo on 127.0.0.1, Schedule1F1B, a synchronous step (the pipeline "
        f"fills and drains every step); mesh: int8 wire, asynchronous, {in_flight} microbatches in flight",
        (
            "CPU s/token: CPU seconds of all of a side's processes per token trained; mesh / pipelining per CPU s: "
            "tokens per CPU second of the mesh over pipelining's (independent of what else runs on the machine)"
        ),
        (
            "loss check: the first step's loss under pipelining against the same model in one process (the same work; "
            "smallest size only)"
        ),
    ]
    if error:
        notes.append(f"torch.distributed.pipelining could not run here: {error}")
    summary = {f"ratio_d{r['d_model']}": r.get("mesh / pipelining") for r in rows} | {"error": error or None}
    return BenchResult(
        "pipelining",
        "mesh vs torch.distributed.pipelining (gloo, 1F1B)",
        COLUMNS,
        rows,
        params={"stages": stages, "items": items, "in_flight": in_flight},
        notes=notes,
        summary=summary,
    )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pipelining")
    p.add_argument("--worker", nargs=5, metavar=("RANK", "WORLD", "PORT", "PLAN", "OUT"), required=True)
    rank, world, port, plan_json, out = p.parse_args(argv).worker
    worker(int(rank), int(world), int(port), json.loads(plan_json), Path(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
