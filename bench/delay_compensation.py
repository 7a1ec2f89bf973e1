"""Delay compensation on the convergence bench's swarm: ``python -m bench.delay_compensation``.

With the ``async`` schedule a stage takes step ``k`` while microbatches of step ``k + 1``
are in flight, so their gradients were computed on weights one step older than those
they are applied to (bounded staleness, ``SWARM_MAX_STALENESS``; docs/architecture.md).
This bench trains the convergence bench's swarm (``bench/convergence.py``: the ``tiny``
model in 4 stages, in-process stage servers and coordinator on loopback, fp32 wire) on the
same samples with:

- ``sync`` + AdamW: no gradient is late (the exact reference);
- ``async`` + AdamW: today's default, no correction;
- ``async`` + NAdamW (Pluralis, ICML 2025: Nesterov's look-ahead against delayed
  gradients), with beta1 0.9 and with the paper's 0.99;
- ``sync`` + NAdamW 0.9: what NAdamW gains without any late gradient.

Each configuration keeps ``--in-flight`` microbatches in flight (default 8: two global
batches, so that the async schedule has gradients a step late), for ``--runs`` runs. Every
stage writes its weights after every step (``SWARM_STEP_SNAPSHOT_DIR``), and every step's
held-out loss is evaluated afterwards from them (``bench.arena_eval``), off the training
clock: the steps to the target are counted exactly. The target is the loss the ``sync``
AdamW runs reach on average at ``--target-at`` of the steps. Prints a table and writes the
JSON (with every run's curve) to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from bench.arena_eval import Snapshots
from bench.convergence import FULL, QUICK, Plan, train_one
from services.trainer.data import ByteBatcher, load_corpus
from shared.log import configure_logging
from shared.model import GPTConfig, config_from_preset

# (label, coordinator's SWARM_SCHEDULE, SWARM_OPTIMIZER, SWARM_BETA1)
CONFIGS = (
    ("sync AdamW", "sync", "adamw", 0.9),
    ("async AdamW", "async", "adamw", 0.9),
    ("async NAdamW 0.9", "async", "nadamw", 0.9),
    ("async NAdamW 0.99", "async", "nadamw", 0.99),
    ("sync NAdamW 0.9", "sync", "nadamw", 0.9),
)


@dataclass(frozen=True)
class TinyWork:
    """The convergence bench's model and data, in the shape ``bench.arena_eval`` evaluates."""

    seq_len: int
    microbatch_size: int

    def gpt_config(self) -> GPTConfig:
        return config_from_preset("tiny")

    def batcher(self) -> ByteBatcher:
        return ByteBatcher(load_corpus(), self.seq_len, self.microbatch_size, seed=0)


def step_losses(root: Path, plan: Plan, steps: int) -> list[float]:
    """The held-out loss after each of ``steps`` global steps, from the snapshots in ``root``."""
    snaps = Snapshots(root, TinyWork(plan.seq_len, plan.microbatch_size), plan.stages)
    written = snaps.written()
    return [snaps.loss(k, written) for k in range(1, steps + 1)]


def steps_to(curve: list[float], target: float) -> int | None:
    return next((k for k, loss in enumerate(curve, 1) if loss <= target), None)


def run_config(plan: Plan, schedule: str, optimizer: str, beta1: float) -> dict:
    steps = plan.samples // plan.global_batch
    with tempfile.TemporaryDirectory(prefix="swarm-delay-") as tmp:
        started = time.monotonic()
        figures = asyncio.run(
            train_one(
                plan,
                "fp32",
                1,
                1,
                schedule=schedule,
                optimizer=optimizer,
                beta1=beta1,
                step_snapshot_dir=tmp,
            )
        )
        curve = step_losses(Path(tmp), plan, steps)
    return {
        "curve": curve,
        "loss after": curve[-1],
        "trainer's loss after": figures["loss after"],
        "re-runs": figures["re-runs"],
        "seconds": round(time.monotonic() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.delay_compensation", description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=2, help="runs per configuration (default 2)")
    p.add_argument("--in-flight", type=int, default=8, help="microbatches in flight (default 8: two global batches)")
    p.add_argument("--samples", type=int, default=0, help="samples to train on (default: the convergence bench's)")
    p.add_argument(
        "--target-at", type=float, default=0.75, help="the target: sync AdamW's mean loss at this share of the steps"
    )
    p.add_argument("--quick", action="store_true", help="the convergence bench's quick plan (2 stages, 4 steps)")
    p.add_argument("--out", default="bench/results/delay-compensation.json")
    args = p.parse_args(argv)
    if args.runs < 1 or args.in_flight < 1 or not 0 < args.target_at <= 1:
        p.error("--runs and --in-flight must be >= 1, --target-at in (0, 1]")
    torch.set_num_threads(1)
    configure_logging("console", "error")
    plan = replace(QUICK if args.quick else FULL, in_flight=args.in_flight)
    if args.samples:
        plan = replace(plan, samples=args.samples)
    steps = plan.samples // plan.global_batch
    rows = []
    for label, schedule, optimizer, beta1 in CONFIGS:
        runs = [run_config(plan, schedule, optimizer, beta1) for _ in range(args.runs)]
        rows.append({"config": label, "schedule": schedule, "optimizer": optimizer, "beta1": beta1, "runs": runs})
        print(f"{label}: loss after {[r['loss after'] for r in runs]}", flush=True)
    reference = [statistics.mean(r["curve"][k] for r in rows[0]["runs"]) for k in range(steps)]
    target_step = max(1, round(args.target_at * steps))
    target = reference[target_step - 1]
    print(f"\n{steps} global steps of {plan.global_batch} samples, {plan.in_flight} microbatches in flight, fp32 wire;")
    print(f"target: {target:.4f} (sync AdamW's mean held-out loss at step {target_step})\n")
    print(f"| config | loss after {steps} steps (mean; runs) | steps to target (runs) | re-runs |")
    print("|---|---|---|---|")
    for row in rows:
        runs = row["runs"]
        row["mean loss after"] = round(statistics.mean(r["loss after"] for r in runs), 4)
        row["steps to target"] = [steps_to(r["curve"], target) for r in runs]
        losses = ", ".join(f"{r['loss after']:.4f}" for r in runs)
        print(
            f"| {row['config']} | {row['mean loss after']:.4f} ({losses}) "
            f"| {', '.join(str(s) if s else f'>{steps}' for s in row['steps to target'])} "
            f"| {sum(r['re-runs'] for r in runs)} |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": "python -m bench.delay_compensation " + " ".join(argv or sys.argv[1:]),
                "plan": vars(plan),
                "target": target,
                "target_step": target_step,
                "rows": rows,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
