"""Trainer logic without a network: step accounting, retry delays, replica choice, error
classes, and the Trainer loop driven by a fake pipeline client."""

from __future__ import annotations

import asyncio
import json
import math
import random

import pytest
import torch

from services.trainer.data import ByteBatcher
from services.trainer.pipeline import MicrobatchFailed, TrainResult
from services.trainer.trainer import StepLosses, Trainer, summary_json
from shared.errors import RemoteError
from shared.retry import RetryPolicy

# --- StepLosses ----------------------------------------------------------------------


def test_step_losses_are_released_once_the_swarm_moved_past_their_step():
    losses = StepLosses()
    losses.record(1, 40.0)
    losses.record(0, 1.0)
    losses.record(0, 3.0)
    assert losses.release(0) == []
    assert losses.release(1) == [(0, 2.0)]
    losses.record(0, 99.0)  # a late microbatch of a released step: not counted again
    losses.record(1, 60.0)
    done = losses.release(3)
    assert done[0] == (1, 50.0) and done[1][0] == 2 and math.isnan(done[1][1])
    assert losses.release(3) == []


def test_a_step_waits_for_its_microbatches_still_on_their_way_and_a_failed_one_lets_it_go():
    losses = StepLosses()
    losses.record(0, 1.0, microbatch=1)
    losses.hold(2, 0)  # the last stage filed microbatch 2 under step 0; its lower stages are still running
    losses.hold(3, 1)
    assert losses.release(2) == []  # the swarm is past steps 0 and 1, but their losses are not all in
    losses.record(0, 3.0, microbatch=2)
    assert losses.release(2) == [(0, 2.0)]
    losses.forget(3)  # failed: step 1 has none of this trainer's losses
    done = losses.release(2)
    assert done[0][0] == 1 and math.isnan(done[0][1])
    losses.hold(4, 2)
    assert [s for s, _ in losses.release_all(3)] == [2]  # the run is over: nothing waits


def test_step_losses_step_without_a_loss_of_this_trainer_is_nan_and_resume_starts_later():
    losses = StepLosses(first_step=5)
    losses.record(4, 1.0)  # before the resumed run: ignored
    losses.record(6, 2.0)
    done = losses.release(7)
    assert [s for s, _ in done] == [5, 6] and math.isnan(done[0][1]) and done[1][1] == 2.0
    assert losses.next_step == 7


# --- RetryPolicy ---------------------------------------------------------------------


def test_retry_delay_grows_exponentially_within_jitter():
    policy = RetryPolicy(max_retries=10, base_delay_s=0.1, max_delay_s=100.0)
    rng = random.Random(0)
    for attempt in range(1, 8):
        nominal = 0.1 * 2 ** (attempt - 1)
        for _ in range(50):
            delay = policy.delay_s(attempt, rng)
            assert 0.75 * nominal <= delay <= 1.25 * nominal, (attempt, delay)


def test_retry_delay_is_capped_by_max_delay():
    policy = RetryPolicy(max_retries=20, base_delay_s=0.05, max_delay_s=2.0)
    rng = random.Random(1)
    assert policy.delay_s(6, random.Random(0)) <= 1.6 * 1.25  # 1.6 nominal: not yet capped
    delays = [policy.delay_s(attempt, rng) for attempt in range(7, 101) for _ in range(5)]  # 3.2+ nominal
    assert all(1.5 <= d <= 2.5 for d in delays)
    assert max(delays) > 2.0 and min(delays) < 2.0  # jitter applies around the cap too


def test_retry_delay_stays_capped_for_very_late_attempts():
    policy = RetryPolicy(max_retries=5000, base_delay_s=0.05, max_delay_s=2.0)
    assert 1.5 <= policy.delay_s(2000, random.Random(0)) <= 2.5


def test_retry_jitter_is_spread_over_the_whole_band_and_reproducible():
    policy = RetryPolicy(base_delay_s=1.0, max_delay_s=1.0)
    delays = [policy.delay_s(1, random.Random(7)) for _ in range(3)]
    assert delays[0] == delays[1] == delays[2]  # same seed, same delay
    rng = random.Random(2)
    many = [policy.delay_s(1, rng) for _ in range(2000)]
    assert min(many) < 0.8 and max(many) > 1.2  # not a constant
    assert all(0.75 <= d <= 1.25 for d in many)
    assert 0.97 < sum(many) / len(many) < 1.03  # centred on the nominal delay


@pytest.mark.parametrize(
    "kwargs",
    [dict(max_retries=-1), dict(base_delay_s=-0.1), dict(base_delay_s=1.0, max_delay_s=0.5)],
)
def test_invalid_retry_policy_raises(kwargs):
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)


def test_valid_edge_retry_policies():
    assert RetryPolicy(max_retries=0).max_retries == 0
    assert RetryPolicy(base_delay_s=0.0, max_delay_s=0.0).delay_s(3, random.Random(0)) == 0.0


# --- RemoteError.retryable -----------------------------------------------------------


@pytest.mark.parametrize(
    "status, code, retryable",
    [
        (None, "transport", True),
        (500, "internal", True),
        (503, "overloaded", True),
        (503, "draining", True),
        (409, "wrong_stage", True),
        (200, "bad_reply", True),
        (400, "bad_payload", False),
        (413, "payload_too_large", False),
        (415, "unsupported_media_type", False),
    ],
)
def test_remote_error_retryable(status, code, retryable):
    err = RemoteError("http://x", status, code, "msg")
    assert err.retryable is retryable
    assert err.status == status and err.code == code and "http://x" in str(err)


# --- Trainer with a fake pipeline client --------------------------------------------


class FakeClient:
    """Stands in for the network and a swarm that steps every ``per_step`` microbatches that
    complete. Blocks every train() call until ``in_flight`` calls are running at once (then
    lets everything through), so the test sees the trainer reach its concurrency without any
    timing; counts the calls in progress at each moment."""

    def __init__(
        self,
        in_flight: int,
        fail: set[int],
        eval_loss: float = 5.0,
        per_step: int = 2,
        others: int = 0,
        complete_at: int | None = None,
    ):
        self.in_flight, self.fail, self.eval_loss, self.per_step = in_flight, fail, eval_loss, per_step
        self.completed = others  # microbatches other trainers fed
        self.complete_at = complete_at  # from this swarm step on, stage 0 says the run's steps are all reserved
        self.current = self.max_current = 0
        self.reached = asyncio.Event()
        self.train_calls: list[tuple[int, int]] = []
        self.eval_calls: list[int] = []

    async def train(self, mb, seed: int, on_loss=None, step=None) -> TrainResult:
        self.train_calls.append((mb.index, seed))
        self.current += 1
        self.max_current = max(self.max_current, self.current)
        try:
            if self.current >= self.in_flight:
                self.reached.set()
            await self.reached.wait()
            for _ in range(mb.index % 3):  # finish out of order: yield, no waiting on time
                await asyncio.sleep(0)
            if mb.index in self.fail:
                err = RemoteError("http://s1", 503, "overloaded", "queue full")
                raise MicrobatchFailed(mb.index, 1, "/forward", [err])
            self.completed += 1
            swarm_step = self.completed // self.per_step
            complete = self.complete_at is not None and swarm_step >= self.complete_at
            return TrainResult(float(mb.index), mb.index // self.per_step, swarm_step, complete=complete)
        finally:
            self.current -= 1

    async def evaluate(self, mb, seed: int) -> float:
        self.eval_calls.append(mb.index)
        return self.eval_loss


async def run_guarded(trainer: Trainer):
    """trainer.run(), failing (not hanging) if the fake's barrier is never reached, i.e. the
    trainer runs fewer than in_flight microbatches at once. A guard, not synchronization."""
    async with asyncio.timeout(10):
        return await trainer.run()


class RecordingLog:
    def __init__(self):
        self.events: list[tuple[str, str, dict]] = []

    def __getattr__(self, level):
        return lambda event, **fields: self.events.append((level, event, fields))


def make_batcher(microbatch_size: int = 2, seq_len: int = 8) -> ByteBatcher:
    tokens = torch.tensor(list(random.Random(0).randbytes(5_000)), dtype=torch.uint8)
    return ByteBatcher(tokens, seq_len, microbatch_size, seed=0)


async def test_trainer_accounts_for_every_microbatch_and_respects_in_flight(tmp_path):
    in_flight, steps, per_step = 3, 5, 2  # global_batch 4 / microbatch_size 2
    fail = {1, 6, 7}  # step 0: one of two failed; step 3: both failed
    client = FakeClient(in_flight, fail)
    log = RecordingLog()
    metrics = tmp_path / "metrics.jsonl"
    trainer = Trainer(
        client,
        make_batcher(),
        steps=steps,
        global_batch=4,
        in_flight=in_flight,
        seed=2,
        log_every=1,
        eval_microbatches=3,
        metrics_file=str(metrics),
        log=log,
    )
    assert trainer.microbatches_per_step == per_step
    summary = await run_guarded(trainer)

    # the trainer fed the samples of every step (its budget, 10 microbatches); 3 failed, so
    # the swarm stopped 2 steps short, and the trainer topped up the 4 microbatches missing
    scheduled = steps * per_step + 2 * per_step
    assert summary.microbatches_scheduled == scheduled
    assert summary.microbatches_completed + summary.microbatches_failed == scheduled
    assert summary.microbatches_failed == len(fail) and len(summary.failures) == len(fail)
    assert sorted(int(f.split()[1].rstrip(":")) for f in summary.failures) == sorted(fail)
    assert all("/forward on stage 1" in f and "overloaded" in f for f in summary.failures)
    failed_events = [f for level, event, f in log.events if event == "microbatch.failed"]
    assert sorted(f["microbatch"] for f in failed_events) == sorted(fail)
    assert all(level == "error" for level, event, _ in log.events if event == "microbatch.failed")
    assert [f["microbatches"] for _, event, f in log.events if event == "train.top_up"] == [2 * per_step]

    # every microbatch trained exactly once, with its own seed
    assert sorted(i for i, _ in client.train_calls) == list(range(scheduled))
    assert all(seed == 2 * 1_000_003 + i for i, seed in client.train_calls)
    assert summary.tokens == summary.microbatches_completed * 2 * 8

    # steps seen done are released in order, each the mean of this trainer's microbatches of
    # that step (loss = index, step = index // 2); step 3 lost both its microbatches: NaN
    assert summary.steps == steps
    expected = [0.0, 2.5, 4.5, math.nan, 8.5]
    assert len(summary.step_losses) == len(summary.step_elapsed_s) == steps
    for got, want in zip(summary.step_losses, expected):
        assert (math.isnan(got) and math.isnan(want)) or got == want
    assert summary.step_elapsed_s == sorted(summary.step_elapsed_s)
    assert summary.elapsed_s >= summary.step_elapsed_s[-1]
    assert not [f for _, event, f in log.events if event == "train.short"]

    # concurrency: never above in_flight, and in_flight actually reached
    assert client.max_current == in_flight
    assert client.current == 0

    # evaluation before and after on the fixed held-out microbatches
    assert summary.eval_loss_before == summary.eval_loss_after == 5.0
    assert client.eval_calls == [0, 1, 2, 0, 1, 2]

    lines = metrics.read_text().splitlines()
    assert len(lines) == steps
    records = [json.loads(line) for line in lines]
    for n, record in enumerate(records, start=1):
        assert set(record) == {"step", "loss", "tokens_per_s", "elapsed_s", "microbatches", "reruns"}
        assert record["step"] == n
        assert record["tokens_per_s"] >= 0 and record["elapsed_s"] >= 0
        assert 0 < record["microbatches"] <= summary.microbatches_completed and record["reruns"] == 0
    assert [r["microbatches"] for r in records] == sorted(r["microbatches"] for r in records)  # counted so far
    assert [r["loss"] for r in records if r["loss"] is not None] == [0.0, 2.5, 4.5, 8.5]
    assert json.loads(summary_json(summary))["microbatches_failed"] == len(fail)


@pytest.mark.parametrize("in_flight", [1, 4])
async def test_trainer_concurrency_is_bounded_by_in_flight(in_flight):
    client = FakeClient(in_flight, fail=set())
    trainer = Trainer(
        client, make_batcher(microbatch_size=4), steps=6, global_batch=8, in_flight=in_flight, eval_microbatches=1
    )
    summary = await run_guarded(trainer)
    assert client.max_current == in_flight
    assert summary.microbatches_completed == summary.microbatches_scheduled == 12
    assert summary.microbatches_failed == 0 and summary.failures == []
    # each step's loss: the mean of its microbatches (2s, 2s + 1) that completed before the
    # swarm moved past it (out of order here, so possibly one or none of them)
    assert len(summary.step_losses) == 6
    for s, loss in enumerate(summary.step_losses):
        assert math.isnan(loss) or loss in (2 * s, 2 * s + 1, 2 * s + 0.5), (s, loss)
    if in_flight == 1:
        assert summary.step_losses == [0.5 + 2 * s for s in range(6)]
    assert summary.tokens_per_s > 0


async def test_trainer_stops_feeding_once_the_swarm_reached_its_steps():
    """Another trainer fed most of the run: this one stops when it sees stage 0 at ``steps``."""
    client = FakeClient(1, fail=set(), per_step=2, others=2 * 5)  # the swarm is at step 5 of 6
    trainer = Trainer(
        client,
        make_batcher(microbatch_size=4),
        steps=6,
        global_batch=8,
        in_flight=1,
        eval_microbatches=1,
        shard_index=1,
        num_shards=2,
    )
    summary = await run_guarded(trainer)
    assert summary.microbatches_scheduled == 2  # the last step's two microbatches, not its budget of 12
    assert [i for i, _ in client.train_calls] == [1, 3]  # its shard of the run's sequence
    assert summary.steps == 6


async def test_trainer_stops_feeding_when_stage_0_has_every_step_of_the_run():
    client = FakeClient(1, fail=set(), per_step=2, complete_at=1)
    trainer = Trainer(
        client, make_batcher(microbatch_size=4), steps=6, global_batch=8, in_flight=1, eval_microbatches=1
    )
    summary = await run_guarded(trainer)
    assert summary.microbatches_scheduled == 2 and summary.microbatches_surplus == 1


async def test_metrics_file_is_strict_json_when_a_whole_step_failed(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    client = FakeClient(1, fail={0, 1})
    trainer = Trainer(
        client, make_batcher(), steps=2, global_batch=4, in_flight=1, eval_microbatches=1, metrics_file=str(metrics)
    )
    await run_guarded(trainer)

    def reject(constant):
        raise ValueError(f"not JSON: {constant}")

    for line in metrics.read_text().splitlines():
        json.loads(line, parse_constant=reject)


async def test_held_out_loss_every_n_steps_gives_the_loss_against_samples_and_time():
    client = FakeClient(2, fail=set(), eval_loss=3.25)
    trainer = Trainer(client, make_batcher(), steps=6, global_batch=4, in_flight=2, eval_microbatches=2, eval_every=2)
    summary = await run_guarded(trainer)
    # after steps 2 and 4 (step 6 is the final evaluation's), on the same held-out microbatches
    assert [(p["step"], p["samples"], p["loss"]) for p in summary.eval_curve] == [(2, 8, 3.25), (4, 16, 3.25)]
    # timed when the step was seen done (the weights evaluated are those of that step, or a little later)
    assert [p["elapsed_s"] for p in summary.eval_curve] == [
        round(summary.step_elapsed_s[p["step"] - 1], 3) for p in summary.eval_curve
    ]
    assert client.eval_calls == [0, 1] * 4  # before, after step 2, after step 4, after the run
    assert json.loads(summary_json(summary))["eval_curve"] == summary.eval_curve
