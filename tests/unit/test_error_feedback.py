"""Error feedback in step rounds (``error_feedback.py``): the residuals' bookkeeping, and
step rounds of real ``Averager``s and stage runtimes over an in-memory transport (no
sockets): with error feedback, what the replicas applied over many steps adds up to what
they computed, within one step's compression error (without it, the error of a constant
gradient adds up step after step); the replicas stay bit-identical; a state loaded in
between leaves the residuals behind."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.stage_server.allreduce import Averager, PartMessage, RoundSpec, _parse_part_request, decode_values
from services.stage_server.error_feedback import ErrorFeedback
from services.stage_server.runtime import Accumulated, ComputeWorker, StageRuntime
from services.stage_server.state import load_stage_state, stage_state
from services.stage_server.stepping import StepRound
from shared.codec import unpack_message
from shared.errors import BadPayload
from shared.log import get_logger
from shared.model import PRESETS

URLS = ("http://127.0.0.1:1", "http://127.0.0.1:2")


# --------------------------------------------------------------------------- the residuals
def test_the_residuals_go_into_the_next_contribution_and_reduction_of_the_same_weights():
    ef = ErrorFeedback(6)
    g, at = torch.ones(6), (3, 1)
    assert ef.contribution(g, 4.0, at) is g  # nothing held yet
    ef.commit(torch.arange(6.0), (2, torch.tensor([10.0, 20.0])), at)
    assert torch.equal(ef.contribution(g, 4.0, at), g + torch.arange(6.0))
    assert torch.equal(ef.for_part(2, 4, at), torch.tensor([10.0, 20.0]))
    assert torch.equal(ef.for_part(3, 6, at), torch.tensor([20.0, 0.0, 0.0]))  # the part moved: the overlap
    # a replica that served no sample adds nothing, and keeps its residual for a step it serves
    assert ef.contribution(g, 0.0, at) is g
    ef.commit(None, None, (4, 2))
    assert torch.equal(ef.contribution(g, 4.0, (4, 2)), g + torch.arange(6.0)) and ef.resets == 0
    # another write of the weights (a resync, a join, a repair, a catch-up): the residuals are dropped
    assert ef.contribution(g, 4.0, (9, 2)) is g and ef.resets == 1
    assert torch.equal(ef.for_part(0, 2, (9, 2)), torch.zeros(2))


def test_a_round_start_says_whether_its_members_use_error_feedback():
    msg = {"round_id": "r", "stage": 3, "members": list(URLS), "index": 0, "codec": "int4", "timeout_s": 5.0}
    assert RoundSpec.from_message(msg, 3).error_feedback is False  # a coordinator that does not say: off
    assert RoundSpec.from_message({**msg, "error_feedback": True}, 3).error_feedback is True
    with pytest.raises(BadPayload, match="error_feedback"):
        RoundSpec.from_message({**msg, "error_feedback": "yes"}, 3)


# --------------------------------------------------------------------------- rounds of two replicas
class Loopback:
    """The averagers' transport: a post goes straight to the peer ``Averager``, as its routes would."""

    def __init__(self):
        self.averagers: dict[str, Averager] = {}

    async def post(self, url: str, body: bytes, *, timeout_s: float) -> dict:
        base, _, path = url.rpartition("/average/")
        averager, msg = self.averagers[base], unpack_message(body)
        if path == "part":
            averager.accept_part(PartMessage.from_message(msg), decode_values(msg["data"], averager.num_params))
            return {}
        reduced = await averager.result(*_parse_part_request(msg))
        return unpack_message(reduced.body)


@pytest.fixture
async def pair():
    """Two replicas of stage 3 of 4 (the head: a vocabulary x width matrix) with their averagers;
    each records the mean gradient of every step it applies."""
    transport, members, workers = Loopback(), [], []
    for url in URLS:
        runtime = StageRuntime(PRESETS["tiny"], 3, 4, seed=0, solo=False)
        runtime.applied = []
        apply_step = runtime.apply_step
        runtime.apply_step = lambda g, r=runtime, apply=apply_step: (r.applied.append(g.mean.clone()), apply(g))
        worker = ComputeWorker(max_queue=4)
        averager = Averager(runtime, worker.run, int8_block=128, log=get_logger(test="error-feedback"))
        averager.transport = transport
        averager.kinds["step"] = StepRound(averager)
        transport.averagers[url] = averager
        members.append(averager), workers.append(worker)
    yield members
    for averager, worker in zip(members, workers):
        await averager.close()
        worker.close()


def gradients(num: int, seed: int) -> torch.Tensor:
    return torch.randn(num, generator=torch.Generator().manual_seed(seed)) * 1e-2


async def step_round(members: list[Averager], grads: list[torch.Tensor], codec: str, error_feedback: bool) -> None:
    """One step round of ``members`` on ``grads`` (4 samples each); every member steps."""
    step = members[0].runtime.step
    for i, (averager, g) in enumerate(zip(members, grads)):
        averager.runtime.give_back(Accumulated(g, 4, frozenset({f"mb-{i}-{step}"})), step)
    for i, averager in enumerate(members):
        spec = RoundSpec(f"r{step}", 3, URLS, i, codec, 10.0, kind="step", step=step, error_feedback=error_feedback)
        averager.start(spec)
    await asyncio.gather(*(a._task for a in members))
    assert all(a.runtime.step == step + 1 for a in members), [a.last_round.summary() for a in members]


@pytest.mark.parametrize("codec", ["int8", "int4"])
async def test_with_error_feedback_what_was_applied_adds_up_to_what_was_computed(pair, codec):
    """A constant gradient, 8 steps: the sum of the applied means stays within about one step's
    compression error of the sum of the true means with error feedback; without it, the same
    error is made every step and adds up. The replicas apply the same values every step."""
    num = pair[0].num_params
    grads = [gradients(num, 1), gradients(num, 2)]
    true_mean = (grads[0] + grads[1]) / 2
    drift = {}
    for on in (False, True):
        for averager in pair:
            averager.runtime.applied.clear()
        for _ in range(8):
            await step_round(pair, grads, codec, on)
        first, second = (torch.stack(a.runtime.applied) for a in pair)
        assert torch.equal(first, second), "the replicas applied different gradients"
        drift[on] = float((first.sum(0) - 8 * true_mean).norm() / true_mean.norm())
        one_step = float((first[0] - true_mean).norm() / true_mean.norm())
    assert pair[0].runtime.digest() == pair[1].runtime.digest()
    assert drift[True] < 2 * one_step < drift[False] / 2, (drift, one_step)


async def test_a_state_loaded_between_steps_leaves_the_residuals_behind(pair):
    """A replica that loads a state (here its own: a resync, a join or a repair alike) starts the
    next round without residuals; its peer keeps its own; the replicas stay identical."""
    num = pair[0].num_params
    for k in range(2):
        await step_round(pair, [gradients(num, 10 + k), gradients(num, 20 + k)], "int4", True)
    assert pair[0].kinds["step"].feedback.made_at is not None
    first = pair[0].runtime
    await pair[0].run_compute(lambda: load_stage_state(first, *stage_state(first)))
    await step_round(pair, [gradients(num, 30), gradients(num, 40)], "int4", True)
    assert [a.kinds["step"].feedback.resets for a in pair] == [1, 0]
    assert pair[0].runtime.digest() == pair[1].runtime.digest()
    assert pair[0].last_round.summary()["error_feedback"] is True
