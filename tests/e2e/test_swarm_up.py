"""`swarm up` as a user runs it: real processes on loopback, trained end to end, stopped cleanly."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading

import pytest

from tests.e2e.conftest import SWARM, processes_of_run, stop_swarm_up

pytestmark = pytest.mark.e2e


def test_swarm_up_trains_a_four_stage_model_for_200_steps(tmp_path):
    run_dir = tmp_path / f"e2e-200-{os.getpid()}"
    result = subprocess.run(
        [*SWARM, "up", "--stages", "4", "--steps", "200", "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    short = next(line for line in reversed(result.stdout.splitlines()) if line.startswith("{"))
    assert json.loads(short)["steps"] == 200  # the short form on stdout
    assert "swarm up: checkpoint of step 200" in result.stdout  # the run is saved at the end
    assert summary["steps"] == 200
    assert (
        summary["microbatches_completed"] == summary["microbatches_scheduled"] and summary["microbatches_failed"] == 0
    )
    assert summary["eval_loss_before"] > 5.0  # ~ln(256): an untrained byte-level model
    assert summary["eval_loss_after"] < 2.9, summary["eval_loss_after"]
    losses = summary["step_losses"]
    assert sum(losses[-20:]) / 20 < min(2.9, sum(losses[:20]) / 20 - 1.0)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 201)) and all(m["tokens_per_s"] > 0 for m in metrics)
    assert "train.step" in result.stderr  # progress was shown
    assert processes_of_run(run_dir.name) == []


def test_ctrl_c_stops_every_process(tmp_path):
    run_dir = tmp_path / f"e2e-ctrl-c-{os.getpid()}"
    proc = subprocess.Popen(
        [*SWARM, "up", "--stages", "4", "--steps", "100000", "--run-dir", str(run_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True)
    reader.start()
    try:
        while True:  # wait until training is under way (bounded by the queue timeout)
            line = lines.get(timeout=180)
            if "train.step" in line:
                break
        assert len(processes_of_run(run_dir.name)) == 6  # coordinator + 4 stage servers + 1 trainer
        proc.send_signal(signal.SIGINT)
        try:
            status = proc.wait(timeout=120)  # generous: CI machines can be loaded
        except subprocess.TimeoutExpired:
            tail = []
            while not lines.empty():
                tail.append(lines.get_nowait())
            raise AssertionError(
                "swarm up did not stop within 120 s of Ctrl-C; its last lines:\n" + "".join(tail[-30:])
            ) from None
        assert status == 130
    finally:
        stop_swarm_up(proc)
    assert processes_of_run(run_dir.name) == []
