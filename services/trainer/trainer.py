"""Trainer: keeps ``in_flight`` microbatches going through the pipeline and accounts for each.

Every scheduled microbatch ends either completed (its loss counted) or failed (logged
with the reason and counted); none is dropped silently. Steps are the swarm's global
steps: each takes ``global_batch`` samples from all trainers together, and the stages
step when their replicas hold them (see the stage server's ``stepping.py``). The trainer
runs until it sees stage 0 (the last stage of a batch to step) reach ``steps``, and feeds
at most the samples of the steps left, so that a lone trainer feeds exactly those.
Its microbatches are ``shard_index``, ``shard_index + num_shards``, ... of the run's
sequence, so trainers sharing a run take the same data as one trainer would.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from services.trainer.admission import AdmissionClient, Admitted
from services.trainer.data import ByteBatcher
from services.trainer.pipeline import MicrobatchFailed, PipelineClient


@dataclass
class TrainSummary:
    steps: int = 0
    microbatches_scheduled: int = 0
    microbatches_completed: int = 0
    microbatches_failed: int = 0
    microbatch_reruns: int = 0  # runs again from the start after a stale backward
    microbatches_surplus: int = (
        0  # completed after stage 0 had every step of the run: nothing accumulated there (in flight at the end)
    )
    tokens: int = 0
    elapsed_s: float = 0.0
    tokens_per_s: float = 0.0
    eval_loss_before: float | None = None
    eval_loss_after: float | None = None
    step_losses: list[float] = field(
        default_factory=list
    )  # this trainer's mean loss of each global step (NaN: it fed none)
    step_elapsed_s: list[float] = field(default_factory=list)  # when the trainer saw each step done
    eval_curve: list[dict] = field(
        default_factory=list
    )  # held-out loss every eval_every steps: {step, samples, elapsed_s, loss}
    failures: list[str] = field(default_factory=list)
    stages: list[dict] = field(default_factory=list)  # each stage's MFU over the run (utilisation.py)
    swarm_losses: list[dict] = field(
        default_factory=list
    )  # per stage, as the coordinator counted it at the end: steps lost, samples dropped, duplicates refused


MAX_TOP_UPS = 3  # rounds of extra microbatches when the trainer's share did not get the swarm to its steps


class StepLosses:
    """This trainer's losses by the global step whose batch their microbatch was in (as the
    last stage counted it). A step's mean is released once stage 0, the last of a batch to
    step, has moved past it and no microbatch of it is still on its way (one whose last
    stage answered, still running its backward or running again after a stale one)."""

    def __init__(self, first_step: int = 0):
        self._losses: dict[int, list[float]] = {}
        self._held: dict[int, int] = {}  # microbatch index -> the step its loss belongs to, until it completes or fails
        self.next_step = first_step  # the first step not released yet

    def hold(self, microbatch: int, loss_step: int) -> None:
        """The last stage filed ``microbatch`` under ``loss_step``: keep that step until it ends."""
        if loss_step >= self.next_step:
            self._held[microbatch] = loss_step

    def record(self, loss_step: int, loss: float, microbatch: int | None = None) -> None:
        self._held.pop(microbatch, None)
        if loss_step >= self.next_step:
            self._losses.setdefault(loss_step, []).append(loss)

    def forget(self, microbatch: int) -> None:
        """``microbatch`` failed: its step no longer waits for it."""
        self._held.pop(microbatch, None)

    def release(self, swarm_step: int) -> list[tuple[int, float]]:
        """Steps below ``swarm_step`` not released yet and not held: (step, mean loss or NaN)."""
        upto = min([swarm_step, *self._held.values()])
        done = []
        while self.next_step < upto:
            losses = self._losses.pop(self.next_step, [])
            done.append((self.next_step, sum(losses) / len(losses) if losses else math.nan))
            self.next_step += 1
        return done

    def release_all(self, swarm_step: int) -> list[tuple[int, float]]:
        """The end of the run: every step below ``swarm_step``, held or not."""
        self._held.clear()
        return self.release(swarm_step)


class Trainer:
    def __init__(
        self,
        client: PipelineClient,
        batcher: ByteBatcher,
        *,
        steps: int,
        global_batch: int,
        in_flight: int,
        seed: int = 0,
        log_every: int = 10,
        eval_microbatches: int = 4,
        metrics_file: str = "",
        log=None,
        start_step: int = 0,
        before_final_eval=None,
        on_step: Callable[[dict], None] | None = None,
        shard_index: int = 0,
        num_shards: int = 1,
        eval_every: int = 0,
        admission: AdmissionClient | None = None,
    ):
        """Trains global steps ``start_step`` .. ``steps - 1`` (a resumed run starts past 0).
        ``before_final_eval``: an async callable awaited after the last step, before the
        final evaluation (e.g. the coordinator checks that replicas are one model).
        ``on_step``: called with each step's metrics record as the step completes (progress).
        ``eval_every``: also evaluate the held-out loss each time this many more steps are
        done (beside the training, forward only), into ``summary.eval_curve``: the
        loss against samples and wall time, from which a time to a target loss is read.
        ``admission``: ask the coordinator which global step each microbatch is for before
        starting it (flow control, and the ``sync`` schedule); None: start at once."""
        self.client, self.batcher, self.log = client, batcher, log
        self.steps, self.in_flight, self.seed, self.log_every = steps, in_flight, seed, log_every
        self.start_step, self.global_batch = start_step, global_batch
        self.shard_index, self.num_shards = shard_index, num_shards
        self.eval_microbatches, self.metrics_file = eval_microbatches, metrics_file
        self.before_final_eval = before_final_eval
        self.on_step = on_step
        self.eval_every = eval_every
        self.admission = admission
        self._evaluations: list[asyncio.Task] = []
        self.microbatches_per_step = max(1, math.ceil(global_batch / batcher.microbatch_size))

    async def evaluate(self) -> float:
        """Mean loss over fixed held-out microbatches, forward only."""
        mbs = [self.batcher.microbatch(i, split="eval") for i in range(self.eval_microbatches)]
        losses = await asyncio.gather(*(self.client.evaluate(mb, seed=0) for mb in mbs))
        return sum(losses) / len(losses)

    def microbatch_index(self, k: int) -> int:
        """The run's index of this trainer's ``k``-th microbatch (from the start of the run)."""
        return self.shard_index + self.num_shards * k

    async def run(self) -> TrainSummary:
        """Train the run's steps (see :meth:`__init__`); with admission, the admissions of the
        microbatches in flight are renewed throughout (:meth:`AdmissionClient.keep_alive`)."""
        if self.admission is None:
            return await self._run()
        keep_alive = asyncio.create_task(self.admission.keep_alive(), name="admission.keep_alive")
        try:
            return await self._run()
        finally:
            keep_alive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keep_alive

    async def _run(self) -> TrainSummary:
        budget = (
            max(0, self.steps - self.start_step) * self.microbatches_per_step
        )  # microbatches enough to finish alone, unless steps overshoot
        first = -(
            -self.start_step * self.microbatches_per_step // self.num_shards
        )  # where a resumed run picks up its share
        summary = TrainSummary(steps=self.start_step)
        summary.eval_loss_before = await self.evaluate()
        self._emit("train.eval", when="before", loss=round(summary.eval_loss_before, 4))
        losses = StepLosses(self.start_step)
        started = time.perf_counter()
        state = {"next": 0, "swarm_step": self.start_step, "complete": False}

        def more() -> bool:
            return state["swarm_step"] < self.steps and state["next"] < budget and not state["complete"]

        async def worker() -> None:
            while more():
                k = first + state["next"]
                state["next"] += 1
                index = self.microbatch_index(k)
                mb = self.batcher.microbatch(index)
                admitted = await self._admit(index, mb)
                if admitted.complete:  # every step of the run has its samples: start no more
                    state["complete"] = True
                    break
                summary.microbatches_scheduled += 1
                try:
                    result = await self.client.train(
                        mb,
                        seed=self.seed * 1_000_003 + index,
                        on_loss=functools.partial(losses.hold, index),
                        step=admitted.step,
                    )
                except MicrobatchFailed as exc:
                    if self.admission is not None:
                        await self.admission.release(self.client.microbatch_id(index))
                    losses.forget(index)
                    summary.microbatches_failed += 1
                    summary.failures.append(str(exc))
                    self._emit(
                        "microbatch.failed",
                        level="error",
                        microbatch=index,
                        stage=exc.stage,
                        path=exc.path,
                        error=str(exc.errors[-1]),
                    )
                    continue
                if self.admission is not None:
                    self.admission.finished(self.client.microbatch_id(index))
                summary.microbatches_completed += 1
                summary.microbatch_reruns += result.reruns
                if result.complete:  # stage 0 has every step of the run: no need for more
                    summary.microbatches_surplus += 1
                    state["complete"] = True
                summary.tokens += mb.num_tokens
                losses.record(result.loss_step, result.loss, index)
                state["swarm_step"] = max(state["swarm_step"], result.swarm_step)
                self._release(losses, min(state["swarm_step"], self.steps), summary, started)

        await asyncio.gather(*(worker() for _ in range(self.in_flight)))
        for _ in range(
            MAX_TOP_UPS
        ):  # steps that held more than the global batch (the coordinator's return) left the run short
            if state["swarm_step"] >= self.steps or state["complete"]:
                break
            before, missing = state["swarm_step"], (self.steps - state["swarm_step"]) * self.microbatches_per_step
            budget += -(-missing // self.num_shards)
            self._emit("train.top_up", swarm_step=before, steps=self.steps, microbatches=-(-missing // self.num_shards))
            await asyncio.gather(*(worker() for _ in range(self.in_flight)))
            if state["swarm_step"] == before:
                break  # the swarm does not step (no coordinator, no replica): no use feeding it
        # the end: every microbatch completed or failed; stage 0 holding every step of the run
        # means its last ones are being taken
        self._release(
            losses,
            self.steps if state["complete"] else min(state["swarm_step"], self.steps),
            summary,
            started,
            final=True,
        )
        summary.elapsed_s = time.perf_counter() - started
        summary.tokens_per_s = summary.tokens / summary.elapsed_s if summary.elapsed_s else 0.0
        if state["swarm_step"] < self.steps:
            self._emit(
                "train.short",
                level="warning",
                swarm_step=state["swarm_step"],
                steps=self.steps,
                reason=(
                    "this trainer fed the samples of every step left, and the swarm did not step that far "
                    "(other trainers gone, failed microbatches, dropped samples)"
                ),
            )
        await asyncio.gather(*self._evaluations)
        if self.before_final_eval is not None:
            await self.before_final_eval()
        summary.eval_loss_after = await self.evaluate()
        self._emit("train.eval", when="after", loss=round(summary.eval_loss_after, 4))
        return summary

    async def _admit(self, index: int, mb) -> Admitted:
        if self.admission is None:
            return Admitted(None)
        return await self.admission.admit(self.client.microbatch_id(index), int(mb.inputs.shape[0]))

    def _release(
        self, losses: StepLosses, upto: int, summary: TrainSummary, started: float, final: bool = False
    ) -> None:
        for step, step_loss in losses.release_all(upto) if final else losses.release(upto):
            summary.steps = step + 1
            summary.step_losses.append(step_loss)
            summary.step_elapsed_s.append(time.perf_counter() - started)
            self._step_done(step, step_loss, summary, summary.step_elapsed_s[-1])
            if (
                self.eval_every and (step + 1) % self.eval_every == 0 and step + 1 < self.steps
            ):  # the last step gets the final evaluation
                self._evaluations.append(
                    asyncio.create_task(
                        self._evaluate_at(step + 1, summary, summary.step_elapsed_s[-1]), name=f"eval-{step + 1}"
                    )
                )

    async def _evaluate_at(self, steps_done: int, summary: TrainSummary, elapsed_s: float) -> None:
        """The held-out loss once ``steps_done`` steps are done (seen done ``elapsed_s`` into the run)."""
        try:
            loss = await self.evaluate()
        except MicrobatchFailed as exc:  # an evaluation is a measurement: the run goes on without it
            self._emit("train.eval.failed", level="warning", step=steps_done, error=str(exc))
            return
        point = {
            "step": steps_done,
            "samples": steps_done * self.global_batch,
            "elapsed_s": round(elapsed_s, 3),
            "loss": round(loss, 4),
        }
        summary.eval_curve.append(point)
        self._emit("train.eval", when="during", **point)

    def _step_done(self, step: int, loss: float, summary: TrainSummary, elapsed_s: float) -> None:
        tokens_per_s = summary.tokens / elapsed_s if elapsed_s else 0.0
        record = {
            "step": step + 1,
            "loss": _json_number(loss, 4),
            "tokens_per_s": round(tokens_per_s, 1),
            "elapsed_s": round(elapsed_s, 2),
            # this trainer's so far: microbatches completed, and runs again after a stale backward
            "microbatches": summary.microbatches_completed,
            "reruns": summary.microbatch_reruns,
        }
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
