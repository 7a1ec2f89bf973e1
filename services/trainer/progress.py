"""Training progress for a person watching: a live bar on a terminal, plain lines elsewhere.

Fed with the trainer's per-step metric records (``{"step", "loss", "tokens_per_s",
"elapsed_s"}``, one line of its metrics file each): by the training loop itself
(``swarm train``) or by following the trainers' metrics files (``swarm up``).
``SWARM_PROGRESS`` picks the display: ``bar`` (a bar even when the stream is no terminal),
``off``, or ``auto``: a bar on a terminal, else a plain line every N steps (none with JSON
logs, whose ``train.step`` events already carry the progress and must stay pure JSON).
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Literal, TextIO, get_args

from tqdm import tqdm

ProgressSetting = Literal["auto", "bar", "off"]
Display = Literal["bar", "lines", "off"]
PROGRESS_SETTINGS: tuple[str, ...] = get_args(ProgressSetting)


def choose_display(setting: str, stream: TextIO, *, log_format: str = "console") -> Display:
    """The display for ``setting`` (SWARM_PROGRESS) on ``stream``."""
    if setting not in PROGRESS_SETTINGS:
        raise ValueError(f"SWARM_PROGRESS must be one of {PROGRESS_SETTINGS}, got {setting!r}")
    if setting != "auto":
        return setting
    if stream.isatty():
        return "bar"
    return "off" if log_format == "json" else "lines"


def format_fields(loss: float | None, tokens_per_s: float) -> str:
    loss_text = "-" if loss is None or math.isnan(loss) else f"{loss:.3f}"
    return f"loss={loss_text}, tokens/s={tokens_per_s:,.0f}"


class ProgressDisplay:
    """How far a run of ``total_steps`` steps is, on ``stream``: a tqdm bar, a plain line
    every ``every_steps`` steps, or nothing.

    Use it as a context manager: the bar is drawn on entry and closed on exit, and in
    between, lines written to ``sys.stderr`` (the logs) appear above the bar, whole.
    """

    def __init__(
        self,
        display: Display,
        total_steps: int,
        *,
        stream: TextIO,
        initial_steps: int = 0,
        every_steps: int = 10,
        clock: Callable[[], float] = time.monotonic,
    ):
        assert every_steps >= 1, f"every_steps must be >= 1, got {every_steps}"
        self.display, self.total, self.stream, self.every = display, total_steps, stream, every_steps
        self.initial = self.done = min(initial_steps, total_steps)  # a run resumed past its end has none left
        self._clock = clock
        self._started = clock()
        self._bar: tqdm | None = None
        self._exit = contextlib.ExitStack()

    def __enter__(self) -> ProgressDisplay:
        self._started = self._clock()
        if self.display == "bar":
            self._bar = tqdm(
                total=self.total, initial=self.done, file=self.stream, desc="train", unit="step", dynamic_ncols=True
            )
            self._bar.set_postfix_str(format_fields(None, 0.0))
            if sys.stderr is self.stream:
                logs = LinesAboveBar(self.stream)
                self._exit.enter_context(contextlib.redirect_stderr(logs))
                self._exit.callback(logs.close)  # runs first: the bar is still there
        return self

    def __exit__(self, *exc) -> None:
        self._exit.close()  # flushes a partial log line, restores sys.stderr
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def show(self, done: int, loss: float | None, tokens_per_s: float) -> None:
        """``done`` steps of the run are complete; ``loss`` and ``tokens_per_s`` are the latest."""
        if self._bar is not None:
            self._bar.set_postfix_str(format_fields(loss, tokens_per_s), refresh=False)
            self._bar.update(done - self._bar.n)  # refreshes (at most every 0.1 s)
        elif (
            self.display == "lines"
            and done > self.done
            and (done // self.every > self.done // self.every or done == self.total)
        ):
            print(self.line(done, loss, tokens_per_s), file=self.stream, flush=True)
        self.done = max(self.done, done)

    def show_record(self, record: dict) -> None:
        """Show one trainer's metrics record (a line of its metrics file)."""
        self.show(record["step"], record["loss"], record["tokens_per_s"])

    def line(self, done: int, loss: float | None, tokens_per_s: float) -> str:
        """The plain progress line: steps, share, loss, tokens/s, elapsed time and ETA."""
        elapsed = self._clock() - self._started
        rate = (done - self.initial) / elapsed if elapsed > 0 else 0.0
        eta = tqdm.format_interval((self.total - done) / rate) if rate > 0 else "?"
        return (
            f"progress: {done}/{self.total} steps ({100 * done / self.total:.0f}%), "
            f"{format_fields(loss, tokens_per_s)}, "
            f"elapsed {tqdm.format_interval(elapsed)}, eta {eta}"
        )


class LinesAboveBar:
    """A text stream that writes whole lines above the live bars on ``stream``
    (``tqdm.write``); a partial line is kept until its end arrives, or until ``close``."""

    def __init__(self, stream: TextIO):
        self.stream, self._pending = stream, ""

    def write(self, text: str) -> int:
        *lines, self._pending = (self._pending + text).split("\n")
        for line in lines:
            tqdm.write(line, file=self.stream)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def close(self) -> None:
        if self._pending:
            tqdm.write(self._pending, file=self.stream)
            self._pending = ""

    def __getattr__(self, name: str):  # isatty, fileno, encoding: those of the stream
        return getattr(self.stream, name)


class MetricsFollower:
    """Follows trainers' metrics files as they grow: ``poll()`` reads the lines added since
    the last call (whole lines only: one still being written is read next time) and keeps
    each file's latest record. A file not there yet is looked for again at the next poll;
    what a file held before this follower was made (an earlier run) is skipped."""

    def __init__(self, paths: Iterable[str | Path], *, start_step: int = 0):
        self.paths = [Path(p) for p in paths]
        self.start_step = start_step
        self._offsets = {p: p.stat().st_size if p.exists() else 0 for p in self.paths}
        self.latest: dict[Path, dict] = {}
        self.bad_lines = 0  # lines that were no metrics record (not fatal to a live view)

    def poll(self) -> None:
        for path in self.paths:
            try:
                with path.open("rb") as f:
                    f.seek(self._offsets[path])
                    data = f.read()
            except FileNotFoundError:
                continue
            end = data.rfind(b"\n") + 1
            self._offsets[path] += end
            for line in data[:end].splitlines():
                record = _record_or_none(line)
                if record is not None:
                    self.latest[path] = record
                elif line.strip():
                    self.bad_lines += 1

    def totals(self) -> tuple[int, float | None, float]:
        """All trainers together: the swarm's global steps done (the furthest any trainer
        saw), the mean of their latest losses, tokens/s (summed)."""
        records = [self.latest.get(p) for p in self.paths]
        done = max((r["step"] if r else self.start_step for r in records), default=self.start_step)
        losses = [r["loss"] for r in records if r and r["loss"] is not None]
        loss = sum(losses) / len(losses) if losses else None
        return done, loss, sum(r["tokens_per_s"] for r in records if r)


def _record_or_none(line: bytes) -> dict | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        return None
    if not isinstance(record.get("loss"), (int, float, type(None))) or not isinstance(
        record.get("tokens_per_s"), (int, float)
    ):
        return None
    return record
