"""``SWARM_SYNC=local`` (DiLoCo) without a network: the outer step's maths, a replica's
inner steps on its own gradient, and the outer state travelling with a replica's state."""

from __future__ import annotations

import pytest
import torch

from services.stage_server.local_sync import OuterConfig, OuterOptimizer
from services.stage_server.runtime import OptimizerConfig, StageRuntime, flat_parameters
from services.stage_server.state import OUTER_ANCHOR, OUTER_MOMENTUM, load_stage_state, stage_state
from shared.errors import BadPayload
from shared.model import PRESETS

CFG = PRESETS["tiny"]


def test_the_outer_step_is_sgd_with_nesterov_momentum_on_the_anchor():
    anchor = torch.tensor([1.0, 2.0, 3.0])
    outer = OuterOptimizer(OuterConfig(every=5, lr=0.5, momentum=0.9), anchor)
    weights = torch.tensor([0.0, 2.0, 4.0])
    delta = outer.outer_gradient(weights)
    assert torch.equal(delta, torch.tensor([1.0, 0.0, -1.0]))
    new = outer.step(delta)
    # m = delta; update = delta + 0.9 m = 1.9 delta; anchor - 0.5 * 1.9 * delta
    assert torch.allclose(new, anchor - 0.95 * delta) and torch.equal(outer.anchor, new)
    again = outer.step(delta)  # m = 0.9 delta + delta = 1.9 delta; update = delta + 0.9 * 1.9 delta = 2.71 delta
    assert torch.allclose(again, new - 0.5 * 2.71 * delta)
    assert outer.steps == 2 and outer.samples == 0
    assert [s for s in range(1, 16) if outer.due(s)] == [5, 10, 15] and not outer.due(0)


def test_outer_lr_1_without_momentum_is_plain_averaging():
    a, b = torch.tensor([0.0, 4.0]), torch.tensor([2.0, 0.0])
    outer = OuterOptimizer(OuterConfig(every=1, lr=1.0, momentum=0.0), torch.tensor([1.0, 1.0]))
    mean_delta = (outer.outer_gradient(a) + outer.outer_gradient(b)) / 2
    assert torch.allclose(outer.step(mean_delta), (a + b) / 2)


@pytest.mark.parametrize("bad", [dict(every=0), dict(lr=0.0), dict(momentum=1.0), dict(momentum=-0.1)])
def test_outer_config_refuses_what_has_no_meaning(bad):
    with pytest.raises(AssertionError):
        OuterConfig(**bad)


def local_runtime(every=3) -> StageRuntime:
    return StageRuntime(
        CFG,
        1,
        4,
        seed=0,
        optim=OptimizerConfig(global_batch=4),
        solo=False,
        outer=OuterConfig(every=every, lr=0.7, momentum=0.9),
    )


def hidden(seed=0):
    return torch.randn(2, 8, CFG.d_model, generator=torch.Generator().manual_seed(seed))


def test_replicas_step_on_their_own_gradients_then_one_outer_step_makes_them_one():
    a, b = local_runtime(), local_runtime()
    assert a.digest() == b.digest()
    for step in range(3):
        a.backward(f"a{step}", 0, hidden(step), None, hidden(10 + step), bucket=step)
        b.backward(f"b{step}", 0, hidden(20 + step), None, hidden(30 + step), bucket=step)
        a.inner_step(a.take_gradients(step))
        b.inner_step(b.take_gradients(step))
    assert a.step == b.step == 3 and a.outer.due(3)
    assert not torch.equal(flat_parameters(a.params), flat_parameters(b.params))  # each learned from its own samples
    assert a.outer.samples == b.outer.samples == 6
    mean = (a.outer_gradient() + b.outer_gradient()) / 2
    a.outer_step(mean)
    b.outer_step(mean)
    assert torch.equal(flat_parameters(a.params), flat_parameters(b.params))  # one model again
    assert a.digest() == b.digest() and a.outer.steps == 1


def test_a_replica_that_served_nothing_passes_the_step_without_moving():
    rt = local_runtime()
    before = flat_parameters(rt.params)
    rt.inner_step(rt.take_gradients(0))
    assert rt.step == 1 and torch.equal(flat_parameters(rt.params), before) and rt.outer.samples == 0


def test_a_joiner_takes_the_anchor_and_momentum_with_the_state():
    donor, joiner = local_runtime(every=1), local_runtime(every=1)
    donor.backward("x", 0, hidden(1), None, hidden(2), bucket=0)
    donor.inner_step(donor.take_gradients(0))
    donor.outer_step(donor.outer_gradient())
    tensors, meta = stage_state(donor)
    assert OUTER_ANCHOR in tensors and OUTER_MOMENTUM in tensors
    load_stage_state(joiner, tensors, meta)
    assert joiner.digest() == donor.digest() and torch.equal(joiner.outer.momentum, donor.outer.momentum)
    # a state of a global-mode run: the anchor starts at its weights
    plain = StageRuntime(CFG, 1, 4, seed=5, optim=OptimizerConfig(global_batch=4), solo=False)
    g_tensors, g_meta = stage_state(plain)
    load_stage_state(joiner, g_tensors, g_meta)
    assert torch.equal(joiner.outer.anchor, flat_parameters(plain.params)) and not joiner.outer.momentum.any()
    # half of the outer state is refused, and leaves the replica as it was
    half = {k: v for k, v in tensors.items() if k != OUTER_MOMENTUM}
    with pytest.raises(BadPayload, match="outer"):
        load_stage_state(joiner, half, meta)
    assert torch.equal(joiner.outer.anchor, flat_parameters(plain.params))
