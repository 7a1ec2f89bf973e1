"""Checkpoints: a run stopped after N steps and resumed continues from step N with its loss,
and `swarm export` gives a single-process model that computes what the swarm computed."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from services.export import load_exported
from services.trainer.data import ByteBatcher, load_corpus
from tests.e2e.conftest import SWARM, processes_of_run

pytestmark = pytest.mark.e2e


def swarm_up(run_dir, steps: int, *extra: str) -> dict:
    args = [
        *SWARM,
        "up",
        "--stages",
        "4",
        "--steps",
        str(steps),
        "--wire-codec",
        "fp32",
        "--run-dir",
        str(run_dir),
        *extra,
    ]
    result = subprocess.run(args, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    assert processes_of_run(run_dir.name) == []
    return json.loads((run_dir / "summary.json").read_text())


def test_resumed_run_continues_where_it_stopped_and_exports_the_model(tmp_path):
    run_dir = tmp_path / f"e2e-resume-{os.getpid()}"
    first = swarm_up(run_dir, 20)
    assert first["steps"] == 20 and first["microbatches_failed"] == 0
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-00000020"

    resumed = swarm_up(run_dir, 40, "--resume")
    assert resumed["microbatches_scheduled"] == 20 * 4  # only steps 20..39 were trained again
    assert resumed["steps"] == 40 and len(resumed["step_losses"]) == 20
    # the resumed swarm starts with the weights the first one ended with (fp32 wire: exactly)
    assert resumed["eval_loss_before"] == pytest.approx(first["eval_loss_after"], rel=1e-6)
    assert resumed["step_losses"][0] < first["step_losses"][0] - 1.5  # not from scratch (~5.5)
    assert resumed["eval_loss_after"] < resumed["eval_loss_before"]

    out = tmp_path / "model.safetensors"
    export = subprocess.run(
        [*SWARM, "export", "--checkpoint-dir", str(run_dir / "checkpoints"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert export.returncode == 0, export.stderr
    model = load_exported(out)
    batcher = ByteBatcher(load_corpus(), seq_len=128, microbatch_size=8, seed=0)
    with torch.no_grad():
        losses = [model(mb.inputs, mb.targets).item() for mb in (batcher.microbatch(i, split="eval") for i in range(4))]
    assert sum(losses) / 4 == pytest.approx(resumed["eval_loss_after"], rel=1e-5)
