"""Progress display: which display a setting gives, the bar and the plain lines drawn from a
stream of metrics records, logs kept whole above the bar, and metrics files followed as
trainers append to them."""

from __future__ import annotations

import io
import json
import re
import sys

import pytest

from services.trainer.progress import MetricsFollower, ProgressDisplay, choose_display


class Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def records(losses: list[float | None], tokens_per_s: float = 15000.0) -> list[dict]:
    """Metrics records as the trainer writes them, one per step."""
    return [
        {"step": i + 1, "loss": loss, "tokens_per_s": tokens_per_s + i, "elapsed_s": 0.3 * (i + 1)}
        for i, loss in enumerate(losses)
    ]


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --- choose_display -------------------------------------------------------------------


@pytest.mark.parametrize(
    "setting, tty, log_format, expected",
    [
        ("auto", True, "console", "bar"),
        ("auto", False, "console", "lines"),  # CI, a pipe, a file
        ("auto", False, "json", "off"),  # JSON logs stay pure JSON; train.step carries progress
        ("auto", True, "json", "bar"),
        ("bar", False, "console", "bar"),  # forced, even into a pipe
        ("bar", False, "json", "bar"),
        ("off", True, "console", "off"),
    ],
)
def test_choose_display(setting, tty, log_format, expected):
    assert choose_display(setting, Stream(tty), log_format=log_format) == expected


def test_choose_display_names_the_setting_when_it_is_unknown():
    with pytest.raises(ValueError, match="SWARM_PROGRESS"):
        choose_display("fancy", Stream(True))


# --- the bar --------------------------------------------------------------------------


def test_bar_shows_steps_loss_tokens_per_s_and_eta_from_a_metrics_stream():
    stream = Stream(tty=True)
    display = ProgressDisplay("bar", 20, stream=stream)
    with display:
        for record in records([5.0 - 0.1 * i for i in range(20)]):
            display.show_record(record)
    out = stream.getvalue()
    final = out.rstrip("\n").split("\r")[-1]  # what the terminal shows at the end
    assert final.startswith("train: 100%") and "20/20" in final
    assert "loss=3.100" in final and "tokens/s=15,019" in final
    assert re.search(r"\[\d\d:\d\d<\d\d:\d\d", final), final  # elapsed<ETA
    assert out.endswith("\n")  # closed: the next output starts on a fresh line


def test_bar_of_a_resumed_run_starts_at_the_resumed_step_and_shows_a_missing_loss():
    stream = Stream(tty=True)
    with ProgressDisplay("bar", 10, stream=stream, initial_steps=6) as display:
        assert "6/10" in stream.getvalue()
        display.show(7, None, 900.0)  # a step whose microbatches all failed has no loss
    assert "7/10" in stream.getvalue() and "loss=-, tokens/s=900" in stream.getvalue()


def test_log_lines_written_while_the_bar_is_on_come_out_whole_above_it(monkeypatch):
    stream = Stream(tty=True)
    monkeypatch.setattr(sys, "stderr", stream)
    with ProgressDisplay("bar", 4, stream=stream) as display:
        display.show(1, 4.0, 100.0)
        print("train.step", "step=1", file=sys.stderr)  # print writes the text, then "\n"
        sys.stderr.write('{"event": "train.st')
        sys.stderr.write('ep", "step": 2}\n')
        display.show(2, 3.0, 100.0)
        sys.stderr.write("partial at exit")
        assert sys.stderr is not stream  # redirected through the bar
    assert sys.stderr is stream  # restored
    lines = [part for chunk in stream.getvalue().split("\n") for part in chunk.split("\r")]
    assert "train.step step=1" in lines and '{"event": "train.step", "step": 2}' in lines
    assert "partial at exit" in lines


# --- plain lines (no terminal) ---------------------------------------------------------


def test_plain_lines_every_n_steps_and_at_the_end():
    stream, clock = Stream(tty=False), FakeClock()
    with ProgressDisplay("lines", 25, stream=stream, every_steps=10, clock=clock) as display:
        for record in records([5.0 - 0.1 * i for i in range(25)]):
            clock.now += 0.5
            display.show_record(record)
    assert stream.getvalue().splitlines() == [
        "progress: 10/25 steps (40%), loss=4.100, tokens/s=15,009, elapsed 00:05, eta 00:07",
        "progress: 20/25 steps (80%), loss=3.100, tokens/s=15,019, elapsed 00:10, eta 00:02",
        "progress: 25/25 steps (100%), loss=2.600, tokens/s=15,024, elapsed 00:12, eta 00:00",
    ]
    assert "\r" not in stream.getvalue()


def test_plain_lines_when_polling_jumps_over_a_multiple_of_n():
    stream, clock = Stream(tty=False), FakeClock()
    with ProgressDisplay("lines", 40, stream=stream, every_steps=10, clock=clock) as display:
        for done in (3, 9, 13, 13, 27, 29, 40):
            clock.now += 1.0
            display.show(done, 2.0, 1000.0)
    assert [line.split(",")[0] for line in stream.getvalue().splitlines()] == [
        "progress: 13/40 steps (32%)",
        "progress: 27/40 steps (68%)",
        "progress: 40/40 steps (100%)",
    ]


def test_plain_lines_eta_counts_only_the_steps_of_this_session():
    stream, clock = Stream(tty=False), FakeClock()
    with ProgressDisplay("lines", 200, stream=stream, initial_steps=100, every_steps=50, clock=clock) as display:
        clock.now += 10.0
        display.show(150, 2.0, 1000.0)  # 50 steps in 10 s: 50 more take 10 s
    assert stream.getvalue() == "progress: 150/200 steps (75%), loss=2.000, tokens/s=1,000, elapsed 00:10, eta 00:10\n"


def test_off_shows_nothing():
    stream = Stream(tty=True)
    with ProgressDisplay("off", 5, stream=stream) as display:
        for record in records([1.0] * 5):
            display.show_record(record)
    assert stream.getvalue() == ""


# --- following metrics files ------------------------------------------------------------


def append(path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


def test_follower_reads_whole_lines_only_and_keeps_the_latest_record(tmp_path):
    path = tmp_path / "metrics.jsonl"
    follower = MetricsFollower([path])
    follower.poll()  # the trainer has not written yet
    assert follower.totals() == (0, None, 0)
    lines = [json.dumps(r) for r in records([4.0, 3.5, 3.0])]
    append(path, lines[0] + "\n" + lines[1][:10])  # the second line is still being written
    follower.poll()
    assert follower.totals() == (1, 4.0, 15000.0)
    append(path, lines[1][10:] + "\n" + lines[2] + "\n")
    follower.poll()
    assert follower.totals() == (3, 3.0, 15002.0) and follower.bad_lines == 0


def test_follower_takes_the_furthest_global_step_sums_tokens_per_s_and_averages_loss(tmp_path):
    paths = [tmp_path / "metrics-0.jsonl", tmp_path / "metrics-1.jsonl", tmp_path / "metrics-2.jsonl"]
    follower = MetricsFollower(paths, start_step=5)  # a resumed run: the swarm starts at step 5
    append(paths[0], json.dumps({"step": 7, "loss": 3.0, "tokens_per_s": 100.0}) + "\n")
    append(paths[1], json.dumps({"step": 6, "loss": 2.0, "tokens_per_s": 50.0}) + "\n")
    follower.poll()
    assert follower.totals() == (
        7,
        2.5,
        150.0,
    )  # steps are the swarm's: the furthest any trainer saw; the third has none yet


def test_follower_skips_an_earlier_run_in_the_file_and_counts_bad_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    append(path, json.dumps({"step": 200, "loss": 2.5, "tokens_per_s": 9.0}) + "\n")  # a finished earlier run
    follower = MetricsFollower([path])
    follower.poll()
    assert follower.totals() == (0, None, 0)
    append(
        path,
        "not json\n"
        + json.dumps({"step": "1"})
        + "\n\n"
        + json.dumps({"step": 1, "loss": None, "tokens_per_s": 10})
        + "\n",
    )
    follower.poll()
    assert follower.totals() == (1, None, 10) and follower.bad_lines == 2


def test_bar_drawn_from_followed_files(tmp_path):
    """What `swarm up` does: follow the trainers' files and draw one bar of them all."""
    paths = [tmp_path / "metrics-0.jsonl", tmp_path / "metrics-1.jsonl"]
    follower, stream = MetricsFollower(paths), Stream(tty=True)
    with ProgressDisplay("bar", 3, stream=stream) as display:  # 3 global steps, both trainers feeding them
        for step in (1, 2, 3):
            for t, path in enumerate(paths):
                append(path, json.dumps({"step": step, "loss": 3.0 - step + t, "tokens_per_s": 1000.0}) + "\n")
            follower.poll()
            display.show(*follower.totals())
    final = stream.getvalue().rstrip("\n").split("\r")[-1]
    assert "3/3" in final and "loss=0.500" in final and "tokens/s=2,000" in final


# --- the trainer feeds the display ---------------------------------------------------------


async def test_trainer_calls_on_step_with_each_metrics_record(tmp_path):
    import torch

    from services.trainer.data import ByteBatcher
    from services.trainer.pipeline import TrainResult
    from services.trainer.trainer import Trainer

    class Client:  # a swarm that steps every two microbatches (global batch 4 of microbatches of 2)
        done = 0

        async def train(self, mb, seed: int, on_loss=None, step=None) -> TrainResult:
            Client.done += 1
            return TrainResult(2.0, mb.index // 2, Client.done // 2)

        async def evaluate(self, mb, seed: int) -> float:
            return 5.0

    batcher = ByteBatcher(torch.arange(4096, dtype=torch.int64).remainder(256).to(torch.uint8), 16, 2, seed=0)
    metrics = tmp_path / "metrics.jsonl"
    seen: list[dict] = []
    trainer = Trainer(
        Client(),
        batcher,
        steps=3,
        global_batch=4,
        in_flight=2,
        eval_microbatches=1,
        metrics_file=str(metrics),
        on_step=seen.append,
    )
    await trainer.run()
    assert seen == [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in seen] == [1, 2, 3]
