"""One model, whatever the swarm's shape: the same samples (same seed, the same sequence of
microbatches) through 1 replica per stage and 1 trainer, and through 2 replicas per stage
and 2 trainers, give held-out losses within 2% and the same step on every stage.

Both runs are stock ``swarm up`` swarms (fp32 wire), with the same global batch and the
same number of microbatches in flight in all (the two trainers keep half each, so the
pipeline's staleness is the same). Before the change to global steps (replicas stepping
on their own), this comparison measured +5% with twice the optimizer steps per sample."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from shared import checkpoint
from tests.e2e.conftest import SWARM, processes_of_run

pytestmark = pytest.mark.e2e

STEPS, GLOBAL_BATCH, IN_FLIGHT = 80, 32, 4  # 2,560 samples: the loss near 2.7, where two runs of one swarm differ by well under 1%


def train(run_dir, *, replicas: int, trainers: int) -> tuple[list[dict], str]:
    args = [*SWARM, "up", "--stages", "4", "--replicas", str(replicas), "--trainers", str(trainers), "--global-batch", str(GLOBAL_BATCH), "--steps", str(STEPS),
            "--in-flight", str(IN_FLIGHT // trainers), "--wire-codec", "fp32", "--average-every-s", "2", "--rebalance-every-s", "0", "--run-dir", str(run_dir)]
    result = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert processes_of_run(run_dir.name) == []
    suffixes = [""] if trainers == 1 else [f"-{t}" for t in range(trainers)]
    summaries = [json.loads((run_dir / f"summary{s}.json").read_text()) for s in suffixes]
    return summaries, (run_dir / "coordinator.log").read_text() + result.stdout


def stage_steps(run_dir) -> set[int]:
    """The step of every stage in the run's last checkpoint (taken when training ended)."""
    meta = checkpoint.read_meta(checkpoint.latest_checkpoint(run_dir / "checkpoints"))
    return {meta["step"], *meta["stage_steps"].values()}


def test_two_replicas_and_two_trainers_train_the_same_model_as_one(tmp_path):
    one_dir, two_dir = tmp_path / f"e2e-one-{os.getpid()}", tmp_path / f"e2e-two-{os.getpid()}"
    (one,), _ = train(one_dir, replicas=1, trainers=1)
    two, logs = train(two_dir, replicas=2, trainers=2)
    assert one["microbatches_failed"] == 0 and all(t["microbatches_failed"] == 0 for t in two)
    assert stage_steps(one_dir) == stage_steps(two_dir) == {STEPS}  # every stage took the run's steps, whatever the swarm
    assert len({t["eval_loss_after"] for t in two}) == 1  # both trainers evaluate one model
    identical = len(re.findall(r"averaging\.check\.identical", logs))
    assert identical >= 1 and "averaging.check.drifted" not in logs, "the coordinator's digest checks never found the replicas identical"
    ratio = two[0]["eval_loss_after"] / one["eval_loss_after"]
    print(f"\none model: held-out loss {one['eval_loss_after']:.4f} (1 replica x 1 trainer) vs {two[0]['eval_loss_after']:.4f} (2 x 2), ratio {ratio:.4f}; "
          f"re-runs {one['microbatch_reruns']} vs {sum(t['microbatch_reruns'] for t in two)}; digest checks identical: {identical}")
    assert abs(ratio - 1) <= 0.02, (one["eval_loss_after"], two[0]["eval_loss_after"])
