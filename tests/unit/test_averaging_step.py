"""Step rounds as one member runs them (``Averager`` with a real stage runtime and compute
worker, no sockets): when a member steps (:func:`step_verdict`), and that the gradient it
took for a round is applied, given back or counted as dropped, never lost: a full compute
queue, an empty round, a cancel in the middle, a compute worker shut down.

Also the coordinator's choice of a drift repair's source (:func:`plan_repair`)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from services.coordinator.averaging import plan_repair
from services.stage_server.allreduce import Averager, ReducedPart, RoundSpec
from services.stage_server.runtime import Accumulated, ComputeWorker, StageRuntime
from services.stage_server.stepping import StepRound, StepVerdict, step_verdict
from shared.log import get_logger
from shared.model import PRESETS

SAMPLES = 4
URL, PEER = "http://127.0.0.1:1", "http://127.0.0.1:2"


# --------------------------------------------------------------------------- the verdict
def part(contributors, weight=8.0) -> ReducedPart:
    return ReducedPart(torch.zeros(3), tuple(contributors), weight)


def test_a_member_steps_only_on_whole_non_empty_parts_that_every_stepping_member_can_hold():
    whole = [part([0, 1, 2]), part([0, 1, 2]), part([0, 1, 2])]
    assert step_verdict(whole, set()) is StepVerdict.APPLY
    assert step_verdict([whole[0], None, whole[2]], set()) is StepVerdict.PART_FAILED
    # hole 3: part 1's reducer took our parts (it is among the round's contributors) but could not
    # serve its reduction to us; its backup holds the others' values only, while the members that
    # reached member 1 step with its whole reduction
    assert step_verdict([part([0, 1]), part([0])], {1}) is StepVerdict.SHORT_BACKUP
    assert step_verdict([part([0, 1, 2]), part([0, 2]), part([0, 1, 2])], {1}) is StepVerdict.SHORT_BACKUP
    # a member that sent nothing (dead from the start): its backup holds the whole round
    assert step_verdict([part([0, 2]), part([0, 2]), part([0, 2])], {1}) is StepVerdict.APPLY
    # main reductions are the same for every member that fetched them, whoever each holds
    assert step_verdict([part([0, 1, 2]), part([0, 1]), part([0, 1, 2])], set()) is StepVerdict.APPLY
    assert step_verdict([part([0], weight=0.0)], set()) is StepVerdict.EMPTY
    assert step_verdict([part([0, 1], weight=0.0), part([0, 1])], set()) is StepVerdict.EMPTY


def test_a_repair_copies_the_largest_group_of_identical_replicas_to_the_others():
    assert plan_repair({"http://b": "x", "http://a": "y"}) == ("http://a", ["http://b"])
    assert plan_repair({"http://a": "x", "http://b": "y", "http://c": "y"}) == ("http://b", ["http://a"])
    assert plan_repair({"http://c": "z", "http://a": "x", "http://b": "y", "http://d": "x"}) == (
        "http://a",
        ["http://b", "http://c"],
    )
    with pytest.raises(AssertionError):
        plan_repair({"http://a": "x", "http://b": "x"})


# --------------------------------------------------------------------------- one member's rounds
class Unreachable:
    """A transport whose peers never answer (a round with a peer waits on it until cancelled)."""

    async def post(self, url, body, *, timeout_s):
        await asyncio.Event().wait()


@pytest.fixture
def member():
    """(runtime, worker, averager) of one replica of stage 1; the runtime holds a gradient of
    SAMPLES samples for step 0 unless the test empties it."""
    runtime = StageRuntime(PRESETS["tiny"], 1, 4, seed=0, solo=False)
    gradient = torch.randn(sum(p.numel() for p in runtime.params), generator=torch.Generator().manual_seed(1))
    runtime.give_back(Accumulated(gradient, SAMPLES, frozenset({"mb-1"})), 0)
    worker = ComputeWorker(max_queue=2)
    averager = Averager(runtime, worker.run, int8_block=4096, log=get_logger(test="step-round"))
    averager.transport = Unreachable()
    averager.kinds["step"] = StepRound(averager)
    yield runtime, worker, averager
    worker.close()


def step_round(members=(URL,), round_id="step-s1-a") -> RoundSpec:
    return RoundSpec(round_id, 1, tuple(members), 0, "fp32", 30.0, kind="step", step=0)


async def ended(averager: Averager) -> dict:
    await asyncio.wait_for(asyncio.shield(averager._task), 30)
    return averager.last_round.summary()


async def test_a_full_compute_queue_does_not_refuse_the_step_of_a_round_that_took_the_gradient(member):
    """Hole 4: backwards fill the compute queue while a one-replica stage all-reduces; its step
    must not be refused after the gradient left the bucket."""
    runtime, worker, averager = member
    before = [p.detach().clone() for p in runtime.params]
    jobs: list = []

    async def run_compute(fn, *args, **kwargs):  # every job after the take finds the queue full
        jobs.append(fn)
        if len(jobs) > 1:
            while worker.queue_depth < worker.max_queue:
                asyncio.ensure_future(worker.run(time.sleep, 0.01))
                await asyncio.sleep(0)
        return await worker.run(fn, *args, **kwargs)

    averager.run_compute = run_compute
    averager.start(step_round())
    summary = await ended(averager)

    assert runtime.step == 1 and runtime.stats.last_effective_batch == SAMPLES, summary
    assert any(not torch.equal(a, b) for a, b in zip(before, runtime.params))
    assert runtime.pending_samples == 0 and runtime.stats.samples_dropped == 0


async def test_a_round_that_reduced_no_sample_takes_no_step(member):
    """Hole 4: an AdamW step with a zero gradient still moves the weights (momentum, decay)."""
    runtime, _, averager = member
    runtime.reset_accumulation()  # nothing accumulated: the round reduces 0 samples
    digest, version = runtime.digest(), runtime.version

    averager.start(step_round())
    summary = await ended(averager)

    assert runtime.step == 0 and runtime.digest() == digest and runtime.version == version
    assert summary["verdict"] == "empty" and not summary["ok"]


async def test_a_round_cancelled_after_the_take_gives_the_gradient_back(member):
    runtime, _, averager = member
    averager.start(step_round(members=(URL, PEER)))
    while runtime.pending(0):  # until the gradient is taken (the round then waits on its peer)
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)

    await averager.close()  # the server stops in the middle of the round

    assert runtime.step == 0 and runtime.pending(0) == SAMPLES and runtime.stats.samples_dropped == 0


async def test_a_step_the_compute_worker_can_no_longer_take_counts_the_gradient_as_dropped(member):
    runtime, worker, averager = member
    jobs: list = []

    async def run_compute(fn, *args, **kwargs):  # the worker shuts down once the gradient is taken
        jobs.append(fn)
        if len(jobs) > 1:
            worker.close()
        return await worker.run(fn, *args, **kwargs)

    averager.run_compute = run_compute
    averager.start(step_round())
    await ended(averager)

    assert runtime.step == 0 and runtime.stats.samples_dropped == SAMPLES
