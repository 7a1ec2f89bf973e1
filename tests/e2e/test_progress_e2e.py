"""`swarm up` with the progress bar forced: one live bar with loss and tokens/s on stderr,
the trainer's logs in its log file, and the run plotted to training.png at the end."""

from __future__ import annotations

import os
import re
import struct
import subprocess

import pytest

from tests.e2e.conftest import SWARM, processes_of_run, stop_swarm_up

pytestmark = pytest.mark.e2e


def test_swarm_up_with_the_bar_forced_shows_it_and_plots_the_run(tmp_path):
    run_dir = tmp_path / f"e2e-progress-{os.getpid()}"
    proc = subprocess.Popen(
        [*SWARM, "up", "--stages", "2", "--steps", "10", "--run-dir", str(run_dir)],
        env={**os.environ, "SWARM_PROGRESS": "bar"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )  # bytes: text mode would turn the bar's \r into \n
    try:
        stdout, stderr = (out.decode() for out in proc.communicate(timeout=120))
    finally:
        stop_swarm_up(proc)  # only if it is still running: stops its children too
    assert proc.returncode == 0, stderr[-3000:]

    frames = stderr.rstrip("\n").split("\r")  # the bar redraws itself in place
    assert len(frames) > 2, stderr
    final = frames[-1]
    assert final.startswith("train: 100%") and "10/10" in final, final
    assert re.search(r"loss=\d+\.\d{3}, tokens/s=[\d,]+\]$", final), final
    assert "train.step" not in stderr  # the logs went to the trainer's log file...
    assert "train.step" in (run_dir / "trainer.log").read_text()  # ...which has them
    assert "swarm up: trainer: 10 steps, 40/40 microbatches" in stdout

    png = (run_dir / "training.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (800, 600) and len(png) > 10_000
    assert f"swarm up: loss and tokens/s against step in {run_dir / 'training.png'}" in stdout
    assert processes_of_run(run_dir.name) == []
