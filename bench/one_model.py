"""One model, whatever the swarm's shape, with default settings: ``python -m bench.one_model``.

Runs stock ``swarm up`` swarms (default wire, schedule and microbatches in flight) on the
same samples, ``--runs`` times each: 1 replica per stage x 1 trainer, and 2 replicas x 2
trainers (each trainer keeps half the microbatches in flight, so that the swarm keeps as
many going). Prints every run's held-out loss, the means and their ratio, whether every
stage ended at the run's step, re-runs, and tokens/s; writes the JSON to ``--out``. It takes
minutes (a run of 60 steps is about 20-40 s here), so it is a bench, not a suite test;
``tests/e2e/test_one_model.py`` keeps a shorter form.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shared import checkpoint

SHAPES = ((1, 1), (2, 2))  # (replicas per stage, trainers)


def run_once(run_dir: Path, *, replicas: int, trainers: int, stages: int, steps: int, in_flight: int) -> dict:
    """One ``swarm up``; its held-out loss, re-runs, tokens/s and the steps its stages ended at."""
    args = [
        sys.executable,
        "-m",
        "services.cli",
        "up",
        "--stages",
        str(stages),
        "--replicas",
        str(replicas),
        "--trainers",
        str(trainers),
        "--steps",
        str(steps),
        "--in-flight",
        str(max(1, in_flight // trainers)),
        "--rebalance-every-s",
        "0",
        "--run-dir",
        str(run_dir),
    ]
    started = time.monotonic()
    result = subprocess.run(args, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"swarm up {replicas}x{trainers} failed:\n{result.stderr[-3000:]}")
    suffixes = [""] if trainers == 1 else [f"-{t}" for t in range(trainers)]
    summaries = [json.loads((run_dir / f"summary{s}.json").read_text()) for s in suffixes]
    meta = checkpoint.read_meta(checkpoint.latest_checkpoint(run_dir / "checkpoints"))
    return {
        "loss": summaries[0]["eval_loss_after"],
        "reruns": sum(s["microbatch_reruns"] for s in summaries),
        "failed": sum(s["microbatches_failed"] for s in summaries),
        "tokens_per_s": round(sum(s["tokens_per_s"] for s in summaries), 1),
        "stage_steps": sorted({meta["step"], *meta["stage_steps"].values()}),
        "wall_s": round(time.monotonic() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.one_model", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5, help="runs of each shape (default 5)")
    p.add_argument("--steps", type=int, default=60, help="global steps of each run (default 60)")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--in-flight", type=int, default=4, help="microbatches in flight, all trainers together (default 4)")
    p.add_argument("--out", default="bench/results", help="directory of the JSON result (one_model.json)")
    args = p.parse_args(argv)
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="one-model-") as tmp:
        for i in range(args.runs):  # the shapes alternate, so that a slower spell of the machine hits both
            for replicas, trainers in SHAPES:
                name = f"{replicas}x{trainers}"
                record = run_once(
                    Path(tmp) / f"bench-one-model-{name}-{i}",
                    replicas=replicas,
                    trainers=trainers,
                    stages=args.stages,
                    steps=args.steps,
                    in_flight=args.in_flight,
                )
                runs.setdefault(name, []).append(record)
                print(f"{name} run {i}: {record}", flush=True)
    means = {name: statistics.mean(r["loss"] for r in records) for name, records in runs.items()}
    ratio = means["2x2"] / means["1x1"]
    same_steps = all(r["stage_steps"] == [args.steps] for records in runs.values() for r in records)
    print(f"\n{'shape':<6} {'held-out losses':<60} {'mean':>8} {'re-runs':>8} {'tokens/s':>9}")
    for name, records in runs.items():
        losses = " ".join(f"{r['loss']:.4f}" for r in records)
        reruns = sum(r["reruns"] for r in records)
        tps = statistics.mean(r["tokens_per_s"] for r in records)
        print(f"{name:<6} {losses:<60} {means[name]:>8.4f} {reruns:>8} {tps:>9.0f}")
    print(f"2x2 / 1x1 mean held-out loss: {ratio:.4f}; every stage at step {args.steps} in every run: {same_steps}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "one_model.json").write_text(
        json.dumps({"params": vars(args), "runs": runs, "means": means, "ratio": ratio, "same_steps": same_steps})
    )
    return 0 if same_steps and all(r["failed"] == 0 for records in runs.values() for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
