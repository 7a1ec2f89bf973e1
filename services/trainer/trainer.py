"""Trainer: keeps ``in_flight`` microbatches going through the pipeline and accounts for each.

Every scheduled microbatch ends either completed (its loss counted) or failed (logged
with the reason and counted); none is dropped silently. A step is ``samples_per_step``
samples, the batch after which each stage server runs its optimizer.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from services.trainer.data import ByteBatcher
from services.trainer.pipeline import MicrobatchFailed, PipelineClient


@dataclass
class TrainSummary:
    steps: int = 0
    microbatches_scheduled: int = 0
    microbatches_completed: int = 0
    microbatches_failed: int = 0
    tokens: int = 0
    elapsed_s: float = 0.0
    tokens_per_s: float = 0.0
    eval_loss_before: float | None = None
    eval_loss_after: float | None = None
    step_losses: list[float] = field(default_factory=list)
    step_elapsed_s: list[float] = field(default_factory=list)  # when each step completed
    failures: list[str] = field(default_factory=list)


class StepTracker:
    """Collects microbatch results (out of order) and releases steps in order once complete."""

    def __init__(self, microbatches_per_step: int, first_step: int = 0):
        self.per_step = microbatches_per_step
        self._losses: dict[int, list[float]] = {}
        self._resolved: dict[int, int] = {}
        self.next_step = first_step

    def record(self, index: int, loss: float | None) -> list[tuple[int, float]]:
        """Record microbatch ``index`` (loss None if it failed); return the steps now complete."""
        step = index // self.per_step
        self._resolved[step] = self._resolved.get(step, 0) + 1
        if loss is not None:
            self._losses.setdefault(step, []).append(loss)
        done = []
        while self._resolved.get(self.next_step, 0) == self.per_step:
            losses = self._losses.pop(self.next_step, [])
            del self._resolved[self.next_step]
            done.append((self.next_step, sum(losses) / len(losses) if losses else math.nan))
            self.next_step += 1
        return done


class Trainer:
    def __init__(self, client: PipelineClient, batcher: ByteBatcher, *, steps: int, samples_per_step: int, in_flight: int, seed: int = 0, log_every: int = 10, eval_microbatches: int = 4, metrics_file: str = "", log=None, start_step: int = 0, before_final_eval=None, on_step: Callable[[dict], None] | None = None):
        """Trains steps ``start_step`` .. ``steps - 1`` (a resumed run starts past 0).
        ``before_final_eval``: an async callable awaited after the last step, before the
        final evaluation (the swarm's replicas averaged, so one model is evaluated).
        ``on_step``: called with each step's metrics record as the step completes (progress)."""
        self.client, self.batcher, self.log = client, batcher, log
        self.steps, self.in_flight, self.seed, self.log_every = steps, in_flight, seed, log_every
        self.start_step = start_step
        self.eval_microbatches, self.metrics_file = eval_microbatches, metrics_file
        self.before_final_eval = before_final_eval
        self.on_step = on_step
        self.microbatches_per_step = max(1, math.ceil(samples_per_step / batcher.microbatch_size))

    async def evaluate(self) -> float:
        """Mean loss over fixed held-out microbatches, forward only."""
        mbs = [self.batcher.microbatch(i, split="eval") for i in range(self.eval_microbatches)]
        losses = await asyncio.gather(*(self.client.evaluate(mb, seed=0) for mb in mbs))
        return sum(losses) / len(losses)

    async def run(self) -> TrainSummary:
        first = self.start_step * self.microbatches_per_step
        summary = TrainSummary(steps=self.start_step, microbatches_scheduled=max(0, self.steps - self.start_step) * self.microbatches_per_step)
        summary.eval_loss_before = await self.evaluate()
        self._emit("train.eval", when="before", loss=round(summary.eval_loss_before, 4))
        tracker = StepTracker(self.microbatches_per_step, first_step=self.start_step)
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(first, first + summary.microbatches_scheduled):
            queue.put_nowait(i)
        started = time.perf_counter()

        async def worker() -> None:
            while not queue.empty():
                index = queue.get_nowait()
                mb = self.batcher.microbatch(index)
                try:
                    loss = await self.client.train(mb, seed=self.seed * 1_000_003 + index)
                    summary.microbatches_completed += 1
                    summary.tokens += mb.num_tokens
                except MicrobatchFailed as exc:
                    loss = None
                    summary.microbatches_failed += 1
                    summary.failures.append(str(exc))
                    self._emit("microbatch.failed", level="error", microbatch=index, stage=exc.stage, path=exc.path, error=str(exc.errors[-1]))
                for step, step_loss in tracker.record(index, loss):
                    summary.steps = step + 1
                    summary.step_losses.append(step_loss)
                    summary.step_elapsed_s.append(time.perf_counter() - started)
                    self._step_done(step, step_loss, summary, summary.step_elapsed_s[-1])

        await asyncio.gather(*(worker() for _ in range(self.in_flight)))
        summary.elapsed_s = time.perf_counter() - started
        summary.tokens_per_s = summary.tokens / summary.elapsed_s if summary.elapsed_s else 0.0
        if self.before_final_eval is not None:
            await self.before_final_eval()
        summary.eval_loss_after = await self.evaluate()
        self._emit("train.eval", when="after", loss=round(summary.eval_loss_after, 4))
        return summary

    def _step_done(self, step: int, loss: float, summary: TrainSummary, elapsed_s: float) -> None:
        tokens_per_s = summary.tokens / elapsed_s if elapsed_s else 0.0
        record = {"step": step + 1, "loss": _json_number(loss, 4), "tokens_per_s": round(tokens_per_s, 1), "elapsed_s": round(elapsed_s, 2)}
        if self.metrics_file:
            with open(self.metrics_file, "a") as f:
                f.write(json.dumps(record) + "\n")
        if self.on_step:
            self.on_step(record)
        if (step + 1) % self.log_every == 0 or step == 0 or step + 1 == self.steps:
            self._emit("train.step", **record)

    def _emit(self, event: str, level: str = "info", **fields) -> None:
        if self.log:
            getattr(self.log, level)(event, **fields)


def _json_number(x: float, digits: int) -> float | None:
    """NaN (a step whose microbatches all failed) becomes null: strict JSON has no NaN."""
    return None if math.isnan(x) else round(x, digits)


def summary_json(summary: TrainSummary, *, per_step: bool = True) -> str:
    """The summary as strict JSON; ``per_step=False`` leaves out the per-step lists."""
    record = asdict(summary)
    record["step_losses"] = [_json_number(x, 6) for x in summary.step_losses]
    if not per_step:
        del record["step_losses"], record["step_elapsed_s"]
    return json.dumps(record, allow_nan=False)
