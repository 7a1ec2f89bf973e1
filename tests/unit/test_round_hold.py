"""A replica still applying a step round holds the forwards that need its weights
(``Averager.hold_for``, called by ``routes.run_forward``).

The coordinator moves a stage when the first member of its step round stepped, and with the
``sync`` schedule admits the next step's microbatches then: a slow member may get one of
them while it still applies the round. Its forward must run on the round's weights, not on
those before (its gradient would be a step older than the admission allows). Here the round
is scripted (it "applies" when the test lets it go), the forward is the real route's, and the
runtime records the step each forward ran at.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.stage_server.allreduce import Averager, RoundSpec
from services.stage_server.metrics import STAGE_METRICS
from services.stage_server.routes import RUNTIME, SETTINGS, STEPPER, WORKER, StageRequest, run_forward
from services.stage_server.runtime import ComputeWorker, OptimizerConfig, StageRuntime
from services.stage_server.stepping import StepClient
from shared.log import get_logger
from shared.model import PRESETS
from tests.conftest import stage_settings

CFG = PRESETS["tiny"]
WAIT_S = 10.0  # bound on every wait


class RecordingRuntime(StageRuntime):
    """Records the step (weights version) each forward ran at."""

    def __init__(self):
        super().__init__(CFG, 1, 3, optim=OptimizerConfig(global_batch=8), solo=False)
        self.forward_steps: list[int] = []

    def forward(self, *args, **kwargs):
        self.forward_steps.append(self.step)
        return super().forward(*args, **kwargs)


class ScriptedStepRound:
    """The ``step`` kind of round, scripted: it takes its step when ``apply`` is set."""

    def __init__(self, averager: Averager):
        self.averager, self.apply = averager, asyncio.Event()

    def admit(self, spec: RoundSpec) -> None:
        pass

    def status(self) -> dict:
        return {}

    async def run(self, rnd, log) -> bool:
        await self.apply.wait()
        self.averager.runtime.stats.optimizer_steps += 1  # the round's step, applied
        self.averager.stepped()
        return True


async def nothing(*args) -> None:
    return None


class NoMetrics:
    def note_activation(self, *args) -> None:
        pass


@pytest.fixture
async def replica():
    """(app, runtime, the scripted round) of a stage-1 replica with a step round running, step 0 -> 1."""
    runtime = RecordingRuntime()
    worker = ComputeWorker(8)
    averager = Averager(runtime, worker.run, int8_block=64, log=get_logger(service="test"))
    averager.transport = object()  # it takes rounds (none of them sends anything here)
    scripted = ScriptedStepRound(averager)
    averager.kinds["step"] = scripted
    stepper = StepClient(
        runtime,
        post=nothing,
        resync=nothing,
        wait_round=averager.wait_round,
        hold_for=averager.hold_for,
        round_wait_s=1.0,
        log=get_logger(service="test"),
        identity={"run_id": "test", "stage": 1, "url": "http://a", "global_batch": 8},
    )
    app = {
        RUNTIME: runtime,
        WORKER: worker,
        STEPPER: stepper,
        SETTINGS: stage_settings(1, 3, global_batch=8),
        STAGE_METRICS: NoMetrics(),
    }

    def start(lookahead: int | None) -> None:
        spec = RoundSpec(
            "step-s1-r0", 1, ("http://a", "http://b"), 0, "fp32", WAIT_S, kind="step", step=0, lookahead=lookahead
        )
        averager.start(spec)

    yield app, runtime, scripted, start
    scripted.apply.set()
    await averager.close()
    worker.close()


def forward(n: int, *, admitted_step: int | None, eval: bool = False) -> StageRequest:
    torch.manual_seed(n)
    return StageRequest(
        f"mb{n}", n, "fp32", eval, torch.randn(2, 8, CFG.d_model), None, None, admitted_step=admitted_step
    )


async def test_a_forward_of_the_next_step_waits_for_the_round_and_runs_on_its_weights(replica):
    app, runtime, scripted, start = replica
    start(lookahead=0)  # the sync schedule: step 1's microbatches need step 1's weights
    held = asyncio.create_task(run_forward(app, forward(1, admitted_step=1)))
    done, _ = await asyncio.wait({held}, timeout=0.5)  # a forward that does not hold has run by now
    assert not done and runtime.forward_steps == []
    scripted.apply.set()
    reply = await asyncio.wait_for(held, WAIT_S)
    assert runtime.forward_steps == [1] and reply["step"] == 1
    # the wait is the step's, not this replica's speed: the reply says it, and a chain's
    # forward_s (the trainer's wiring) leaves it out
    assert reply["step_wait_s"] >= 0.5


async def test_forwards_that_the_round_does_not_concern_run_at_once(replica):
    """A microbatch of the round's own step, one whose admission allows the weights before
    (the ``async`` schedule's lookahead), an evaluation, a trainer without admission, a
    round from a coordinator that does not move stages early (no lookahead): none waits."""
    app, runtime, scripted, start = replica
    start(lookahead=0)
    for n, req in enumerate(
        [forward(2, admitted_step=0), forward(3, admitted_step=None), forward(4, admitted_step=1, eval=True)]
    ):
        reply = await asyncio.wait_for(run_forward(app, req), WAIT_S)
        assert reply["step"] == 0 and len(runtime.forward_steps) == n + 1 and reply["step_wait_s"] < 0.5
    scripted.apply.set()
    await asyncio.wait_for(app[STEPPER].wait_round("step-s1-r0", WAIT_S), WAIT_S)
    assert runtime.step == 1


@pytest.mark.parametrize("lookahead", [1, None])
async def test_an_admission_that_allows_the_weights_before_does_not_wait(replica, lookahead):
    app, runtime, scripted, start = replica
    start(lookahead=lookahead)
    reply = await asyncio.wait_for(run_forward(app, forward(5, admitted_step=1)), WAIT_S)
    assert reply["step"] == 0 and runtime.forward_steps == [0]
