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

# alone: how stale activations get, and so the 2% and 5% limits, depend on the cores being its own (`make test`)
pytestmark = [pytest.mark.e2e, pytest.mark.alone]

# 1,280 samples (the loss near 3.0): under the sync schedule 2 x 2 trains what 1 x 1 does,
# whatever the number of steps (80 steps took 60 s more of the suite's alone phase)
STEPS, GLOBAL_BATCH, IN_FLIGHT = 40, 32, 4
LOCAL_STEPS = 10  # sync=local: an outer step every 10 global steps (the run ends on one)


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory):
    """The 2 replicas x 2 trainers run in global mode, shared by the tests of this module."""
    run_dir = tmp_path_factory.mktemp("one-model") / f"e2e-two-{os.getpid()}"
    summaries, logs = train(run_dir, replicas=2, trainers=2)
    return run_dir, summaries, logs


def train(run_dir, *, replicas: int, trainers: int, sync: str = "global") -> tuple[list[dict], str]:
    args = [
        *SWARM,
        "up",
        "--stages",
        "4",
        "--replicas",
        str(replicas),
        "--trainers",
        str(trainers),
        "--global-batch",
        str(GLOBAL_BATCH),
        "--steps",
        str(STEPS),
        "--in-flight",
        str(IN_FLIGHT // trainers),
        "--wire-codec",
        "fp32",
        "--average-every-s",
        "2",
        "--rebalance-every-s",
        "0",
        "--run-dir",
        str(run_dir),
        "--sync",
        sync,
        "--local-steps",
        str(LOCAL_STEPS),
    ]
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


def step_round_bytes(run_dir) -> int:
    """Bytes the stage servers sent in step rounds (gradient all-reduces, or local mode's outer steps)."""
    total = 0
    for log in run_dir.glob("stage*.log"):
        for line in log.read_text().splitlines():
            if "averaging.round.done" in line and "round_id=step-" in line:
                total += int(re.search(r"bytes_sent=(\d+)", line).group(1))
    return total


def test_two_replicas_and_two_trainers_train_the_same_model_as_one(tmp_path, two_by_two):
    one_dir = tmp_path / f"e2e-one-{os.getpid()}"
    (one,), _ = train(one_dir, replicas=1, trainers=1)
    two_dir, two, logs = two_by_two
    assert one["microbatches_failed"] == 0 and all(t["microbatches_failed"] == 0 for t in two)
    assert (
        stage_steps(one_dir) == stage_steps(two_dir) == {STEPS}
    )  # every stage took the run's steps, whatever the swarm
    assert len({t["eval_loss_after"] for t in two}) == 1  # both trainers evaluate one model
    identical = len(re.findall(r"averaging\.check\.identical", logs))
    assert identical >= 1 and "averaging.check.drifted" not in logs, (
        "the coordinator's digest checks never found the replicas identical"
    )
    ratio = two[0]["eval_loss_after"] / one["eval_loss_after"]
    print(
        f"\none model: held-out loss {one['eval_loss_after']:.4f} (1 replica x 1 trainer) vs "
        f"{two[0]['eval_loss_after']:.4f} (2 x 2), ratio {ratio:.4f}; re-runs {one['microbatch_reruns']} vs "
        f"{sum(t['microbatch_reruns'] for t in two)}; digest checks identical: {identical}"
    )
    assert abs(ratio - 1) <= 0.02, (one["eval_loss_after"], two[0]["eval_loss_after"])


def test_local_mode_trains_as_well_per_sample_with_far_fewer_bytes(tmp_path, two_by_two):
    """SWARM_SYNC=local (DiLoCo): 2 replicas per stage each step on their own samples, an
    outer step every 10 global steps. The same samples end within 5% of global mode's
    held-out loss, and the step rounds send at least 8x fewer bytes."""
    global_dir, global_runs, _ = two_by_two
    local_dir = tmp_path / f"e2e-local-{os.getpid()}"
    local_runs, logs = train(local_dir, replicas=2, trainers=2, sync="local")
    assert all(t["microbatches_failed"] == 0 for t in local_runs)
    assert stage_steps(local_dir) == {STEPS}
    assert len({t["eval_loss_after"] for t in local_runs}) == 1  # the run ended on an outer step: one model
    outer_steps = sum(len(re.findall(r"outer_step=", log.read_text())) for log in local_dir.glob("stage*.log"))
    assert outer_steps == 4 * 2 * STEPS // LOCAL_STEPS  # every replica of every stage, every 10 steps
    assert "outer.missed" not in "".join(log.read_text() for log in local_dir.glob("stage*.log"))
    ratio = local_runs[0]["eval_loss_after"] / global_runs[0]["eval_loss_after"]
    global_bytes, local_bytes = step_round_bytes(global_dir), step_round_bytes(local_dir)
    print(
        f"\nlocal mode: held-out loss {local_runs[0]['eval_loss_after']:.4f} (local, H={LOCAL_STEPS}) vs "
        f"{global_runs[0]['eval_loss_after']:.4f} (global), ratio {ratio:.4f}; step-round bytes {local_bytes:,} vs "
        f"{global_bytes:,} ({global_bytes / max(local_bytes, 1):.1f}x fewer)"
    )
    assert abs(ratio - 1) <= 0.05, (local_runs[0]["eval_loss_after"], global_runs[0]["eval_loss_after"])
    assert local_bytes > 0 and global_bytes >= 8 * local_bytes, (global_bytes, local_bytes)
