"""`swarm plot`: a PNG of loss and tokens/s from a metrics file or a run directory, and a
one-line error (exit 2) for metrics that are missing, empty or malformed."""

from __future__ import annotations

import json
import math
import struct

import pytest

from services import cli
from services.plot import MetricsError, plot_metrics, read_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_metrics(path, steps: int = 50, *, first: int = 1, loss0: float = 5.5) -> None:
    with open(path, "a") as f:
        for step in range(first, first + steps):
            f.write(
                json.dumps(
                    {
                        "step": step,
                        "loss": round(loss0 * math.exp(-step / 20) + 2.4, 4),
                        "tokens_per_s": 15000.0 + step,
                        "elapsed_s": 0.3 * step,
                    }
                )
                + "\n"
            )


def png_size(path) -> tuple[int, int]:
    """Width and height from the PNG's IHDR chunk, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, data[:8]
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plot_of_a_metrics_file_is_a_png_of_plausible_size(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    write_metrics(metrics, 200)
    out = plot_metrics(metrics, tmp_path / "plot.png")
    assert out == tmp_path / "plot.png"
    assert png_size(out) == (800, 600)
    assert 10_000 < out.stat().st_size < 2_000_000  # two drawn panels, not a blank canvas


def test_swarm_plot_of_a_run_dir_writes_training_png_with_one_line_per_trainer(tmp_path, capsys):
    for t in range(2):
        write_metrics(tmp_path / f"metrics-{t}.jsonl", 30, loss0=5.0 + t)
    assert cli.main(["plot", str(tmp_path)]) == 0
    assert png_size(tmp_path / "training.png") == (800, 600)
    assert capsys.readouterr().out.strip() == f"swarm plot: wrote {tmp_path / 'training.png'}"


def test_swarm_plot_of_a_file_writes_a_png_beside_it_or_at_out(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    write_metrics(metrics, 5)
    assert cli.main(["plot", str(metrics)]) == 0
    assert png_size(tmp_path / "metrics.png") == (800, 600)
    assert cli.main(["plot", str(metrics), "--out", str(tmp_path / "sub" / "x.png")]) == 0
    assert png_size(tmp_path / "sub" / "x.png") == (800, 600)


def test_a_step_that_goes_back_replaces_the_records_from_that_step_on(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    write_metrics(metrics, 13)  # steps 1..13, then a resume from the checkpoint of step 10
    write_metrics(metrics, 10, first=11)
    assert [r["step"] for r in read_metrics(metrics)] == list(range(1, 21))
    write_metrics(metrics, 4)  # a new run in the same directory: steps 1..4
    assert [r["step"] for r in read_metrics(metrics)] == [1, 2, 3, 4]


def test_a_failed_step_null_loss_and_a_line_still_being_written_are_plotted(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    write_metrics(metrics, 3)
    with open(metrics, "a") as f:
        f.write(json.dumps({"step": 4, "loss": None, "tokens_per_s": 1.0}) + "\n" + '{"step": 5, "lo')
    assert [r["step"] for r in read_metrics(metrics)] == [1, 2, 3, 4]
    assert png_size(plot_metrics(metrics, tmp_path / "p.png")) == (800, 600)


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "is empty: no step recorded"),
        ("\n\n", "is empty: no step recorded"),
        ('{"step": 1, "loss": 2.0, "tokens_per_s": 5}\nnot json\n', ":2: not a metrics record (Expecting value"),
        ("[1, 2]\n", ":1: not a metrics record (not a JSON object)"),
        (
            '{"step": 0, "loss": 2.0, "tokens_per_s": 5}\n',
            ":1: not a metrics record ('step' must be an integer >= 1, got 0)",
        ),
        (
            '{"step": 1, "loss": "low", "tokens_per_s": 5}\n',
            ":1: not a metrics record ('loss' must be a number or null, got 'low')",
        ),
        ('{"step": 1, "loss": 2.0}\n', ":1: not a metrics record ('tokens_per_s' must be a number, got None)"),
    ],
)
def test_bad_metrics_give_a_one_line_error_and_exit_2(tmp_path, capsys, content, message):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(content)
    with pytest.raises(MetricsError, match="^" + str(metrics).replace(".", r"\.")):
        read_metrics(metrics)
    assert cli.main(["plot", str(metrics)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"swarm plot: {metrics}") and message in err, err
    assert not (tmp_path / "metrics.png").exists()


def test_missing_file_and_run_dir_without_metrics_exit_2(tmp_path, capsys):
    assert cli.main(["plot", str(tmp_path / "nope.jsonl")]) == 2
    assert capsys.readouterr().err == f"swarm plot: {tmp_path / 'nope.jsonl'} does not exist\n"
    assert cli.main(["plot", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"swarm plot: {tmp_path} holds no metrics*.jsonl file\n"
